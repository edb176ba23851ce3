"""Our ``pretrain_gpt.py`` on ``megatron-core``: arguments, model, data, CPU shims, loop (docs/training.md)."""
