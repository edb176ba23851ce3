"""``lagom bench simulated``: the paper-style comparison table on simulated clusters.

One row per (preset, cluster, micro-batches per data-parallel rank): the median simulated
iteration time (ms) under

    default         NCCL's own choices (``sim.channel_defaults``: 2 channels on PCIe, 24/32 on NVSwitch)
    cta_efficiency  NCCL_CTA_POLICY=EFFICIENCY on every communicator, as NCCL 2.27+ applies it
                    (``device.cta_efficiency_applies``: only registered NVLS gathers; else the default)
    cap2/4/8        NCCL_MAX_NCHANNELS=2/4/8 on every collective (Liger's static limit)
    autoccl         AutoCCL as its public code behaves: online coordinate descent on each
                    collective's measured time, any gain accepted (``sim.bench_methods``)
    oracle          coordinate descent on the simulator itself, noise off (``sim.bench_methods``)
    lagom_plan      lagom's searched plan applied; lagom_kept: what the lifecycle keeps after
                    paired verification (the plan, or NCCL's defaults)

plus ``overlap_frac`` (share of compute time that overlaps a collective, defaults, noise off) and
``free_comm_bound`` (defaults / the same iteration with every collective holding no SM and drawing
no HBM: the most any contention tuning could gain). The speed-up columns are over ``default``.
Writes ``<out>/simulated.csv`` and ``<out>/simulated.png``.

All figures are SIMULATED (lagom_megatron.sim, one representative rank per preset), not
measurements; the paper's measured ranges are printed beside the bound column for orientation.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from lagom_megatron.engine.knobs import CommConfig

PAPER_VS_NCCL = (1.07, 1.33)
"""Lagom (arXiv 2602.20656) abstract: measured speed-up over NCCL defaults."""
PAPER_VS_AUTOCCL = (1.03, 1.27)
"""Lagom (arXiv 2602.20656) abstract: measured speed-up over AutoCCL."""

ROWS: tuple[tuple[str, str], ...] = (
    ("llama2-7b-a40x16-fsdp", "a40-pcie-ib200"), ("llama2-7b-a40x16-fsdp", "a40-pcie-ib100"),
    ("gpt3-2.7b-a40x8-fsdp", "a40-pcie-ib200"), ("llama2-7b-a40x16-tp8", "a40-pcie-ib200"),
    ("moe-2b-8e-a40x8-ep8", "a40-pcie-ib200"),
    ("gpt3-13b-h100x64", "h100-sxm-ib400"), ("gpt3-13b-h100x64", "a100-ib100"),
    ("llama3-8b-h100x8", "h100-sxm-ib400"), ("llama3-8b-h100x8", "a100-ib100"),
    ("llama3-70b-h100x64", "h100-sxm-ib400"), ("llama3-70b-h100x64", "a100-ib100"),
    ("mixtral-8x7b-h100x32", "h100-sxm-ib400"), ("mixtral-8x7b-h100x32", "a100-ib100"),
)
"""The default table: the paper's regime (A40 PCIe nodes; FSDP, TP and EP) and the H100 / A100 presets."""
CAPS = (2, 4, 8)

