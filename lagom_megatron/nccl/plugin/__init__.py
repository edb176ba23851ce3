"""lagom's NCCL tuner plugin: C sources (``plugin.c``, ``table.c``, ``lagom_tuner.h``, ``plugin_internal.h``;
the C test harness under ``test/``) and their builder (``build.py``).

See ``docs/nccl.md`` for the plan-table format and how NCCL loads the plugin.
"""

from lagom_megatron.nccl.plugin.build import LIBRARY_NAME, PLUGIN_DIR, build_harness, build_tuner, find_compiler

__all__ = ["LIBRARY_NAME", "PLUGIN_DIR", "build_harness", "build_tuner", "find_compiler"]
