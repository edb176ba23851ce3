"""Launching a run: ``lagom doctor`` and its rules, the SLURM / torchrun environment of the launch
scripts, presets as Megatron-LM command lines, and the hooks a patched Megatron-LM
``pretrain_gpt.py`` calls. docs/launching.md.
"""
