"""The priority search (DESIGN.md section 4) and ``search()``, the entry point of every method.

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
3. Cost: O(sum over sites of sum over knobs of domain size) model evaluations: linear in sites.

Implementation note: the sites that decide a shared knob ("leaders") run one by one in priority
order. Every other site finds all its shared knobs decided when it is reached, and its scan
depends only on its own state, so all of them are scanned together as numpy arrays. This gives
exactly the sequential algorithm's result, in a fraction of the time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.problem import (
    SEARCH_KNOBS, SEARCHERS, SIMPLE, SearchProblem, SearchResult, State, Timer, compat, register,
)
from lagom_megatron.engine.profile import Profile

METHODS: tuple[str, ...] = ("priority", "autoccl", "exhaustive", "nccl-default")
"""Search methods accepted by ``search`` and ``lagom search --method``."""


class Counter:
    """Counts model evaluations (one per evaluated (site, config) pair)."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> None:
        self.n += int(k)


def _objective(problem: SearchProblem, idx, alg, proto, nc, nt, lvl, objective: str) -> np.ndarray:
    t_comm, _, t_region = problem.evaluate_codes(idx, alg, proto, nc, nt, lvl)
    return t_comm if objective == "comm" else t_region


def scan_knob(problem: SearchProblem, st: State, idx: np.ndarray, knob: str, objective: str, count: Counter,
              min_gain: float = 0.0) -> bool:
    """Scans ``knob`` over its domain for the sites ``idx`` at once (others fixed); keeps the
    best value per site when it beats the current one by more than the fraction ``min_gain``.
    Mutates ``st``; returns True on a change.
    """
    idx = idx[problem.tunable[knob][idx]]
    if idx.size == 0:
        return False
    vals = problem.vals[knob][idx]                              # (B, K)
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
    cur = _objective(problem, idx, *(c[:, 0] for c in (codes["algorithm"], codes["protocol"], codes["n_channels"],
                                                         codes["n_threads"], codes["chunk_size"])), objective)
    count.add(valid.sum() + idx.size)
    best = np.argmin(obj, axis=1)
    best_obj = obj[np.arange(idx.size), best]
    better = best_obj < cur * (1.0 - max(min_gain, 1e-9)) - 1e-12
    if not better.any():
        return False
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
    return True


def decide_unit(problem: SearchProblem, st: State, knob: str, governed: np.ndarray, objective: str, count: Counter,
                default_nc: np.ndarray, *, lookahead: bool = False) -> None:
    """Decides a knob of communicator or process scope once for all ``governed`` sites: the value
    minimising the sum of their objective, under their current configs or, with ``lookahead``,
    after one pass of each site over its per-call knobs (linear: values x sites x domains).
    On NCCL a communicator's channel count is a cap (ncclConfig_t.maxCTAs): each site keeps
    min(NCCL's choice, cap). Only the shared knob is kept; the sites' own knobs are searched
    when they are reached."""
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
        # Each governed site answers every candidate value with one pass over its per-call knobs,
        # so the value is judged by what the sites will make of it, not by their start configs.
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
        obj = _objective(problem, governed[None, :], codes["algorithm"], codes["protocol"], codes["n_channels"],
                         codes["n_threads"], codes["chunk_size"], objective)
        count.add(obj.size)
        totals = obj.sum(axis=1)
    k = int(np.argmin(totals))
    for name in SEARCH_KNOBS:
        if name == knob or (knob == "algorithm" and name == "protocol"):
            st.get(name)[governed] = codes[name][k]


def descend(problem: SearchProblem, st: State, idx: np.ndarray, knobs: tuple[str, ...], objective: str,
            count: Counter, rounds: int, min_gain: float = 0.0) -> None:
    """Coordinate descent of ``knobs`` (call scope) for the sites ``idx``, at most ``rounds``
    passes, stopping early when a pass changes nothing."""
    for _ in range(rounds):
        changed = False
        for knob in knobs:
            changed |= scan_knob(problem, st, idx, knob, objective, count, min_gain)
        if not changed:
            return


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
    stats = {"method": "priority", "model_evaluations": count.n, "wall_time_s": round(timer(), 6)}
    plan = problem.make_plan(st, method="priority", stats=stats)
    return SearchResult(plan=plan, stats=plan.stats)


def search(profile: "Profile | SearchProblem", cluster: "ClusterSpec | str | None" = None, *, method: str = "priority",
           model: CostModel | None = None, mechanism: str | None = None, **options: Any) -> SearchResult:
    """Searches a plan with ``method`` for a profile (or a prepared ``SearchProblem``).

    Args:
        profile: a Profile (the cost model is fitted unless ``model`` is given) or a SearchProblem.
        cluster: ClusterSpec or its name; defaults to the profile's cluster.
        method: priority, autoccl, exhaustive or nccl-default.
        model: an already fitted CostModel for the profile's sites.
        mechanism: how the plan will be applied (knobs.MECHANISMS); backend's default if None.
        options: passed to the searcher (``rounds``, ``limit`` for exhaustive).

    Returns:
        SearchResult(plan, stats); stats has model_evaluations, wall_time_s,
        predicted_iteration_us, default_iteration_us, n_sites.

    Raises:
        ValueError: unknown method (names it and the allowed set), or a searcher's refusal
            (exhaustive above its size limit).
    """
    import lagom_megatron.engine.baselines  # noqa: F401  (registers the baselines)

    if method not in SEARCHERS:
        raise ValueError(f"method must be one of {sorted(SEARCHERS)}; got {method!r}")
    if isinstance(profile, SearchProblem):
        problem = profile
    else:
        spec = ClusterSpec.load(cluster if cluster is not None else profile.cluster)
        problem = SearchProblem.from_profile(profile, spec, model=model, mechanism=mechanism)
    return SEARCHERS[method](problem, **options)
