"""Coordinate-descent primitives of every searcher; each counts its model evaluations in a ``Counter``."""

from __future__ import annotations

import numpy as np

from lagom_megatron.engine.problem import SEARCH_KNOBS, SIMPLE, SearchProblem, State, compat

TIE_REL = 1e-3
"""Objectives within this fraction of the best tie; a tie goes to fewer channels, threads, chunk bytes."""
RESOURCE_KNOBS = ("n_channels", "n_threads", "chunk_size")


class Counter:
    """Counts model evaluations (one per evaluated (site, config) pair)."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> None:
        self.n += int(k)


def _objective(problem: SearchProblem, idx, alg, proto, nc, nt, lvl, objective: str) -> np.ndarray:
    t_comm, _, t_region = problem.evaluate_codes(idx, alg, proto, nc, nt, lvl)
    return t_comm if objective == "comm" else t_region


def scan_knob(
    problem: SearchProblem, st: State, idx: np.ndarray, knob: str, objective: str, count: Counter, min_gain: float = 0.0
) -> np.ndarray:
    """Scans ``knob`` over sites ``idx`` at once, taking values better by > ``min_gain``; mutates ``st``; the sites
    it moved (empty: none)."""
    idx = idx[problem.tunable[knob][idx]]
    if idx.size == 0:
        return idx
    vals = problem.vals[knob][idx]  # (B, K)
    valid = ~np.isnan(vals)
    codes = {k: st.get(k)[idx][:, None] for k in SEARCH_KNOBS}  # (B, 1) each
    cand = np.where(valid, vals, 0.0)
    if knob == "algorithm":
        alg = cand.astype(np.int64)
        proto = np.where(compat(alg, codes["protocol"]), codes["protocol"], SIMPLE)
        args = (alg, proto, codes["n_channels"], codes["n_threads"], codes["chunk_size"])
    elif knob == "protocol":
        args = (codes["algorithm"], cand.astype(np.int64), codes["n_channels"], codes["n_threads"], codes["chunk_size"])
    elif knob == "n_channels":
        args = (codes["algorithm"], codes["protocol"], cand, codes["n_threads"], codes["chunk_size"])
    elif knob == "n_threads":
        args = (codes["algorithm"], codes["protocol"], codes["n_channels"], cand, codes["chunk_size"])
    else:
        args = (codes["algorithm"], codes["protocol"], codes["n_channels"], codes["n_threads"], cand.astype(np.int64))
    obj = _objective(problem, idx[:, None], *args, objective)
    obj = np.where(valid, obj, np.inf)
    cur = _objective(
        problem,
        idx,
        *(
            c[:, 0]
            for c in (
                codes["algorithm"],
                codes["protocol"],
                codes["n_channels"],
                codes["n_threads"],
                codes["chunk_size"],
            )
        ),
        objective,
    )
    count.add(valid.sum() + idx.size)
    best = np.argmin(obj, axis=1)
    best_obj = obj[np.arange(idx.size), best]
    better = best_obj < cur * (1.0 - max(min_gain, 1e-9)) - 1e-12
    if knob in RESOURCE_KNOBS and min_gain == 0.0:
        # ties (within TIE_REL of the best) go to the fewest resources, also away from the current value
        res = _resource(problem, knob, cand, codes["protocol"])
        res = np.where(valid, res, np.inf)
        tied = obj <= best_obj[:, None] * (1.0 + TIE_REL) + 1e-12
        pick = np.argmin(np.where(tied, res, np.inf), axis=1)
        r_cur = _resource(problem, knob, codes[knob], codes["protocol"])[:, 0]
        r_pick = res[np.arange(idx.size), pick]
        o_pick = obj[np.arange(idx.size), pick]
        fewer = (r_pick < r_cur) & (o_pick <= cur * (1.0 + TIE_REL) + 1e-12)
        best = np.where(better | fewer, pick, best)
        better = better | fewer
    if not better.any():
        return idx[:0]
    rows = idx[better]
    chosen = cand[better, best[better]]
    if knob == "algorithm":
        st.alg[rows] = chosen.astype(np.int64)
        st.proto[rows] = np.where(compat(st.alg[rows], st.proto[rows]), st.proto[rows], SIMPLE)
    elif knob == "protocol":
        st.proto[rows] = chosen.astype(np.int64)
    elif knob == "chunk_size":
        st.lvl[rows] = chosen.astype(np.int64)
    else:
        st.get(knob)[rows] = chosen
    return rows


def _resource(problem: SearchProblem, knob: str, values: np.ndarray, proto: np.ndarray) -> np.ndarray:
    """A value's resource cost: channels, threads, or chunk bytes (level 0 = the protocol's default chunk)."""
    if knob != "chunk_size":
        return values
    lvl = values.astype(np.int64)
    p = np.broadcast_to(proto, lvl.shape)
    b = problem.chunk_bytes(p, lvl)
    return np.where(lvl == 0, problem.chunk_bytes(p, np.full_like(lvl, 4)), b)


def decide_unit(
    problem: SearchProblem,
    st: State,
    knob: str,
    governed: np.ndarray,
    objective: str,
    count: Counter,
    default_nc: np.ndarray,
    *,
    lookahead: bool = False,
) -> None:
    """Decides a communicator- or process-scope knob once for ``governed``: least summed objective, with
    ``lookahead`` after one pass of their per-call knobs. NCCL channels are a cap (ncclConfig_t.maxCTAs)."""
    row = problem.vals[knob][governed[0]]
    values = row[~np.isnan(row)]
    K = values.size
    codes = {k: np.broadcast_to(st.get(k)[governed][None, :], (K, governed.size)) for k in SEARCH_KNOBS}
    cand = np.broadcast_to(values[:, None], (K, governed.size))
    if knob == "n_channels" and problem.backend != "gloo" and problem.scope[knob] != "call":
        cand = np.minimum(default_nc[governed][None, :], cand)
    codes = dict(codes)
    codes[knob] = cand.astype(np.int64) if knob in ("algorithm", "protocol", "chunk_size") else cand
    if knob == "algorithm":
        codes["protocol"] = np.where(compat(codes["algorithm"], codes["protocol"]), codes["protocol"], SIMPLE)
    if lookahead:
        # judge each value by what one pass of the sites' per-call knobs makes of it, not by their start configs
        call_knobs = tuple(kn for kn in SEARCH_KNOBS if problem.scope[kn] == "call")
        totals = np.empty(K)
        for j in range(K):
            trial = st.copy()
            for name in SEARCH_KNOBS:
                trial.get(name)[governed] = codes[name][j]
            descend(problem, trial, governed, call_knobs, objective, count, rounds=1)
            t_comm, _, t_region = problem.evaluate(trial, governed)
            count.add(governed.size)
            totals[j] = (t_comm if objective == "comm" else t_region).sum()
    else:
        obj = _objective(
            problem,
            governed[None, :],
            codes["algorithm"],
            codes["protocol"],
            codes["n_channels"],
            codes["n_threads"],
            codes["chunk_size"],
            objective,
        )
        count.add(obj.size)
        totals = obj.sum(axis=1)
    k = int(np.argmin(totals))
    if knob in ("n_channels", "n_threads"):
        tied = np.flatnonzero(totals <= totals[k] * (1.0 + TIE_REL) + 1e-12)
        k = int(tied[np.argmin(values[tied])])
    for name in SEARCH_KNOBS:
        if name == knob or (knob == "algorithm" and name == "protocol"):
            st.get(name)[governed] = codes[name][k]


def descend(
    problem: SearchProblem,
    st: State,
    idx: np.ndarray,
    knobs: tuple[str, ...],
    objective: str,
    count: Counter,
    rounds: int,
    min_gain: float = 0.0,
) -> None:
    """Coordinate descent of call-scope ``knobs`` for sites ``idx``: at most ``rounds`` passes, to a fixed point. A
    site's objective depends on its own codes alone, so a site no pass moved is at its fixed point: later passes scan
    only the sites the last one moved (same result as rescanning all)."""
    for _ in range(rounds):
        moved = [scan_knob(problem, st, idx, knob, objective, count, min_gain) for knob in knobs]
        idx = np.unique(np.concatenate(moved)) if moved else idx[:0]
        if idx.size == 0:
            return


class DescentMemo:
    """Descents already run from whole states: a site that starts where it started in an earlier descent (same codes,
    same knobs, rounds and objective) ends where it ended then, so only the other sites are descended again."""

    def __init__(self) -> None:
        self._runs: list[tuple[State, State, np.ndarray]] = []

    def descend(
        self,
        problem: SearchProblem,
        st: State,
        idx: np.ndarray,
        knobs: tuple[str, ...],
        objective: str,
        count: Counter,
        rounds: int,
    ) -> None:
        start, todo = st.copy(), idx
        for s0, s1, done in self._runs:
            same = done[todo] & np.all([s0.get(k)[todo] == start.get(k)[todo] for k in SEARCH_KNOBS], axis=0)
            for k in SEARCH_KNOBS:
                st.get(k)[todo[same]] = s1.get(k)[todo[same]]
            todo = todo[~same]
        descend(problem, st, todo, knobs, objective, count, rounds)
        done = np.zeros(len(problem.sites), dtype=bool)
        done[idx] = True
        self._runs.append((start, st.copy(), done))
