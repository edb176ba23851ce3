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
    """The next iteration's work; ``assignment``: missing = NCCL defaults; ``serialize``: wait per call (T_comp)."""

    iteration: int
    kind: StepKind
    assignment: dict[str, CommConfig]
    serialize: bool = False
    timed: bool = True
    probe_index: int | None = None


@dataclass(kw_only=True, slots=True)
class IterationMeasurement:
    """One iteration, us: the slowest rank's ``iteration_us``, one ``Sample`` per site region (calls summed)."""

    iteration: int
    iteration_us: float
    sites: list[CollectiveSite] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (self.iteration_us > 0 and math.isfinite(self.iteration_us)):
            raise ValueError(
                f"iteration {self.iteration}: iteration_us must be a positive finite number; got {self.iteration_us!r}"
            )
