"""lagom_megatron: Lagom (arXiv 2602.20656) for Megatron-Core.

Profiles every collective that overlaps computation during the first warm-up iterations, fits a
unified cost model of communication time and of the slowdown communication inflicts on compute,
searches each collective's NCCL configuration with a linear-time priority search, and applies it
through stock NCCL mechanisms.

Subpackages (docs/architecture.md: what each owns and may import):
    engine    knob space, cost model, search, plans, tuner lifecycle (never torch or Megatron)
    nccl      applying configurations on NCCL: knob scopes, env, pool options, tuner plugin, exports
    config    model and preset YAML schemas
    sim       the simulated GPU cluster
    megatron  the --lagom runtime inside Megatron-Core: sites, patches, router, profiler, controller
    training  our pretrain_gpt on megatron-core: arguments, model, data, CPU shims, loop
    launch    lagom doctor, SLURM environment, Megatron-LM command lines and patch hooks
    cli       the lagom command
"""

import os
from pathlib import Path

__version__ = "0.1.0"


def configs_dir() -> tuple[Path, str]:
    """Where the YAML configurations (``clusters/``, ``models/``, ``presets/``) are, and what says so.

    ``$LAGOM_CONFIGS`` when set; else the copy an installed wheel carries inside the package
    (``lagom_megatron/configs/``, from ``pyproject.toml``'s package data); else the source tree's
    ``configs/`` (a checkout, or an editable install of it).

    Returns:
        (the folder, ``"LAGOM_CONFIGS"``, ``"the installed package"`` or ``"the source tree"``): the
        second names the origin in error messages.
    """
    given = os.environ.get("LAGOM_CONFIGS")
    if given:
        return Path(given), "LAGOM_CONFIGS"
    packaged = Path(__file__).resolve().parent / "configs"
    if packaged.is_dir():
        return packaged, "the installed package"
    return Path(__file__).resolve().parent.parent / "configs", "the source tree"
