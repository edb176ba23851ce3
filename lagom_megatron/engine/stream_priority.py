"""High-priority NCCL stream per communicator: removes the dispatch wait (``CostModel.wait_S``). Decided after the
search, on where the summed region shrinks by > ``GAIN_TOL``; on ``model.hp_S`` only while a plan is predicted."""

from __future__ import annotations

from typing import Any

import numpy as np

KNOB = "high_priority_stream"
GAIN_TOL = 1e-6


def units(problem: Any) -> list[tuple[str, np.ndarray]]:
    """(unit key, governed site indices), one per communicator whose sites may take the knob."""
    if problem.rules.scope(KNOB) is None:
        return []
    by_group: dict[str, list[int]] = {}
    for i, d in enumerate(problem.domains_S):
        if True in d.get(KNOB, (None,)):
            by_group.setdefault(problem.comm_S[i], []).append(i)
    return [(f"comm:{g}", np.array(ix)) for g, ix in by_group.items()]


def decide(problem: Any, st: Any) -> set[int]:
    """Site indices whose group runs on a high-priority stream under ``st``; the model is restored."""
    model = problem.model
    if getattr(model, "wait_S", None) is None or not model.wait_S.any():
        return set()
    chosen: set[int] = set()
    saved = None if model.hp_S is None else model.hp_S.copy()
    try:
        model.hp_S = np.zeros(len(problem.sites))
        everyone = np.arange(len(problem.sites))
        for _key, idx in units(problem):
            if not model.wait_S[idx].any():
                continue
            base = problem.evaluate(st, everyone)[2]
            model.hp_S[idx] = 1.0
            fast = problem.evaluate(st, everyone)[2]
            model.hp_S[idx] = 0.0
            if float(base.sum() - fast.sum()) > GAIN_TOL * float(base[idx].sum()):
                chosen.update(int(i) for i in idx)
    finally:
        model.hp_S = saved
    return chosen


class applied:
    """A context manager that puts ``chosen`` (site indices) on the model's ``hp_S`` for its body."""

    def __init__(self, problem: Any, chosen: set[int]) -> None:
        self.model = problem.model
        self.chosen = chosen

    def __enter__(self) -> None:
        self.saved = self.model.hp_S
        if self.chosen:
            hp = np.zeros(len(self.model.sites))
            hp[sorted(self.chosen)] = 1.0
            self.model.hp_S = hp

    def __exit__(self, *exc: Any) -> None:
        self.model.hp_S = self.saved
