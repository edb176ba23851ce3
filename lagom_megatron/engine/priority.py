"""The priority search (docs/engine.md), our reading of Lagom's: sites by possible saving (default T_region - T_comp)
scan knobs in priority order, a shared knob decided by its first site; static fixes (``NCCL_MAX_NCHANNELS``, per-group
``max_ctas``) refined by descent compete; a site without predicted gain keeps NCCL's defaults. Linear in sites."""

from __future__ import annotations

import numpy as np

from lagom_megatron.engine import registered
from lagom_megatron.engine.descent import Counter, DescentMemo, decide_unit, descend, scan_knob
from lagom_megatron.engine.problem import SEARCH_KNOBS, SearchProblem, SearchResult, State, Timer, register

STATIC_CAPS: tuple[int, ...] = (2, 4, 8)
"""Channel caps of the static baselines (``NCCL_MAX_NCHANNELS``, Liger-style) tried as candidates."""


def static_states(problem: SearchProblem, default_nc: np.ndarray) -> dict[str, State]:
    """The static fixes as states: ``nccl-default`` and ``cap{N}`` (tunable channels capped, ``capped_channels``)."""
    base = problem.default_state()
    out = {"nccl-default": base}
    tun = np.flatnonzero(problem.tunable["n_channels"])
    for cap in STATIC_CAPS:
        st = base.copy()
        st.nc[tun] = capped_channels(problem, tun, default_nc[tun], float(cap))
        out[f"cap{cap}"] = st
    return out


def capped_channels(problem: SearchProblem, idx: np.ndarray, default_nc: np.ndarray, cap: float) -> np.ndarray:
    """Channel codes (len(idx),) under ``cap``: the domain's largest <= min(default, cap), else least; <= NCCL's."""
    vals = problem.vals["n_channels"][idx]  # (B, K), NaN-padded
    top = np.max(np.where(np.isnan(vals), -np.inf, vals), axis=1)
    least = np.min(np.where(np.isnan(vals), np.inf, vals), axis=1)
    target = np.minimum(np.minimum(default_nc, cap), top)
    floor = np.max(np.where(vals <= target[:, None], vals, -np.inf), axis=1)
    snapped = np.where(np.isfinite(floor), floor, least)
    return np.where((target == default_nc) | (snapped > default_nc), default_nc, snapped)


GROUP_CAPS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


def group_caps_state(problem: SearchProblem, default_nc: np.ndarray, count: Counter, passes: int = 2) -> State:
    """One ``max_ctas`` per process group (Megatron's ``--nccl-communicator-config-path``), by coordinate descent
    over groups on the total region; one group per process where channels are process-scope (``NCCL_MAX_CTAS``)."""
    st = problem.default_state()
    tun = problem.tunable["n_channels"]
    keys = ["process"] * len(problem.sites) if problem.scope["n_channels"] == "process" else problem.comm_S
    groups = {g: np.array([i for i, c in enumerate(keys) if c == g and tun[i]]) for g in dict.fromkeys(keys)}
    groups = {g: ix for g, ix in groups.items() if ix.size}
    best = float(problem.evaluate(st)[2].sum())
    count.add(len(problem.sites))
    for _ in range(passes):
        changed = False
        for idx in groups.values():
            for cap in GROUP_CAPS:
                trial = st.copy()
                trial.nc[idx] = capped_channels(problem, idx, default_nc[idx], float(cap))
                if np.array_equal(trial.nc[idx], st.nc[idx]):
                    continue
                t = float(problem.evaluate(trial)[2].sum())
                count.add(len(problem.sites))
                if t < best * (1.0 - 1e-9):
                    best, st, changed = t, trial, True
        if not changed:
            break
    return st


