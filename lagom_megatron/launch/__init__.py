"""Launching a run: ``lagom doctor``, the SLURM / torchrun environment, presets as Megatron-LM command
lines, and the hooks a patched Megatron-LM ``pretrain_gpt.py`` calls. docs/launching.md."""
