"""lagom's runtime inside Megatron-Core (``--lagom``); torch and Megatron-Core load lazily (docs/integration.md)."""
