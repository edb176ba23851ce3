"""Stand-in of ``transformer_engine.pytorch.attention``."""
