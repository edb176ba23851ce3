"""Pre-flight: the rules ``lagom doctor`` and ``pretrain_gpt.py`` run on a run's shape before any rank starts."""
