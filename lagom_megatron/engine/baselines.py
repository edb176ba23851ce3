"""Baseline searchers beside the priority search (docs/engine.md).

- ``nccl-default``: no change; every site keeps NCCL's own choice.
- ``autoccl``: each collective tuned for its own T_comm, compute ignored, as AutoCCL (NSDI'25)
  does: within each (algorithm, protocol) pair, coordinate descent over channels, threads and
  chunk size; the fastest pair wins. Knobs wider than a call (a process-wide thread count, a
  communicator's channel cap) are decided once per unit for the sum of T_comm, because stock
  NCCL cannot set them per call (AutoCCL's own NCCL fork can). AutoCCL measures, so a move must
  gain more than ``AUTOCCL_MIN_GAIN`` of T_comm (its timing noise) to be taken.
- ``exhaustive``: the joint product of every site's space and every shared knob's domain, on the
  cost model; refuses above ``EXHAUSTIVE_LIMIT`` joint configurations. It exists to show that
  the priority search lands within 1% of the optimum on small instances.
"""

from __future__ import annotations

import itertools

import numpy as np

from lagom_megatron.engine.cost_model import ALG_NONE
from lagom_megatron.engine.descent import Counter, decide_unit, descend
from lagom_megatron.engine.problem import SEARCH_KNOBS, SearchProblem, SearchResult, Timer, compat, register

AUTOCCL_MIN_GAIN = 0.01
"""Smallest relative T_comm gain the autoccl baseline acts on (below it, measurements cannot tell)."""
EXHAUSTIVE_LIMIT = 2_000_000
"""Largest joint configuration count ``exhaustive`` accepts (about a second of numpy work)."""


@register("nccl-default")
def nccl_default(problem: SearchProblem) -> SearchResult:
    """NCCL's defaults everywhere: the plan's entries are empty configs."""
    timer = Timer()
    stats = {"method": "nccl-default", "model_evaluations": 0, "wall_time_s": round(timer(), 6)}
    plan = problem.make_plan(None, method="nccl-default", stats=stats)
    return SearchResult(plan=plan, stats=plan.stats)


@register("autoccl")
def autoccl(problem: SearchProblem, *, rounds: int = 3) -> SearchResult:
    """AutoCCL-style tuning of each collective for its own speed (module docstring)."""
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
        pairs = {(int(a), int(p)) for a in np.unique(algs[~np.isnan(algs)]) for p in np.unique(protos[~np.isnan(protos)])}
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


def _site_values(problem: SearchProblem, st, i: int, knob: str) -> list[float]:
    if problem.scope[knob] == "call" and problem.tunable[knob][i]:
        row = problem.vals[knob][i]
        values = list(row[~np.isnan(row)])
        current = float(st.get(knob)[i])  # NCCL's own choice, which the priority search may keep
        return values if current in values else values + [current]
    return [float(st.get(knob)[i])]


@register("exhaustive")
def exhaustive(problem: SearchProblem, *, limit: int = EXHAUSTIVE_LIMIT) -> SearchResult:
    """Optimum of the joint product on the cost model (module docstring).

    Raises:
        ValueError: more than ``limit`` joint configurations (names both numbers).
    """
    timer, count = Timer(), Counter()
    base = problem.default_state()
    default_nc = base.nc.copy()
    units = problem.shared_units()
    unit_values = []
    for knob, _key, governed in units:
        row = problem.vals[knob][governed[0]]
        unit_values.append(list(row[~np.isnan(row)]))
    per_site = [[_site_values(problem, base, i, k) for k in SEARCH_KNOBS] for i in range(len(problem.sites))]
    sizes = [int(np.prod([len(v) for v in vals])) for vals in per_site]
    n_shared = int(np.prod([len(v) for v in unit_values])) if unit_values else 1
    joint = n_shared * int(np.prod(np.array(sizes, dtype=float)))
    if joint > limit:
        raise ValueError(f"exhaustive search needs {joint:,} joint configurations, above the limit of {limit:,}; "
                         f"use method 'priority', fewer sites or narrower domains")
    best_total, best_state = np.inf, None
    for assignment in itertools.product(*unit_values):
        st = base.copy()
        for (knob, _key, governed), value in zip(units, assignment):
            if knob == "n_channels" and problem.backend != "gloo":
                st.nc[governed] = np.minimum(default_nc[governed], value)
            else:
                st.get(knob)[governed] = value
        combos, owners = [], []
        for i, vals in enumerate(per_site):
            if problem.scope["n_channels"] != "call" or not problem.tunable["n_channels"][i]:
                vals = list(vals)
                vals[SEARCH_KNOBS.index("n_channels")] = [float(st.nc[i])]
            for k in ("n_threads", "protocol", "algorithm", "chunk_size"):
                if problem.scope[k] != "call" or not problem.tunable[k][i]:
                    vals = list(vals)
                    vals[SEARCH_KNOBS.index(k)] = [float(st.get(k)[i])]
            grid = np.array(list(itertools.product(*vals)))  # (P_i, 5) in SEARCH_KNOBS order
            combos.append(grid)
            owners.append(np.full(len(grid), i))
        # every site's grid in one evaluation (regions are per site: the model is elementwise)
        every = np.concatenate(combos)
        nc, lvl, nt, proto, alg = (every[:, j] for j in range(5))
        region = problem.evaluate_codes(np.concatenate(owners), alg.astype(np.int64), proto.astype(np.int64),
                                        nc, nt, lvl.astype(np.int64))[2]
        count.add(len(every))
        bounds = np.cumsum([0] + [len(g) for g in combos])
        tables = [region[bounds[i]:bounds[i + 1]] for i in range(len(combos))]
        # Under one shared assignment each site's region time depends on its own config alone, so
        # the joint optimum is each site's own optimum (no product of tables: a numpy array holds
        # at most 64 dimensions, a profile often more sites).
        picks = [int(np.argmin(t)) for t in tables]
        total = float(sum(t[j] for t, j in zip(tables, picks)))
        if total < best_total:
            best_total = total
            best_state = st.copy()
            for i, (grid, j) in enumerate(zip(combos, picks)):
                nc, lvl, nt, proto, alg = grid[j]
                best_state.nc[i], best_state.lvl[i], best_state.nt[i] = nc, int(lvl), nt
                best_state.proto[i], best_state.alg[i] = int(proto), int(alg)
    assert best_state is not None and (best_state.alg >= 0).all() and (best_state.alg <= ALG_NONE).all()
    stats = {"method": "exhaustive", "model_evaluations": count.n, "joint_configs": joint, "wall_time_s": round(timer(), 6)}
    plan = problem.make_plan(best_state, method="exhaustive", stats=stats)
    return SearchResult(plan=plan, stats=plan.stats)
