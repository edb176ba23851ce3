"""Applying a plan on NCCL (rules, variables, options, pool entries, plugin, exports); imports ``engine`` only."""
