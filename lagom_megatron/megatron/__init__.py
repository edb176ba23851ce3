"""lagom's runtime inside Megatron-Core (``--lagom``): collective sites, the one module that patches
Megatron-Core, the router, the communicator pool, the profiler, rank consensus, the controller
that drives the engine's tuner from training callbacks, and the per-run report.

Imports ``engine``, ``nccl`` and ``config``; torch and Megatron-Core are imported inside the
functions that need them, so importing this package is cheap. docs/integration.md.
"""
