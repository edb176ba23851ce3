"""The per-rank controller that drives the engine's tuner, applies plans and checks what NCCL ran."""