COLUMNS = (
    "preset", "cluster", "microbatches", "sites", "overlap_frac", "free_comm_bound", "oracle",
    "default_ms", "cta_efficiency_ms", "cap2_ms", "cap4_ms", "cap8_ms", "autoccl_ms", "oracle_ms",
    "lagom_plan_ms", "lagom_kept_ms", "lagom_phase", "lagom_candidate", "verify_text",
    "speedup_vs_default", "plan_speedup_vs_default", "speedup_vs_autoccl", "best_static_ms",
    "model_mape_pct", "lagom_evaluations", "autoccl_iterations", "oracle_iterations", "wall_s",
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


def run_one(preset_name: str, cluster: str, *, seed: int, iters: int, microbatches: int | None = None,
            verify_iters: int = 16) -> dict[str, Any]:
    """One row of the table: every method on one preset and cluster (``microbatches``: None = the
    preset's own global batch, else that many micro-batches per data-parallel rank)."""
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.sim.backend import SimulatedCluster, run_lifecycle
    from lagom_megatron.sim.bench_methods import autoccl_online, oracle

    t0 = time.perf_counter()
    preset = load_preset(preset_name)
    if microbatches is not None:
        preset = with_microbatches(preset, microbatches)
    sim = SimulatedCluster(preset, cluster, seed=seed)
    base = 100_000
    row: dict[str, Any] = {"preset": preset_name, "cluster": sim.cluster.name, "sites": len(sim.sites),
                           "microbatches": sim.workload.microbatches}
    quiet = sim.run_iteration(iteration=0, noise=False)
    tl = sim.last_timeline
    free = sim.run_iteration(iteration=0, noise=False, free_comm=True)
    row["overlap_frac"] = tl.compute_overlapped_us / max(tl.compute_us, 1e-9)
    row["free_comm_bound"] = quiet.iteration_us / free.iteration_us
    default = _median_us(sim, {}, iters=iters, base=base)
    row["default_ms"] = default / 1e3
    row["cta_efficiency_ms"] = _median_us(sim, {s.site_id: CommConfig(cta_policy="EFFICIENCY") for s in sim.sites},
                                          iters=iters, base=base) / 1e3
    for cap in CAPS:
        row[f"cap{cap}_ms"] = _median_us(sim, {}, iters=iters, base=base, channel_cap=cap) / 1e3
    auto, auto_iters = autoccl_online(sim, first_iteration=10_000)
    row["autoccl_ms"] = _median_us(sim, auto, iters=iters, base=base) / 1e3
    orc, _, orc_iters = oracle(sim)
    row["oracle_ms"] = _median_us(sim, orc, iters=iters, base=base) / 1e3
    r = run_lifecycle(sim, method="priority", verify_iters=verify_iters, after_iters=0)
    plan = r.tuner.plan
    assignment = {k: e.config for k, e in plan.entries.items()} if plan is not None else {}
    plan_us = _median_us(sim, assignment, iters=iters, base=base)
    applied = r.tuner.phase.value == "applied"
    kept_us = plan_us if applied else default
    static = min(row["default_ms"], row["cta_efficiency_ms"], *(row[f"cap{c}_ms"] for c in CAPS), row["autoccl_ms"])
    row.update(
        oracle=default / (row["oracle_ms"] * 1e3), lagom_plan_ms=plan_us / 1e3, lagom_kept_ms=kept_us / 1e3,
        lagom_phase=r.tuner.phase.value, lagom_candidate=(plan.stats.get("candidate") if plan is not None else None),
        verify_text=str(r.tuner.reason or "")[:160],
        speedup_vs_default=default / kept_us, plan_speedup_vs_default=default / plan_us,
        speedup_vs_autoccl=row["autoccl_ms"] * 1e3 / kept_us, best_static_ms=static,
        model_mape_pct=r.tuner.model_mape, lagom_evaluations=r.tuner.search_stats.get("model_evaluations"),
        autoccl_iterations=auto_iters, oracle_iterations=orc_iters, wall_s=time.perf_counter() - t0,
    )
    return row


def must_show(row: dict[str, Any]) -> list[str]:
    """The table's two claims for one row, as failures (empty = both hold):
    ``lagom_kept_ms <= 1.005 * min(default, cta_efficiency, cap2, cap4, cap8, autoccl)``, and where
    ``free_comm_bound > 1.01``, ``default/lagom_plan - 1 >= 0.9 * (default/oracle - 1)``."""
    out = []
    if row["lagom_kept_ms"] > 1.005 * row["best_static_ms"]:
        out.append(f"kept {row['lagom_kept_ms']:.1f} ms > 1.005 x best static {row['best_static_ms']:.1f} ms")
    if row["free_comm_bound"] > 1.01:
        got, ref = row["default_ms"] / row["lagom_plan_ms"] - 1.0, row["default_ms"] / row["oracle_ms"] - 1.0
        if got < 0.9 * ref:
            out.append(f"plan gain {got:.4f} < 0.9 x oracle gain {ref:.4f}")
    return out


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
    """Bar chart of speed-ups over NCCL defaults per row and method, with the free-comm bound and
    the paper's measured range. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [("cap2_ms", "cap 2"), ("cap8_ms", "cap 8"), ("autoccl_ms", "AutoCCL (online)"),
               ("oracle_ms", "oracle"), ("lagom_plan_ms", "lagom plan"), ("lagom_kept_ms", "lagom (after verify)")]
    labels = [f"{r['preset']}\n{r['cluster']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(9, 1.1 * len(rows)), 6.0))
    width = 0.8 / (len(methods) + 1)
    xs = range(len(rows))
    for j, (key, name) in enumerate(methods):
        ax.bar([i + (j - len(methods) / 2) * width for i in xs], [r["default_ms"] / r[key] for r in rows], width, label=name)
    ax.bar([i + (len(methods) / 2) * width for i in xs], [r["free_comm_bound"] for r in rows], width, color="none",
           edgecolor="black", hatch="//", label="free-comm bound")
    ax.axhspan(*PAPER_VS_NCCL, color="grey", alpha=0.15, label="paper: 1.07-1.33x over NCCL (measured, real clusters)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    values = [r["default_ms"] / r[k] for r in rows for k, _ in methods] + [r["free_comm_bound"] for r in rows]
    ax.set_ylim(min(0.8, min(values) - 0.02), max(PAPER_VS_NCCL[1], max(values)) + 0.05)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("speed-up over NCCL defaults (SIMULATED)")
    ax.set_title("lagom_megatron on simulated clusters (not measurements)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def _positive_int(lo: int):
    """An argparse type for an integer >= ``lo``; argparse names the option in front of the
    message (``argument --iters: 0 is not an integer >= 1``), as ``cli.options.int_range`` does."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {lo}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} is not an integer >= {lo}")
        return v
    parse.__name__ = "integer"
    return parse


