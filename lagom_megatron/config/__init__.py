"""The YAML under ``configs/``: model file and preset schemas and loaders (clusters: ``engine.cluster``)."""
