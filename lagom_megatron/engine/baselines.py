"""Baselines beside the priority search (docs/engine.md): ``nccl-default``, NCCL's choice everywhere; ``autoccl``,
each collective for its own T_comm as AutoCCL (NSDI'25), descent per (algorithm, protocol) pair, a move gaining
``AUTOCCL_MIN_GAIN``; ``exhaustive``, the cost model's joint optimum over a superset of priority's space."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from lagom_megatron.engine import p2p_knobs, stream_priority
from lagom_megatron.engine.cost_model import ALG_NONE
from lagom_megatron.engine.descent import Counter, decide_unit, descend
from lagom_megatron.engine.problem import SEARCH_KNOBS, SearchProblem, SearchResult, State, Timer, compat, register

AUTOCCL_MIN_GAIN = 0.01
"""Smallest relative T_comm gain the autoccl baseline acts on (below it, measurements cannot tell)."""
EXHAUSTIVE_LIMIT = 2_000_000


@register("nccl-default")
def nccl_default(problem: SearchProblem) -> SearchResult:
    """NCCL's defaults everywhere: the plan's entries are empty configs."""
    timer = Timer()
    stats = {"method": "nccl-default", "model_evaluations": 0, "wall_time_s": round(timer(), 6)}
    plan = problem.make_plan(None, method="nccl-default", stats=stats)
    return SearchResult(plan=plan, stats=plan.stats)


@register("autoccl")
def autoccl(problem: SearchProblem, *, rounds: int = 3) -> SearchResult:
    """AutoCCL-style tuning of each collective for its own T_comm (module docstring)."""
    timer, count = Timer(), Counter()
    st = problem.default_state()
    default_nc = st.nc.copy()
    for knob, _key, governed in problem.shared_units():
        decide_unit(problem, st, knob, governed, "comm", count, default_nc)
    inner = tuple(k for k in ("n_channels", "n_threads", "chunk_size") if problem.scope[k] == "call")
    S = len(problem.sites)
    pair_tunable = (problem.scope["algorithm"] == "call") & problem.tunable["algorithm"]
    pair_tunable &= problem.tunable["protocol"]
    fixed = np.flatnonzero(~pair_tunable)
    best = st.copy()
    best_obj = np.full(S, np.inf)
    if fixed.size:
        trial = st.copy()
        descend(problem, trial, fixed, inner, "comm", count, rounds, AUTOCCL_MIN_GAIN)
        best_obj[fixed] = problem.evaluate(trial, fixed)[0]
        _take(best, trial, fixed)
    tun = np.flatnonzero(pair_tunable)
    if tun.size:
        best_obj[tun] = problem.evaluate(st, tun)[0]  # NCCL's own pair is the one to beat
        count.add(tun.size)
        algs = problem.vals["algorithm"][tun]
        protos = problem.vals["protocol"][tun]
        pairs = {
            (int(a), int(p)) for a in np.unique(algs[~np.isnan(algs)]) for p in np.unique(protos[~np.isnan(protos)])
        }
        for a, p in sorted(pairs):
            if not compat(np.array(a), np.array(p)):
                continue
            ok = tun[(algs == a).any(axis=1) & (protos == p).any(axis=1)]
            if ok.size == 0:
                continue
            trial = st.copy()
            trial.alg[ok], trial.proto[ok], trial.lvl[ok] = a, p, 0
            descend(problem, trial, ok, inner, "comm", count, rounds, AUTOCCL_MIN_GAIN)
            t_comm = problem.evaluate(trial, ok)[0]
            count.add(ok.size)
            better = t_comm < best_obj[ok] * (1.0 - AUTOCCL_MIN_GAIN)
            best_obj[ok[better]] = t_comm[better]
            _take(best, trial, ok[better])
    stats = {"method": "autoccl", "model_evaluations": count.n, "wall_time_s": round(timer(), 6)}
    plan = problem.make_plan(best, method="autoccl", stats=stats)
    return SearchResult(plan=plan, stats=plan.stats)


def _take(dst, src, idx) -> None:
    for name in ("alg", "proto", "nc", "nt", "lvl"):
        getattr(dst, name)[idx] = getattr(src, name)[idx]


def _site_values(problem: SearchProblem, st: State, i: int, knob: str) -> list[float]:
    if problem.scope[knob] == "call" and problem.tunable[knob][i]:
        row = problem.vals[knob][i]
        values = list(row[~np.isnan(row)])
        current = float(st.get(knob)[i])
        return values if current in values else values + [current]
    return [float(st.get(knob)[i])]


def _unit_settings(problem: SearchProblem, base: State, knob: str, governed: np.ndarray) -> list[np.ndarray]:
    """Distinct codes a shared unit gives its sites: NCCL's own first, then each domain value (NCCL channels: a cap)."""
    row = problem.vals[knob][governed[0]]
    out = [base.get(knob)[governed].astype(float)]
    for value in row[~np.isnan(row)]:
        if knob == "n_channels" and problem.backend != "gloo":
            codes = np.minimum(base.nc[governed], value)
        else:
            codes = np.full(governed.size, float(value))
        if not any(np.array_equal(codes, o) for o in out):
            out.append(codes)
    return out


@dataclass
class _Dim:
    """A shared knob of the joint product (``kind``: unit, peer, hp); ``settings[0]``: NCCL's own, so ties keep it."""

    kind: str
    knob: str | None
    governed: np.ndarray
    settings: list


