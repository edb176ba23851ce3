"""Megatron-Core and torch.distributed side of lagom: training entry point, CPU shims, collective
site hooks, warm-up profiler, communicator pool. Depends on the engine, never the reverse."""
