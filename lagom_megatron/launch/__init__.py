"""``lagom doctor``, SLURM / torchrun variables, presets as Megatron-LM lines, Megatron-LM hooks (docs/launching.md)."""
