"""Applying a plan on NCCL: knob scopes per mechanism and NCCL version, variable grammar and checks, the env file,
``ncclConfig_t`` options and pool entries, the C tuner plugin, plan exports. Imports ``engine`` only (torch lazily)."""
