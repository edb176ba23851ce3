"""The Lagom engine: knobs, clusters, cost model, search, plans; stdlib, numpy, PyYAML only (no torch, no Megatron)."""
