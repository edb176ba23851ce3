"""lagom_megatron: Lagom (arXiv 2602.20656) for Megatron-Core: profiles the collectives overlapping compute, fits a
cost model of communication time and compute slowdown, and applies each collective's best NCCL configuration through
stock NCCL. Subpackages and their import rules: docs/architecture.md."""

import os
from pathlib import Path

__version__ = "0.1.0"


def configs_dir() -> tuple[Path, str]:
    """The YAML configurations' folder (``$LAGOM_CONFIGS``, the package's ``configs/``, the source tree's), origin."""
    given = os.environ.get("LAGOM_CONFIGS")
    if given:
        return Path(given), "LAGOM_CONFIGS"
    packaged = Path(__file__).resolve().parent / "configs"
    if packaged.is_dir():
        return packaged, "the installed package"
    return Path(__file__).resolve().parent.parent / "configs", "the source tree"
