"""lagom_megatron: Lagom (arXiv 2602.20656) for Megatron-Core.

Profiles the collectives that overlap compute in warm-up, fits a cost model of communication time and
compute slowdown, searches each collective's NCCL configuration and applies it through stock NCCL.
Subpackages and their import rules: docs/architecture.md.
"""

import os
from pathlib import Path

__version__ = "0.1.0"


def configs_dir() -> tuple[Path, str]:
    """Where the YAML configurations are: ``$LAGOM_CONFIGS``, else the installed package's ``configs/``,
    else the source tree's; with the origin's name for error messages."""
    given = os.environ.get("LAGOM_CONFIGS")
    if given:
        return Path(given), "LAGOM_CONFIGS"
    packaged = Path(__file__).resolve().parent / "configs"
    if packaged.is_dir():
        return packaged, "the installed package"
    return Path(__file__).resolve().parent.parent / "configs", "the source tree"
