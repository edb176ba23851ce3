"""Between tuner and backend each iteration: the ``Phase``, the ``Step`` to run, the ``IterationMeasurement``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.profile import CollectiveSite, Sample


class Phase(Enum):
    """Where the tuner is in its lifecycle (schedule: ``tuner`` module docstring)."""

    PROFILING = "profiling"
    PROBING = "probing"
    SEARCHED = "searched"
    VERIFYING = "verifying"
    APPLIED = "applied"
    FELL_BACK = "fell_back"


StepKind = Literal[
    "warmup", "default", "serialized", "probe", "settle", "verify-plan", "verify-default", "applied", "fell-back"
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """What the next iteration must do. ``assignment``: site id -> CommConfig (missing = NCCL defaults);
    ``serialize``: wait on each collective at launch (T_comp); ``timed`` False: the measurement is ignored."""

    iteration: int
    kind: StepKind
    assignment: dict[str, CommConfig]
    serialize: bool = False
    timed: bool = True
    probe_index: int | None = None
    """Index into the probe configs for ``kind == "probe"``."""


@dataclass(kw_only=True, slots=True)
class IterationMeasurement:
    """What a backend measured in one iteration (us): ``iteration_us`` of the slowest rank; one ``Sample`` per
    site region (``t_comm_us`` summed over calls, ``t_comp_us`` NaN where not measured)."""

    iteration: int
    iteration_us: float
    sites: list[CollectiveSite] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (self.iteration_us > 0 and math.isfinite(self.iteration_us)):
            raise ValueError(
                f"iteration {self.iteration}: iteration_us must be a positive finite number; got {self.iteration_us!r}"
            )
