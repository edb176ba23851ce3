"""Communicators per configuration: the pool, its gloo and NCCL backends, the first-call guard."""
