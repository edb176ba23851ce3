"""One row of ``lagom bench simulated``: every method per seed; ``NEMO_CAPS``: NVIDIA-NeMo PR #13407."""

from __future__ import annotations

import statistics
import time
from typing import Any

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


def ub_applies(sim: Any) -> bool:
    """Whether ``--use-nccl-ub`` changes a collective of ``sim`` (``channel_defaults.ub_ctas``)."""
    from dataclasses import replace

    from lagom_megatron.sim.channel_defaults import ub_ctas

    return any(
        ub_ctas(sim.gpu, replace(c.coll, registered=True)) is not None for c in sim._prog.calls if c.stream in UB_GROUPS
    )


def sweep_caps(sim: Any, *, passes: int = 2) -> dict[str, int]:
    caps: dict[str, int] = {}
    best = sim.run_iteration(iteration=0, noise=False).iteration_us
    for _ in range(passes):
        changed = False
        for g in groups_of(sim):
            for cap in CAPS:
                if caps.get(g) == cap:
                    continue
                trial = {**caps, g: cap}
                t = sim.run_iteration(iteration=0, noise=False, group_caps=trial).iteration_us
                if t < best * (1.0 - 1e-6):
                    best, caps, changed = t, trial, True
        if not changed:
            break
    return caps


def median_us(sim: Any, *, iters: int, **kw: Any) -> float:
    """Median iteration us over ``iters`` noisy iterations from ``BASE``."""
    return statistics.median(sim.run_iteration(iteration=BASE + i, **kw).iteration_us for i in range(iters))


def shared(sim: Any) -> dict[str, Any]:
    """The seed-independent, noise-free part of a row."""
    from lagom_megatron.sim.bench.references import oracle

    quiet = sim.run_iteration(iteration=0, noise=False)
    tl = sim.last_timeline
    free = sim.run_iteration(iteration=0, noise=False, free_comm=True)
    caps = sweep_caps(sim)
    return {
        "overlap_frac": tl.compute_overlapped_us / max(tl.compute_us, 1e-9),
        "free_comm_bound": quiet.iteration_us / free.iteration_us,
        "caps": caps,
        "oracle_plan": oracle(sim, group_caps=caps)[0],
        "ub": ub_applies(sim),
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
        "free_comm_bound": base["free_comm_bound"],
    }
    default = median_us(sim, iters=iters)
    row["default_ms"] = default / 1e3
    row["static_caps_ms"] = median_us(sim, iters=iters, group_caps=base["caps"]) / 1e3
    row["nemo_yaml_ms"] = (
        median_us(sim, iters=iters, group_caps={g: c for g, c in NEMO_CAPS.items() if g in groups}) / 1e3
    )
    row["hp_stream_ms"] = median_us(sim, iters=iters, high_priority=groups) / 1e3
    row["nccl_ub_ms"] = median_us(sim, iters=iters, registered=UB_GROUPS) / 1e3 if base["ub"] else None
    auto, auto_iters = autoccl(sim, first_iteration=AUTOCCL_FIRST, seed=seed)
    row["autoccl_ms"] = median_us(sim, iters=iters, assignment=auto, fork=True) / 1e3
    oracle_us = median_us(sim, iters=iters, assignment=base["oracle_plan"])
    row["oracle"] = default / oracle_us
    verify = {"verify_iters": verify_iters, "verify_max_iters": verify_max_iters}
    r = run_lifecycle(sim, method="priority", **verify, after_iters=0, first_iteration=LAGOM_FIRST)
    plan = r.tuner.plan
    assignment = {k: e.config for k, e in plan.entries.items()} if plan is not None else {}
    plan_us = median_us(sim, iters=iters, assignment=assignment)
    applied = r.tuner.phase.value == "applied"
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
        lagom_kept_ms=(plan_us if applied else default) / 1e3,
        model_mape=r.tuner.model_mape,
        oracle_ms=oracle_us / 1e3,
        lagom_phase=r.tuner.phase.value,
        lagom_candidate=(plan.stats.get("candidate") if plan is not None else None),
        verify_text=str(r.tuner.reason or "")[:160],
        caps=" ".join(f"{g}:{c}" for g, c in sorted(base["caps"].items())),
        lagom_hp_groups=" ".join(sorted({e.group for e in plan.entries.values() if e.config.high_priority_stream}))
        if plan is not None
        else "",
        autoccl_iterations=auto_iters,
    )
    return row


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
