"""One row of ``lagom bench simulated``: every method per seed; ``NEMO_CAPS``: NVIDIA-NeMo PR #13407."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

from lagom_megatron.sim.channel_defaults import low_sm_path

CAPS = (1, 2, 4, 8, 16, 32)
NEMO_CAPS = {"dp": 8, "dp_cp": 8, "pp": 2, "tp": 8}
UB_GROUPS = frozenset({"dp", "dp_cp"})
BASE = 100_000
AUTOCCL_FIRST, LAGOM_FIRST, LAGOM_HP_FIRST = 10_000, 20_000, 60_000
"""Disjoint first iterations, so independent noise draws."""


def with_microbatches(preset: Any, n: int) -> Any:
    """The preset with its global batch cut to ``n`` micro-batches per DP rank; ValueError for ``n < 1``."""
    if n < 1:
        raise ValueError(f"micro-batches per rank must be >= 1; got {n}")
    p = preset.parallel
    dp = preset.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    gbs = preset.training.micro_batch_size * dp * n
    return preset.model_copy(update={"training": preset.training.model_copy(update={"global_batch_size": gbs})})


def groups_of(sim: Any) -> list[str]:
    """Process groups with collectives in ``sim``, by first call."""
    return list(dict.fromkeys(c.stream for c in sim._prog.calls))


def ub_applies(sim: Any, groups: frozenset[str] = UB_GROUPS) -> bool:
    """Whether registering ``groups``' buffers (``--use-nccl-ub``) changes a collective (``low_sm_path``)."""
    return any(
        low_sm_path(sim.gpu, replace(c.coll, registered=True)) is not None
        for c in sim._prog.calls
        if c.stream in groups
    )


def cta_zero_assignment(sim: Any) -> tuple[frozenset[str], dict[str, Any]]:
    """(groups to register, site -> CTA policy ZERO) for every all-gather copy engines can run when its group's buffers
    are registered (``low_sm_path``); empty where none can."""
    from lagom_megatron.engine.knobs import CommConfig

    ce = {
        c.site_id: c.stream
        for c in sim._prog.calls
        if c.site_id is not None
        and (p := low_sm_path(sim.gpu, replace(c.coll, registered=True), copy_engine=True)) is not None
        and p.ctas == 0
    }
    return frozenset(ce.values()), {sid: CommConfig(cta_policy="ZERO") for sid in ce}


FLOORS = (4, 8, 16, 32, 64)
"""``minCTAs`` values the raising sweep tries (``NCCL_MIN_CTAS``; at most NCCL's MAXCHANNELS, 64 from 2.25)."""


def sweep_caps(
    sim: Any, *, passes: int = 2, floors: bool = False, start: dict[str, int] | None = None
) -> tuple[dict[str, int], dict[str, int]]:
    """Per group the best ``maxCTAs`` (and with ``floors`` the best ``minCTAs`` instead) by coordinate descent on the
    noise-free iteration, from ``start`` caps; (caps, floors)."""
    caps: dict[str, int] = dict(start or {})
    low: dict[str, int] = {}
    best = sim.run_iteration(iteration=0, noise=False, group_caps=caps).iteration_us
    settings = [("max", c) for c in CAPS] + ([("min", f) for f in FLOORS] if floors else [])
    for _ in range(passes):
        changed = False
        for g in groups_of(sim):
            for kind, n in settings:
                cur = ("max", caps[g]) if g in caps else (("min", low[g]) if g in low else None)
                if cur == (kind, n):
                    continue
                tc = {k: v for k, v in caps.items() if k != g} | ({g: n} if kind == "max" else {})
                tf = {k: v for k, v in low.items() if k != g} | ({g: n} if kind == "min" else {})
                t = sim.run_iteration(iteration=0, noise=False, group_caps=tc, group_floors=tf).iteration_us
                if t < best * (1.0 - 1e-6):
                    best, caps, low, changed = t, tc, tf, True
        if not changed:
            break
    return caps, low


def median_us(sim: Any, *, iters: int, **kw: Any) -> float:
    """Median iteration us over ``iters`` noisy iterations from ``BASE``."""
    return statistics.median(sim.run_iteration(iteration=BASE + i, **kw).iteration_us for i in range(iters))


