"""The YAML under ``configs/``: schemas and loaders of model files and presets (a model, a parallel
layout, batch, overlap flags, environment, lagom settings and SLURM shape). Cluster files are read
by ``engine.cluster``, which the engine needs on its own. docs/launching.md.
"""
