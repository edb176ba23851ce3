"""The YAML under ``configs/``: schemas and loaders of model files and presets; cluster files are read by
``engine.cluster``. docs/launching.md."""
