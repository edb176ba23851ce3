"""lagom_megatron: Lagom (arXiv 2602.20656) for Megatron-Core.

Profiles every collective that overlaps computation during the first warm-up iterations, fits a
unified cost model of communication time and of the slowdown communication inflicts on compute,
searches each collective's NCCL configuration with a linear-time priority search, and applies it
through stock NCCL mechanisms.

Subpackages:
    engine       cost model, knob space, search, plan files (standard library + numpy only)
    integration  Megatron-Core / torch.distributed side: training entry point, hooks, profiler
"""

__version__ = "0.1.0"