def _microbatches(text: str) -> int | None:
    """One ``--microbatches`` value: ``preset`` (None: the preset's own global batch) or an integer >= 1.

    Raises:
        ValueError: anything else (names the option, what is allowed and the value).
    """
    if text == "preset":
        return None
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"--microbatches must be 'preset' or an integer >= 1; got {text!r}") from None
    if v < 1:
        raise ValueError(f"--microbatches must be 'preset' or an integer >= 1; got {v}")
    return v


def main(argv: list[str] | None = None, *, parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> int:
    """Entry point of ``lagom bench simulated`` and ``scripts/bench_simulated.py``. Returns 0, or 1
    when a row breaks ``must_show`` (the rows are still written).

    Args:
        argv: the options (module docstring); default ``sys.argv[1:]``.
        parser_class: the argparse parser class (``lagom`` passes its one-line-error parser).

    Raises:
        SystemExit: a bad option (argparse names it): --iters, --verify-iters, --microbatches below 1,
            an unknown or CPU preset or cluster, an --out that cannot be written.
    """
    ap = parser_class(prog="lagom bench simulated", description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--out", default="bench_out", help="output folder for simulated.csv and simulated.png")
    ap.add_argument("--presets", nargs="+", default=None, help="presets (default: the table's rows)")
    ap.add_argument("--clusters", nargs="+", default=None, help="clusters each preset runs on (default: the table's rows)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=_positive_int(1), default=5, help="simulated iterations per median")
    ap.add_argument("--verify-iters", type=_positive_int(1), default=16,
                    help="lagom's verification iterations per arm")
    ap.add_argument("--microbatches", nargs="+", default=["2"],
                    help="micro-batches per DP rank: 'preset' (the preset's global batch) and/or integers >= 1")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    rows = _rows(ap, args)
    accum = []
    for m in args.microbatches:
        try:
            accum.append(_microbatches(m))
        except ValueError as exc:
            ap.error(str(exc))
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {str(out)!r} cannot be created: {exc}")
    if not os.access(out, os.W_OK):
        ap.error(f"--out {str(out)!r} is not writable")
    tuner_log = logging.getLogger("lagom.tuner")
    level = tuner_log.level
    tuner_log.setLevel(logging.ERROR)  # fall-backs are columns of the table
    try:
        return _run(args, rows, accum, out)
    finally:
        tuner_log.setLevel(level)


def _rows(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (preset, cluster) pairs to run; refuses unknown presets and clusters and CPU ones."""
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.engine.cluster import ClusterSpec

    def load(p: str):
        try:
            return load_preset(p)
        except (ValueError, FileNotFoundError) as exc:
            ap.error(str(exc))

    rows = [r for r in ROWS if (args.presets is None or r[0] in args.presets)]
    if args.presets is not None and args.clusters is None:
        rows += [(p, load(p).cluster) for p in args.presets if p not in {r[0] for r in ROWS}]
    if args.clusters is not None:
        presets = args.presets or list(dict.fromkeys(r[0] for r in ROWS))
        rows = [(p, c) for p in presets for c in args.clusters]
    for p, c in rows:
        preset = load(p)
        try:
            spec = ClusterSpec.load(c)
        except (ValueError, FileNotFoundError) as exc:
            ap.error(str(exc))
        if spec.backend != "nccl" or ClusterSpec.load(preset.cluster).backend != "nccl":
            ap.error(f"preset {p!r} on cluster {c!r}: the simulator models GPU clusters (nccl); "
                     f"CPU presets train for real with scripts/pretrain_gpt.py --preset {p} --lagom (README)")
    return rows


def _run(args: argparse.Namespace, pairs: list[tuple[str, str]], accum: list[int | None], out: Path) -> int:
    rows = []
    t0 = time.perf_counter()
    for mb in accum:
        for preset, cluster in pairs:
            row = run_one(preset, cluster, seed=args.seed, iters=args.iters, microbatches=mb, verify_iters=args.verify_iters)
            rows.append(row)
            print(f"  {preset:24s} {row['cluster']:15s} {row['microbatches']:4d} mb  bound x{row['free_comm_bound']:.3f}  "
                  f"oracle x{row['oracle']:.3f}  lagom x{row['speedup_vs_default']:.3f} ({row['lagom_phase']}, "
                  f"plan x{row['plan_speedup_vs_default']:.3f})  {row['wall_s']:.0f} s", flush=True)
    write_csv(rows, out / "simulated.csv")
    if not args.no_plot:
        plot(rows, out / "simulated.png")
    failures = print_table(rows)
    print(f"\nwrote {out / 'simulated.csv'}" + ("" if args.no_plot else f" and {out / 'simulated.png'}") +
          f" in {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


def print_table(rows: list[dict[str, Any]]) -> int:
    """The table on stdout, the paper's measured range beside the free-comm bound; returns the
    number of rows that break ``must_show`` (each printed)."""
    print("\nSIMULATED iteration times (ms, median) -- from lagom_megatron's simulator, not real hardware")
    hdr = (f"{'preset':22s} {'cluster':15s} {'mb':>3s} {'ovl':>5s} {'bound':>6s} {'oracle':>6s} {'default':>8s} {'cta-eff':>8s} "
           f"{'cap2':>8s} {'cap4':>8s} {'cap8':>8s} {'autoccl':>8s} {'plan':>8s} {'kept':>8s} {'phase':>9s}")
    print(hdr)
    for r in rows:
        print(f"{r['preset'][:22]:22s} {r['cluster'][:15]:15s} {r['microbatches']:3d} {r['overlap_frac']:5.2f} {r['free_comm_bound']:6.3f} "
              f"{r['oracle']:6.3f} {r['default_ms']:8.1f} {r['cta_efficiency_ms']:8.1f} {r['cap2_ms']:8.1f} {r['cap4_ms']:8.1f} "
              f"{r['cap8_ms']:8.1f} {r['autoccl_ms']:8.1f} {r['lagom_plan_ms']:8.1f} {r['lagom_kept_ms']:8.1f} {r['lagom_phase']:>9s}")
    bound = [r["free_comm_bound"] for r in rows]
    vs_def = [r["speedup_vs_default"] for r in rows]
    print(f"\nbound of any contention tuning (free-comm), simulated: {min(bound):.3f}-{max(bound):.3f}x   "
          f"paper, lagom over NCCL (measured): {PAPER_VS_NCCL[0]}-{PAPER_VS_NCCL[1]}x, over AutoCCL {PAPER_VS_AUTOCCL[0]}-{PAPER_VS_AUTOCCL[1]}x")
    print(f"lagom kept over NCCL defaults, simulated: {min(vs_def):.3f}-{max(vs_def):.3f}x")
    failures = 0
    for r in rows:
        for f in must_show(r):
            failures += 1
            print(f"  NOT MET {r['preset']} {r['cluster']} {r['microbatches']} mb: {f}")
    print("must-show: " + ("met on every row" if not failures else f"{failures} failure(s)"))
    return failures
