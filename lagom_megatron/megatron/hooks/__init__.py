"""How Megatron's collectives reach lagom: the patches, the site of each call, routing and timing."""
