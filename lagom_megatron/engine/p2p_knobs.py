"""The point-to-point knob the per-site search does not scan: channels per network peer.

``net_peer_channels`` (NCCL's ``nChannelsPerNetPeer``) sets how many channels a send or receive to a
peer across the network may use (``engine.p2p``, step 3). It is one value per process
(``NCCL_NCHANNELS_PER_NET_PEER``) or per communicator (``ncclConfig_t.nChannelsPerNetPeer`` where
torch binds it), so, like the other knobs wider than a call (``descent.decide_unit``), it is decided
once for all the sites it governs: after the search, each candidate value of the unit's domain is
evaluated for the sum of those sites' region times with everything else as the search left it, and
the least wins; NCCL's own choice unless a value is strictly faster on the model.

The decision lives on the cost model's ``p2p.net_peer_S`` while the plan's times are predicted
(``SearchProblem.make_plan``), and is undone after, so the model stays NCCL's defaults for the next
search.
"""

from __future__ import annotations

from typing import Any

import numpy as np

KNOB = "net_peer_channels"


def units(problem: Any) -> list[tuple[str, np.ndarray]]:
    """(unit key, governed site indices): one unit for the process, or one per communicator (Megatron
    group) where the knob is per communicator; only sites whose domain holds more than NCCL's choice."""
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
    """Site index -> the channels per network peer chosen for it (sites left to NCCL are absent), on
    the cost model under state ``st`` (module docstring). The model is left as it was."""
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


def applied(problem: Any, chosen: dict[int, int]) -> "_Applied":
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
