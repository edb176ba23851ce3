"""What passes between the tuner and a backend each iteration: the lifecycle ``Phase``, the ``Step``
the backend must run, and the ``IterationMeasurement`` it reports back (``tuner.py`` drives them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.profile import CollectiveSite, Sample


class Phase(Enum):
    """Where the tuner is in its lifecycle (module docstring gives the schedule)."""

    PROFILING = "profiling"
    PROBING = "probing"
    SEARCHED = "searched"
    VERIFYING = "verifying"
    APPLIED = "applied"
    FELL_BACK = "fell_back"


StepKind = Literal["warmup", "default", "serialized", "probe", "settle", "verify-plan", "verify-default", "applied", "fell-back"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """What the next iteration must do.

    ``assignment`` maps site id -> CommConfig to apply (a missing site = NCCL defaults).
    ``serialize``: wait on every collective right after launching it (T_comp measurement).
    ``timed``: whether the tuner uses this iteration's measurement (backends may skip timing
    collectives when it is false).
    """

    iteration: int
    kind: StepKind
    assignment: dict[str, CommConfig]
    serialize: bool = False
    timed: bool = True
    probe_index: int | None = None
    """Index into the probe configs for ``kind == "probe"``."""


@dataclass(kw_only=True, slots=True)
class IterationMeasurement:
    """What a backend measured in one iteration.

    ``iteration_us``: wall time of the whole iteration (slowest rank), microseconds.
    ``sites``: the collective sites seen in the iteration (may be empty after profiling).
    ``samples``: one ``Sample`` per site region (its ``config`` is what was applied; ``t_comm_us``
    sums all calls of the site; ``t_comp_us`` may be NaN where compute alone was not measured).
    """

    iteration: int
    iteration_us: float
    sites: list[CollectiveSite] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (self.iteration_us > 0 and math.isfinite(self.iteration_us)):
            raise ValueError(f"iteration {self.iteration}: iteration_us must be a positive finite number; got {self.iteration_us!r}")
