"""Stand-in of ``transformer_engine.pytorch.attention.dot_product_attention``."""
