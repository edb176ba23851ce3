"""Pre-flight: the checks ``lagom doctor`` and ``pretrain_gpt.py`` run before any rank starts.

Each rule reads a run's shape, flags and environment and returns findings; nothing here starts a process.
"""
