"""The priority search (docs/engine.md), registered as ``priority``.

Priority search, our reading of Lagom's "priority-based search, exponential to linear" (the
paper's algorithm is not public):

1. Priority of a site = the time it could save: T_region(NCCL default) - T_comp (the region can
   never be shorter than its compute alone). Largest first.
2. Each site, in priority order, scans its knobs one at a time in knob-priority order
   (n_channels, chunk_size, n_threads, protocol, algorithm), each domain once with the others
   fixed, on the cost model; up to ``rounds`` passes while something changes. A knob whose
   scope is wider than one call (a process-wide thread count, a communicator's channel cap or
   gloo thread count) is decided once, when its highest-priority site reaches it, for the sum
   of the region times of all the sites it governs (each site answering every candidate value
   with one pass over its own knobs), and stays fixed after that.
3. The static fixes a user could apply instead (NCCL's defaults, ``NCCL_MAX_NCHANNELS`` 2 / 4 / 8,
   and one ``max_ctas`` per process group as Megatron's ``--nccl-communicator-config-path`` sets
   it, the caps chosen by coordinate descent over the groups on the model, ``group_caps_state``;
   ``NCCL_CTA_POLICY=EFFICIENCY`` is NCCL's default on unregistered buffers) are candidates too,
   each also refined by one coordinate descent: the plan kept is the candidate with the least
   predicted total region time, so on the model it is never worse than any of them.
4. A site (or a set of sites the mechanism cannot tell apart) whose chosen per-call knobs do not
   predict a shorter region than NCCL's defaults keeps NCCL's defaults for them
   (``keep_defaults_without_gain``): the tie rule of the scans prefers fewer resources at equal
   predicted time, which must not move a site off NCCL's choice for no predicted gain.
5. Cost: O(sum over sites of sum over knobs of domain size) model evaluations: linear in sites.

Implementation note: the sites that decide a shared knob ("leaders") run one by one in priority
order. Every other site finds all its shared knobs decided when it is reached, and its scan
depends only on its own state, so all of them are scanned together as numpy arrays. This gives
exactly the sequential algorithm's result, in a fraction of the time.
"""

from __future__ import annotations

import numpy as np

from lagom_megatron.engine.descent import Counter, decide_unit, descend, scan_knob
from lagom_megatron.engine.problem import SEARCH_KNOBS, SearchProblem, SearchResult, State, Timer, register

STATIC_CAPS: tuple[int, ...] = (2, 4, 8)
"""Channel caps of the static baselines (``NCCL_MAX_NCHANNELS``, Liger-style) tried as candidates."""


def static_states(problem: SearchProblem, default_nc: np.ndarray) -> dict[str, State]:
    """The static fixes as search states: ``nccl-default`` and ``cap{N}`` (every site where the
    channel count is tunable capped at ``min(NCCL's choice, N)``, as NCCL_MAX_NCHANNELS does),
    within the site's domain (``capped_channels``)."""
    base = problem.default_state()
    out = {"nccl-default": base}
    tun = np.flatnonzero(problem.tunable["n_channels"])
    for cap in STATIC_CAPS:
        st = base.copy()
        st.nc[tun] = capped_channels(problem, tun, default_nc[tun], float(cap))
        out[f"cap{cap}"] = st
    return out


def capped_channels(problem: SearchProblem, idx: np.ndarray, default_nc: np.ndarray, cap: float) -> np.ndarray:
    """The channel codes of sites ``idx`` (channels tunable) under a channel cap: NCCL's choice
    ``default_nc`` (shape (len(idx),)) where it is at or below ``cap`` and the domain's largest
    count, else the largest count of the site's domain at or below ``min(default_nc, cap)`` (the
    domain's least where none is, unless that is above NCCL's choice): a cap never takes a site
    outside its domain (a budget's cap, ``nccl.budget``, or a narrowed domain) nor above NCCL's
    choice. Returns shape (len(idx),)."""
    vals = problem.vals["n_channels"][idx]                                   # (B, K), NaN-padded
    top = np.max(np.where(np.isnan(vals), -np.inf, vals), axis=1)
    least = np.min(np.where(np.isnan(vals), np.inf, vals), axis=1)
    target = np.minimum(np.minimum(default_nc, cap), top)
    floor = np.max(np.where(vals <= target[:, None], vals, -np.inf), axis=1)
    snapped = np.where(np.isfinite(floor), floor, least)
    return np.where((target == default_nc) | (snapped > default_nc), default_nc, snapped)


GROUP_CAPS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
"""Per-group ``max_ctas`` values ``group_caps_state`` tries (the ones at or above NCCL's count change nothing)."""


def group_caps_state(problem: SearchProblem, default_nc: np.ndarray, count: Counter, passes: int = 2) -> State:
    """One channel cap per process group, as a user sets ``max_ctas`` per group in Megatron's
    ``--nccl-communicator-config-path`` YAML: every site of the group where channels are tunable at
    ``min(NCCL's choice, cap)`` within its domain (``capped_channels``; a point-to-point site's
    channel code is its communicator's count, so the cap bounds it the same way, ``engine.p2p``),
    the caps found by coordinate descent over the groups (each group's cap over ``GROUP_CAPS`` with
    the others fixed, ``passes`` passes) on the predicted total region time: linear in groups x caps
    evaluations of all sites. Where the mechanism sets the channel count once per process (the
    ``env`` mechanism's ``NCCL_MAX_CTAS``) the whole process is one group: a plan cannot hold one
    cap per group there."""
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


def best_candidate(problem: SearchProblem, searched: State, default_nc: np.ndarray, call_knobs: tuple[str, ...],
                   count: Counter, rounds: int) -> tuple[State, str]:
    """The state with the least predicted total region time among the searched one, the static
    fixes and each static fix refined by coordinate descent of the per-call knobs (ties keep the
    earlier: searched, then statics in order). Returns (state, its name)."""
    cands: list[tuple[str, State]] = [("searched", searched)]
    everyone = np.arange(len(problem.sites))
    statics = static_states(problem, default_nc)
    statics["group-caps"] = group_caps_state(problem, default_nc, count)
    for name, st in statics.items():
        cands.append((name, st))
        if call_knobs:
            refined = st.copy()
            descend(problem, refined, everyone, call_knobs, "region", count, rounds)
            cands.append((f"{name}+descent", refined))
    totals = []
    for _, st in cands:
        totals.append(float(problem.evaluate(st)[2].sum()))
        count.add(len(problem.sites))
    k = int(np.argmin(np.array(totals) * (1.0 + 1e-9 * np.arange(len(totals)))))
    return cands[k][1], cands[k][0]


GAIN_TOL = 1e-6
"""A site's predicted saving must exceed this fraction of its default region time to count as a gain."""


def keep_defaults_without_gain(problem: SearchProblem, st: State, call_knobs: tuple[str, ...]) -> tuple[State, int]:
    """``st`` with every site whose per-call knobs predict no gain back on NCCL's defaults for them.

    Sites the mechanism cannot tell apart (``problem.tie_indistinguishable``) are judged by their
    summed regions and reset together; knobs of communicator or process scope stay as decided
    (they govern other sites too). Returns (state, sites reset)."""
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
    """Lagom's priority search (module docstring); linear in the number of sites."""
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
                    changed |= scan_knob(problem, st, one, knob, "region", count)
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
    stats = {"method": "priority", "model_evaluations": count.n, "wall_time_s": round(timer(), 6), "candidate": chosen,
             "zero_gain_sites_reset": reset}
    plan = problem.make_plan(st, method="priority", stats=stats)
    return SearchResult(plan=plan, stats=plan.stats)
