"""Our ``pretrain_gpt.py`` on ``megatron-core``: Megatron-LM's arguments, the GPT model, data, tokenizers, CPU
shims for gloo, and the training loop that calls the ``--lagom`` controller. docs/training.md."""