def _dims(problem: SearchProblem, base: State) -> list[_Dim]:
    dims = [
        _Dim("unit", knob, governed, _unit_settings(problem, base, knob, governed))
        for knob, _key, governed in problem.shared_units()
    ]
    p2p = getattr(problem.model, "p2p", None)
    for _key, idx in p2p_knobs.units(problem) if p2p is not None and p2p.any else []:
        values = sorted({float(v) for i in idx for v in problem.domains_S[i][p2p_knobs.KNOB] if v is not None})
        dims.append(_Dim("peer", None, idx, [0.0] + values))  # 0: NCCL's own
    wait = getattr(problem.model, "wait_S", None)
    for _key, idx in stream_priority.units(problem):
        if wait is not None and wait[idx].any():  # without a wait the stream's priority changes nothing
            dims.append(_Dim("hp", None, idx, [0.0, 1.0]))
    return dims


def _apply(problem: SearchProblem, st: State, dim: _Dim, j: int) -> None:
    if dim.kind == "unit":
        st.get(dim.knob)[dim.governed] = dim.settings[j]
    elif dim.kind == "peer":
        problem.model.p2p.net_peer_S[dim.governed] = dim.settings[j]
    else:
        problem.model.hp_S[dim.governed] = dim.settings[j]


def _best_of_set(
    problem: SearchProblem, st: State, idx: np.ndarray, per_site: list[list[list[float]]], count: Counter
) -> tuple[float, np.ndarray]:
    grids = []
    for i in idx:
        vals = [
            per_site[i][j] if problem.scope[k] == "call" and problem.tunable[k][i] else [float(st.get(k)[i])]
            for j, k in enumerate(SEARCH_KNOBS)
        ]
        grids.append(np.array(list(itertools.product(*vals))))  # (P_i, 5) in SEARCH_KNOBS order
    grid = np.unique(np.concatenate(grids), axis=0) if len(grids) > 1 else grids[0]
    every = np.tile(grid, (idx.size, 1))  # member-major: (members x P, 5)
    nc, lvl, nt, proto, alg = (every[:, j] for j in range(5))
    region = problem.evaluate_codes(
        np.repeat(idx, len(grid)), alg.astype(np.int64), proto.astype(np.int64), nc, nt, lvl.astype(np.int64)
    )[2]
    count.add(len(every))
    summed = region.reshape(idx.size, len(grid)).sum(axis=0)
    j = int(np.argmin(summed))
    return float(summed[j]), grid[j]


@register("exhaustive")
def exhaustive(problem: SearchProblem, *, limit: int = EXHAUSTIVE_LIMIT) -> SearchResult:
    """Joint optimum on the cost model, per tie set (ties keep NCCL's, then grid order); ValueError above ``limit``."""
    timer, count = Timer(), Counter()
    base = problem.default_state()
    model = problem.model
    p2p = getattr(model, "p2p", None)
    dims = _dims(problem, base)
    per_site = [[_site_values(problem, base, i, k) for k in SEARCH_KNOBS] for i in range(len(problem.sites))]
    sizes = [int(np.prod([len(v) for v in vals])) for vals in per_site]
    joint = int(np.prod([len(d.settings) for d in dims], dtype=float) * np.prod(np.array(sizes, dtype=float)))
    if joint > limit:
        raise ValueError(
            f"exhaustive search needs {joint:,} joint configurations, above the limit of {limit:,}; "
            f"use method 'priority', fewer sites or narrower domains"
        )
    free = [d for d in dims if len(d.settings) > 1]  # at most log2(limit) of them: numpy's dimensions suffice
    shape = tuple(len(d.settings) for d in free)
    saved_peer, saved_hp = (None if p2p is None else p2p.net_peer_S.copy()), model.hp_S
    total = np.zeros(shape)
    picks = []
    try:
        if any(d.kind == "hp" for d in dims):
            model.hp_S = np.zeros(len(problem.sites))
        for idx in problem.tie_sets():
            rel = [k for k, d in enumerate(free) if np.isin(d.governed, idx).any()]
            table = np.empty(tuple(shape[k] for k in rel))
            chosen = {}
            for combo in itertools.product(*(range(shape[k]) for k in rel)):
                st = base.copy()
                for k, j in zip(rel, combo):
                    _apply(problem, st, free[k], j)
                table[combo], chosen[combo] = _best_of_set(problem, st, idx, per_site, count)
            total += table.reshape(tuple(shape[k] if k in rel else 1 for k in range(len(free))))
            picks.append((idx, rel, chosen))
    finally:
        if p2p is not None:
            p2p.net_peer_S[:] = saved_peer
        model.hp_S = saved_hp
    best = np.unravel_index(int(np.argmin(total)), shape) if shape else ()
    st = base.copy()
    for d in dims:
        if d.kind == "unit" and len(d.settings) == 1:
            _apply(problem, st, d, 0)
    peer, fast = {}, set()
    for d, j in zip(free, best):
        if d.kind == "unit":
            _apply(problem, st, d, j)
        elif d.kind == "peer" and d.settings[j]:
            peer.update({int(i): int(d.settings[j]) for i in d.governed})
        elif d.kind == "hp" and d.settings[j]:
            fast.update(int(i) for i in d.governed)
    for idx, rel, chosen in picks:
        nc, lvl, nt, proto, alg = chosen[tuple(int(best[k]) for k in rel)]
        st.nc[idx], st.lvl[idx], st.nt[idx], st.proto[idx], st.alg[idx] = nc, int(lvl), nt, int(proto), int(alg)
    assert (st.alg >= 0).all() and (st.alg <= ALG_NONE).all()
    stats = {
        "method": "exhaustive",
        "model_evaluations": count.n,
        "joint_configs": joint,
        "wall_time_s": round(timer(), 6),
    }
    plan = problem.make_plan(st, method="exhaustive", stats=stats, peer=peer, fast=fast)
    return SearchResult(plan=plan, stats=plan.stats)
