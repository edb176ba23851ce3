"""Everything about applying a plan's configurations on NCCL.

Which knob NCCL lets lagom set at which scope (per call, communicator or process) for each
mechanism and NCCL version, NCCL's environment-variable grammar and lagom's checks of it, the env
file of process-scope knobs, ``ncclConfig_t`` options and communicator-pool entries, the C tuner
plugin and its build, and the plan export formats. Imports ``engine`` only (and torch inside the
functions that create communicators). docs/nccl.md.
"""