def best_candidate(
    problem: SearchProblem,
    searched: State,
    default_nc: np.ndarray,
    call_knobs: tuple[str, ...],
    count: Counter,
    rounds: int,
) -> tuple[State, str]:
    """Least-total-region state among the searched one, the static fixes and each refined by descent; (state, name)."""
    cands: list[tuple[str, State]] = [("searched", searched)]
    everyone = np.arange(len(problem.sites))
    statics = static_states(problem, default_nc)
    statics["group-caps"] = group_caps_state(problem, default_nc, count)
    memo = DescentMemo()
    for name, st in statics.items():
        cands.append((name, st))
        if call_knobs:
            refined = st.copy()
            memo.descend(problem, refined, everyone, call_knobs, "region", count, rounds)
            cands.append((f"{name}+descent", refined))
    totals = []
    for _, st in cands:
        totals.append(float(problem.evaluate(st)[2].sum()))
        count.add(len(problem.sites))
    k = int(np.argmin(np.array(totals) * (1.0 + 1e-9 * np.arange(len(totals)))))
    return cands[k][1], cands[k][0]


GAIN_TOL = 1e-6


def keep_defaults_without_gain(problem: SearchProblem, st: State, call_knobs: tuple[str, ...]) -> tuple[State, int]:
    """``st`` with sites whose per-call knobs gain nothing back on defaults (tie sets together); (state, n reset)."""
    st, _ = problem.tie_indistinguishable(st)
    default = problem.default_state()
    back = st.copy()
    for knob in call_knobs:
        back.get(knob)[:] = default.get(knob)
    region = problem.evaluate(st)[2]
    region_back = problem.evaluate(back)[2]
    key_fn = getattr(problem.rules, "call_key", None)
    sets: dict[object, list[int]] = {}
    for i, s in enumerate(problem.sites):
        k = key_fn(group=s.group, op=s.op, nbytes=s.nbytes) if key_fn is not None else None
        sets.setdefault(k if k is not None else ("site", i), []).append(i)
    out, reset = st.copy(), 0
    for members in sets.values():
        idx = np.array(members)
        moved = any(bool(np.any(st.get(k)[idx] != back.get(k)[idx])) for k in call_knobs)
        if moved and float(region_back[idx].sum() - region[idx].sum()) <= GAIN_TOL * float(region_back[idx].sum()):
            for knob in call_knobs:
                out.get(knob)[idx] = back.get(knob)[idx]
            reset += idx.size
    return out, reset


@register("priority")
def priority(problem: SearchProblem, *, rounds: int = 3) -> SearchResult:
    """Lagom's priority search (module docstring)."""
    timer, count = Timer(), Counter()
    st = problem.default_state()
    default_nc = st.nc.copy()
    _, _, region = problem.evaluate(st)
    count.add(region.size)
    gain_S = region - problem.model.t_comp_us_S
    order = np.argsort(-gain_S, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    leaders: dict[int, list[tuple[str, np.ndarray]]] = {}
    for knob, _key, governed in problem.shared_units():
        leader = int(governed[np.argmin(rank[governed])])
        leaders.setdefault(leader, []).append((knob, governed))
    call_knobs = tuple(k for k in SEARCH_KNOBS if problem.scope[k] == "call")
    for leader in sorted(leaders, key=lambda i: rank[i]):
        pending = list(leaders[leader])
        one = np.array([leader])
        for _ in range(rounds):
            changed = False
            for knob in SEARCH_KNOBS:
                if problem.scope[knob] == "call":
                    changed |= scan_knob(problem, st, one, knob, "region", count).size > 0
                for unit in [u for u in pending if u[0] == knob]:
                    decide_unit(problem, st, knob, unit[1], "region", count, default_nc, lookahead=True)
                    pending.remove(unit)
            if not changed and not pending:
                break
    rest = order[~np.isin(order, list(leaders))]
    descend(problem, st, rest, call_knobs, "region", count, rounds)
    st, chosen = best_candidate(problem, st, default_nc, call_knobs, count, rounds)
    st, reset = keep_defaults_without_gain(problem, st, call_knobs)
    count.add(2 * len(problem.sites))
    stats = {
        "method": "priority",
        "model_evaluations": count.n,
        "wall_time_s": round(timer(), 6),
        "candidate": chosen,
        "zero_gain_sites_reset": reset,
    }
    plan = registered.choose(problem, problem.make_plan(st, method="priority", stats=stats))
    return SearchResult(plan=plan, stats=plan.stats)