def shared(sim: Any) -> dict[str, Any]:
    """The seed-independent, noise-free part of a row."""
    from lagom_megatron.sim.bench.references import oracle

    quiet = sim.run_iteration(iteration=0, noise=False)
    tl = sim.last_timeline
    everyone = frozenset(groups_of(sim))
    # no SM, no HBM, no dispatch wait: what contention tuning could at most win; no time at all: what any comm could
    free = sim.run_iteration(iteration=0, noise=False, free_comm=True, high_priority=everyone)
    zero = sim.run_iteration(iteration=0, noise=False, zero_comm=True, high_priority=everyone)
    caps, _ = sweep_caps(sim)
    raise_caps, raise_floors = sweep_caps(sim, floors=True, start=caps)
    return {
        "overlap_frac": tl.compute_overlapped_us / max(tl.compute_us, 1e-9),
        "contention_bound": quiet.iteration_us / free.iteration_us,
        "exposed_comm_bound": quiet.iteration_us / zero.iteration_us,
        "caps": caps,
        "raise": (raise_caps, raise_floors),
        "oracle_plan": oracle(sim, group_caps=caps)[0],
        "ub": ub_applies(sim),
        "ub_all": ub_applies(sim, everyone),
    }


def one_seed(
    sim: Any, base: dict[str, Any], *, seed: int, iters: int, verify_iters: int, verify_max_iters: int | None = None
) -> dict[str, Any]:
    from lagom_megatron.sim.backend import run_lifecycle
    from lagom_megatron.sim.bench.references import autoccl

    sim.seed = seed
    groups = frozenset(groups_of(sim))
    row: dict[str, Any] = {
        "seed": seed,
        "overlap_frac": base["overlap_frac"],
        "contention_bound": base["contention_bound"],
        "exposed_comm_bound": base["exposed_comm_bound"],
    }
    default = median_us(sim, iters=iters)
    row["default_ms"] = default / 1e3
    row["static_caps_ms"] = median_us(sim, iters=iters, group_caps=base["caps"]) / 1e3
    row["nemo_yaml_ms"] = (
        median_us(sim, iters=iters, group_caps={g: c for g, c in NEMO_CAPS.items() if g in groups}) / 1e3
    )
    row["hp_stream_ms"] = median_us(sim, iters=iters, high_priority=groups) / 1e3
    caps, floors = base["raise"]
    row["caps_raise_ms"] = median_us(sim, iters=iters, group_caps=caps, group_floors=floors) / 1e3
    row["nccl_ub_ms"] = median_us(sim, iters=iters, registered=UB_GROUPS) / 1e3 if base["ub"] else None
    row["nccl_ub_all_ms"] = median_us(sim, iters=iters, registered=groups) / 1e3 if base["ub_all"] else None
    zero_groups, zero = cta_zero_assignment(sim)
    row["cta_zero_ms"] = median_us(sim, iters=iters, registered=zero_groups, assignment=zero) / 1e3 if zero else None
    auto, auto_iters = autoccl(sim, first_iteration=AUTOCCL_FIRST, seed=seed)
    row["autoccl_no_transport_ms"] = median_us(sim, iters=iters, assignment=auto, fork=True) / 1e3
    oracle_us = median_us(sim, iters=iters, assignment=base["oracle_plan"])
    row["oracle"] = default / oracle_us
    verify = {"verify_iters": verify_iters, "verify_max_iters": verify_max_iters}
    r = run_lifecycle(sim, method="priority", **verify, after_iters=0, first_iteration=LAGOM_FIRST)
    plan = r.tuner.plan
    launch = plan.for_launch(()) if plan is not None else None
    assignment = {k: e.config for k, e in launch.entries.items()} if launch is not None else {}
    plan_us, held_out = held_out_error(sim, r.tuner, assignment, iters=iters, plan=launch)
    kept_us, plan_us = lagom_kept_us(sim, r, default_us=default, plan_us=plan_us, iters=iters, verify=verify)
    registered = plan.registered_groups if plan is not None else ()
    stats = r.tuner.search_stats or {}
    predicted = stats.get("predicted_default_iteration_us", 0.0) / (stats.get("predicted_iteration_us") or 1.0)
    # every group in --high-priority-stream-groups (pool entries inherit it, nccl/pool.py): a details column
    sim.high_priority = groups
    try:
        hp = run_lifecycle(sim, method="priority", **verify, after_iters=0, first_iteration=LAGOM_HP_FIRST)
        hp_plan = {k: e.config for k, e in hp.tuner.plan.entries.items()} if hp.tuner.plan is not None else {}
        hp_kept = median_us(sim, iters=iters, assignment=hp_plan if hp.tuner.phase.value == "applied" else {})
    finally:
        sim.high_priority = frozenset()
    row["lagom_hp_kept_ms"] = hp_kept / 1e3
    row.update(
        lagom_plan_ms=plan_us / 1e3,
        lagom_kept_ms=kept_us / 1e3,
        lagom_registered=" ".join(registered),
        model_mape=r.tuner.model_mape,
        model_oos_mape=held_out,
        predicted_gain=predicted if plan is not None else None,
        simulated_gain=default / plan_us if plan is not None else None,
        oracle_ms=oracle_us / 1e3,
        lagom_phase=r.tuner.phase.value,
        lagom_candidate=(plan.stats.get("candidate") if plan is not None else None),
        verify_text=str(r.tuner.reason or "")[:160],
        caps=" ".join(f"{g}:{c}" for g, c in sorted(base["caps"].items())),
        caps_raise=" ".join(
            [f"{g}:<={c}" for g, c in sorted(caps.items())] + [f"{g}:>={c}" for g, c in sorted(floors.items())]
        ),
        lagom_hp_groups=" ".join(sorted({e.group for e in plan.entries.values() if e.config.high_priority_stream}))
        if plan is not None
        else "",
        autoccl_iterations=auto_iters,
    )
    return row


