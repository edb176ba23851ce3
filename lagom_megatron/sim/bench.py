"""``lagom bench simulated``: the paper-style comparison table on simulated clusters.

For each workload (a GPU preset) on a high-bandwidth cluster (H100 NVLink + 8x400 Gb/s IB) and a
low-bandwidth one (A100 + 100 Gb/s; the same preset with its cluster overridden), the median
simulated iteration time under:

    nccl-default   no change
    efficiency     NCCL's CTA policy EFFICIENCY on every communicator
    cap-N          a static channel cap (NCCL_MAX_NCHANNELS=N style, as Liger's artifact uses)
    autoccl        the AutoCCL-style baseline: each collective tuned for its own T_comm
    lagom          the priority search; "plan" = the searched plan applied, "kept" = what the
                   lifecycle leaves in place after verification (the plan or NCCL defaults)

plus speed-ups over defaults and over autoccl, search model evaluations and wall time, the cost
model's error on its own points (MAPE) and its iteration-time prediction error against the
simulator. Writes ``<out>/simulated.csv`` and ``<out>/simulated.png``.

All figures are SIMULATED (lagom_megatron.sim, one representative rank per preset), not
measurements; the paper's reported ranges are printed beside them for orientation only.
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from lagom_megatron.engine.knobs import CommConfig

PAPER_VS_NCCL = (1.07, 1.33)
"""Lagom (arXiv 2602.20656) abstract: speed-up over NCCL defaults."""
PAPER_VS_AUTOCCL = (1.03, 1.27)
"""Lagom (arXiv 2602.20656) abstract: speed-up over AutoCCL."""

WORKLOADS: tuple[str, ...] = ("gpt3-13b-h100x64", "llama3-8b-h100x8", "llama3-70b-h100x64", "mixtral-8x7b-h100x32")
CLUSTERS: dict[str, str] = {"high": "h100-sxm-ib400", "low": "a100-ib100"}

COLUMNS = (
    "preset", "cluster", "bandwidth", "microbatches", "sites", "default_ms", "efficiency_ms", "cap_ms", "autoccl_ms",
    "lagom_plan_ms", "lagom_kept_ms", "lagom_phase", "speedup_vs_default", "speedup_vs_autoccl",
    "plan_speedup_vs_default", "autoccl_speedup_vs_default", "efficiency_speedup_vs_default", "cap_speedup_vs_default",
    "lagom_evaluations", "lagom_search_s", "autoccl_evaluations", "model_mape_pct", "predicted_plan_ms", "prediction_error_pct",
)


def _median_us(sim: Any, assignment: dict, *, iters: int, base: int, channel_cap: int | None = None) -> float:
    return statistics.median(
        sim.run_iteration(iteration=base + i, assignment=assignment, channel_cap=channel_cap).iteration_us for i in range(iters)
    )


def with_microbatches(preset: Any, n: int) -> Any:
    """The preset with its global batch cut to ``n`` micro-batches per data-parallel rank (short
    gradient accumulation: the data-parallel collectives then overlap a larger share of the
    iteration). Raises ValueError for ``n < 1``."""
    if n < 1:
        raise ValueError(f"micro-batches per rank must be >= 1; got {n}")
    p = preset.parallel
    dp = preset.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    gbs = preset.training.micro_batch_size * dp * n
    return preset.model_copy(update={"training": preset.training.model_copy(update={"global_batch_size": gbs})})


def run_one(preset_name: str, cluster: str, *, seed: int, iters: int, cap: int, microbatches: int | None = None) -> dict[str, Any]:
    """One row of the table: every method on one preset and cluster (``microbatches``: None = the
    preset's own global batch, else that many micro-batches per data-parallel rank)."""
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.sim.backend import SimulatedCluster, run_lifecycle

    preset = load_preset(preset_name)
    if microbatches is not None:
        preset = with_microbatches(preset, microbatches)
    sim = SimulatedCluster(preset, cluster, seed=seed)
    base = 10_000
    row: dict[str, Any] = {"preset": preset_name, "cluster": sim.cluster.name, "sites": len(sim.sites),
                           "microbatches": sim.workload.microbatches}
    default = _median_us(sim, {}, iters=iters, base=base)
    eff = _median_us(sim, {s.site_id: CommConfig(cta_policy="EFFICIENCY") for s in sim.sites}, iters=iters, base=base)
    capped = _median_us(sim, {}, iters=iters, base=base, channel_cap=cap)
    runs = {}
    for method in ("autoccl", "priority"):
        r = run_lifecycle(sim, method=method, verify_iters=preset.lagom.lagom_verify_iters, after_iters=0)
        plan = r.tuner.plan
        assignment = {k: e.config for k, e in plan.entries.items()} if plan is not None else {}
        plan_us = _median_us(sim, assignment, iters=iters, base=base)
        kept_us = plan_us if r.tuner.phase.value == "applied" else default
        runs[method] = (r.tuner, plan_us, kept_us)
    auto_t, auto_plan, _ = runs["autoccl"]
    lag_t, lag_plan, lag_kept = runs["priority"]
    pred = lag_t.search_stats.get("predicted_iteration_us")
    row.update(
        default_ms=default / 1e3, efficiency_ms=eff / 1e3, cap_ms=capped / 1e3, autoccl_ms=auto_plan / 1e3,
        lagom_plan_ms=lag_plan / 1e3, lagom_kept_ms=lag_kept / 1e3, lagom_phase=lag_t.phase.value,
        speedup_vs_default=default / lag_kept, speedup_vs_autoccl=auto_plan / lag_kept,
        plan_speedup_vs_default=default / lag_plan, autoccl_speedup_vs_default=default / auto_plan,
        efficiency_speedup_vs_default=default / eff, cap_speedup_vs_default=default / capped,
        lagom_evaluations=lag_t.search_stats.get("model_evaluations"), lagom_search_s=lag_t.search_stats.get("wall_time_s"),
        autoccl_evaluations=auto_t.search_stats.get("model_evaluations"), model_mape_pct=lag_t.model_mape,
        predicted_plan_ms=pred / 1e3 if isinstance(pred, (int, float)) else None,
        prediction_error_pct=abs(pred - lag_plan) / lag_plan * 100 if isinstance(pred, (int, float)) else None,
    )
    return row


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """Writes the table atomically (temporary file + rename)."""
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})
    tmp.replace(path)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bar chart of speed-ups over NCCL defaults per workload and method, with the paper's range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [("efficiency_speedup_vs_default", "CTA policy EFFICIENCY"), ("cap_speedup_vs_default", "static channel cap"),
               ("autoccl_speedup_vs_default", "AutoCCL-style"), ("plan_speedup_vs_default", "lagom plan"),
               ("speedup_vs_default", "lagom (after verify)")]
    labels = [f"{r['preset'].split('-h100')[0]}\n{r['bandwidth']}, {r['microbatches']} mb" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 1.0 * len(rows)), 4.8))
    width = 0.8 / len(methods)
    for j, (key, name) in enumerate(methods):
        ax.bar([i + (j - len(methods) / 2 + 0.5) * width for i in range(len(rows))], [r[key] for r in rows], width, label=name)
    ax.axhspan(*PAPER_VS_NCCL, color="grey", alpha=0.15, label="paper: 1.07-1.33x over NCCL (real clusters)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    values = [r[k] for r in rows for k, _ in methods]
    ax.set_ylim(min(0.85, min(values) - 0.02), max(PAPER_VS_NCCL[1], max(values)) + 0.05)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("speed-up over NCCL defaults (SIMULATED)")
    ax.set_title("lagom_megatron on simulated clusters (not measurements)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lagom bench simulated`` and ``scripts/bench_simulated.py``.

    Raises:
        ValueError: an unknown preset or cluster (from the loaders).
    """
    ap = argparse.ArgumentParser(prog="lagom bench simulated", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_out", help="output folder for simulated.csv and simulated.png")
    ap.add_argument("--presets", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--bandwidth", nargs="+", choices=sorted(CLUSTERS), default=["high", "low"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=5, help="simulated iterations per median")
    ap.add_argument("--cap", type=int, default=8, help="channels of the static-cap baseline")
    ap.add_argument("--microbatches", nargs="+", default=["preset", "2"],
                    help="micro-batches per DP rank: 'preset' (the preset's global batch) and/or numbers (short accumulation)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    tuner_log = logging.getLogger("lagom.tuner")
    level = tuner_log.level
    tuner_log.setLevel(logging.ERROR)  # fall-backs are columns of the table
    try:
        return _run(args)
    finally:
        tuner_log.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    accum = [None if m == "preset" else int(m) for m in args.microbatches]
    for mb in accum:
        for preset in args.presets:
            for bw in args.bandwidth:
                row = run_one(preset, CLUSTERS[bw], seed=args.seed, iters=args.iters, cap=args.cap, microbatches=mb)
                row["bandwidth"] = bw
                rows.append(row)
                print(f"  {preset:24s} {row['cluster']:15s} {row['microbatches']:4d} mb  default {row['default_ms']:9.1f} ms  lagom x{row['speedup_vs_default']:.3f} "
                      f"({row['lagom_phase']}, plan x{row['plan_speedup_vs_default']:.3f})  autoccl x{row['autoccl_speedup_vs_default']:.3f}", flush=True)
    write_csv(rows, out / "simulated.csv")
    if not args.no_plot:
        plot(rows, out / "simulated.png")
    print_table(rows)
    print(f"\nwrote {out / 'simulated.csv'}" + ("" if args.no_plot else f" and {out / 'simulated.png'}") +
          f" in {time.perf_counter() - t0:.0f} s")
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    """The table on stdout, with the paper's figures beside ours."""
    print("\nSIMULATED iteration times (ms, median) -- from lagom_megatron's simulator, not real hardware")
    hdr = f"{'preset':22s} {'bw':4s} {'mb':>4s} {'sites':>5s} {'default':>9s} {'effic.':>9s} {'cap':>9s} {'autoccl':>9s} {'lagom':>9s} {'kept':>9s}  {'vs def':>6s} {'vs auto':>7s} {'evals':>7s} {'search s':>8s} {'MAPE%':>6s} {'pred err%':>9s}"
    print(hdr)
    for r in rows:
        print(f"{r['preset'][:22]:22s} {r['bandwidth']:4s} {r['microbatches']:4d} {r['sites']:5d} {r['default_ms']:9.1f} {r['efficiency_ms']:9.1f} {r['cap_ms']:9.1f} "
              f"{r['autoccl_ms']:9.1f} {r['lagom_plan_ms']:9.1f} {r['lagom_kept_ms']:9.1f}  {r['speedup_vs_default']:6.3f} {r['speedup_vs_autoccl']:7.3f} "
              f"{r['lagom_evaluations'] or 0:7d} {r['lagom_search_s'] or 0:8.3f} {r['model_mape_pct'] or 0:6.1f} {r['prediction_error_pct'] or 0:9.1f}")
    vs_def = [r["speedup_vs_default"] for r in rows]
    vs_auto = [r["speedup_vs_autoccl"] for r in rows]
    print(f"\nlagom over NCCL defaults : ours (simulated) {min(vs_def):.3f}-{max(vs_def):.3f}x   paper (real clusters) {PAPER_VS_NCCL[0]}-{PAPER_VS_NCCL[1]}x")
    print(f"lagom over AutoCCL       : ours (simulated) {min(vs_auto):.3f}-{max(vs_auto):.3f}x   paper (real clusters) {PAPER_VS_AUTOCCL[0]}-{PAPER_VS_AUTOCCL[1]}x")
    print("Ours are simulated with a calibrated model of one representative rank; the paper's are measured.")
