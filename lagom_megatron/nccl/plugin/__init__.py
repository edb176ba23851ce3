"""lagom's NCCL tuner plugin: C sources, their test harness (``test/``) and builder (``build.py``); docs/nccl.md."""

from lagom_megatron.nccl.plugin.build import LIBRARY_NAME, PLUGIN_DIR, build_harness, build_tuner, find_compiler

__all__ = ["LIBRARY_NAME", "PLUGIN_DIR", "build_harness", "build_tuner", "find_compiler"]