def lagom_kept_us(
    sim: Any, r: Any, *, default_us: float, plan_us: float | None = None, iters: int, verify: dict[str, Any]
) -> tuple[float, float]:
    """(median iteration us lagom keeps after lifecycle ``r``, its plan's median in the launch that runs all of it).
    Kept: the plan if verification kept it, else the defaults (``plan_us``: the plan's median in this launch, measured
    here when None). A plan that registers groups is reused by the next launch with those buffers registered and
    verified whole there: that launch runs all of it, and what it keeps is kept."""
    from lagom_megatron.sim.backend import run_lifecycle

    plan = r.tuner.plan
    if plan is None:
        return default_us, default_us
    if plan_us is None:
        launch = plan.for_launch(())
        plan_us = median_us(sim, iters=iters, assignment={k: e.config for k, e in launch.entries.items()})
    kept = plan_us if r.tuner.phase.value == "applied" else default_us
    if not plan.registered_groups:
        return kept, plan_us
    with sim.registering(plan.registered_groups):
        whole = {k: e.config for k, e in plan.entries.items()}
        r2 = run_lifecycle(sim, method="priority", **verify, after_iters=0, first_iteration=LAGOM_FIRST, plan=plan)
        whole_us = median_us(sim, iters=iters, assignment=whole)
        kept = whole_us if r2.tuner.phase.value == "applied" else median_us(sim, iters=iters)
    return kept, whole_us


def held_out_error(
    sim: Any, tuner: Any, assignment: dict[str, Any], *, iters: int, plan: Any = None
) -> tuple[float, float | None]:
    """(median iteration us under ``assignment``, the model's mean |error| % on the T_region of the sites it moved off
    defaults): configurations never probed, iterations never fitted (from ``BASE``), before the per-site offsets."""
    from lagom_megatron.engine.fit import fit_cost_model

    runs = [sim.run_iteration(iteration=BASE + i, assignment=assignment) for i in range(iters)]
    total = statistics.median(m.iteration_us for m in runs)
    moved = [k for k, e in plan.entries.items() if not e.config.is_default()] if plan is not None else []
    if not moved or tuner.profile is None:
        return total, None
    model = fit_cost_model(tuner.profile, tuner.cluster)
    offset = model.offset_S if model.offset_S is not None else [0.0] * len(model.sites)
    errs = []
    for sid in moved:
        got = statistics.mean(next(s.t_region_us for s in m.samples if s.site_id == sid) for m in runs)
        pred = plan.entries[sid].predicted_t_region_us - float(offset[model.index[sid]])
        errs.append(abs(pred - got) / max(got, 1e-9))
    return total, 100.0 * statistics.mean(errs)


def run_row(
    preset_name: str,
    cluster: str,
    *,
    seeds: list[int],
    iters: int,
    microbatches: int | None,
    verify_iters: int,
    verify_max_iters: int | None = None,
) -> list[dict[str, Any]]:
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.sim.backend import SimulatedCluster

    t0 = time.perf_counter()
    preset = load_preset(preset_name)
    if microbatches is not None:
        preset = with_microbatches(preset, microbatches)
    sim = SimulatedCluster(preset, cluster, seed=seeds[0])
    base = shared(sim)
    rows = []
    for seed in seeds:
        row = {"preset": preset_name, "cluster": sim.cluster.name, "microbatches": sim.workload.microbatches}
        row.update(
            one_seed(sim, base, seed=seed, iters=iters, verify_iters=verify_iters, verify_max_iters=verify_max_iters)
        )
        rows.append(row)
    for row in rows:
        row["wall_s"] = (time.perf_counter() - t0) / len(rows)
    return rows
