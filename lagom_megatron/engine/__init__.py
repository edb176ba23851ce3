"""The Lagom engine: knob space, cluster description, unified cost model, search, plan files.

Depends on the standard library, numpy and PyYAML only: never on torch or Megatron, so that a
plan can be searched, inspected and exported on any machine (a test enforces this).
"""
