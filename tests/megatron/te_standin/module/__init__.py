"""Stand-in of ``transformer_engine.pytorch.module`` (see the package docstring)."""
