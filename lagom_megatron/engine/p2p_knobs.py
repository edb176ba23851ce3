"""Channels per network peer (``nChannelsPerNetPeer``): one per process or communicator, decided after the search
(NCCL's own unless strictly faster); on ``model.p2p.net_peer_S`` only while a plan is predicted."""

from __future__ import annotations

from typing import Any

import numpy as np

KNOB = "net_peer_channels"


def units(problem: Any) -> list[tuple[str, np.ndarray]]:
    """(unit key, site indices) per process or communicator; only sites whose domain holds more than NCCL's choice."""
    scope = problem.rules.scope(KNOB)
    governed = [i for i, d in enumerate(problem.domains_S) if len(d.get(KNOB, (None,))) > 1]
    if scope is None or not governed:
        return []
    if scope == "process":
        return [("process", np.array(governed))]
    by_group: dict[str, list[int]] = {}
    for i in governed:
        by_group.setdefault(problem.comm_S[i], []).append(i)
    return [(f"comm:{g}", np.array(ix)) for g, ix in by_group.items()]


def decide(problem: Any, st: Any) -> dict[int, int]:
    """Site index -> channels per network peer (NCCL-default sites absent) under ``st``; the model is restored."""
    p2p = getattr(problem.model, "p2p", None)
    if p2p is None or not p2p.any:
        return {}
    chosen: dict[int, int] = {}
    saved = p2p.net_peer_S.copy()
    try:
        for _key, idx in units(problem):
            values = sorted({v for i in idx for v in problem.domains_S[i][KNOB] if v is not None})
            p2p.net_peer_S[idx] = 0.0
            best_v, best_t = None, float(np.sum(problem.evaluate(st, idx)[2]))
            for v in values:
                p2p.net_peer_S[idx] = float(v)
                t = float(np.sum(problem.evaluate(st, idx)[2]))
                if t < best_t * (1.0 - 1e-9):
                    best_v, best_t = v, t
            p2p.net_peer_S[idx] = 0.0
            if best_v is not None:
                chosen.update({int(i): int(best_v) for i in idx})
    finally:
        p2p.net_peer_S[:] = saved
    return chosen


def applied(problem: Any, chosen: dict[int, int]) -> _Applied:
    """A context manager that puts ``chosen`` on the model's ``p2p.net_peer_S`` for its body."""
    return _Applied(problem, chosen)


class _Applied:
    def __init__(self, problem: Any, chosen: dict[int, int]) -> None:
        self.p2p = getattr(problem.model, "p2p", None)
        self.chosen = chosen

    def __enter__(self) -> None:
        if self.p2p is not None and self.chosen:
            self.saved = self.p2p.net_peer_S.copy()
            for i, v in self.chosen.items():
                self.p2p.net_peer_S[i] = float(v)

    def __exit__(self, *exc: Any) -> None:
        if self.p2p is not None and self.chosen:
            self.p2p.net_peer_S[:] = self.saved
