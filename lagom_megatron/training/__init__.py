"""Our ``pretrain_gpt.py`` on the ``megatron-core`` package: Megatron-LM's arguments, the GPT
model, data and tokenizers, the CPU shims that let Megatron-Core train on gloo, and the training
loop that calls the ``--lagom`` controller. docs/training.md.
"""
