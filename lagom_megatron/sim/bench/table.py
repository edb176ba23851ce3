"""``lagom bench simulated``'s table: median iteration ms per (preset, cluster, micro-batches) and seed under each
baseline, AutoCCL and lagom; ``--sensitivity``: speed-ups at each end of every ranged constant (tornado, seed 0).
SIMULATED (one representative rank per preset), not measurements."""

from __future__ import annotations

import csv
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lagom_megatron.config.presets import load_preset
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.sim.backend import SimulatedCluster, gpu_clusters, run_lifecycle, verify_counts
from lagom_megatron.sim.bench.row import (
    NEMO_CAPS,
    UB_GROUPS,
    cta_zero_assignment,
    groups_of,
    lagom_kept_us,
    median_us,
    run_row,
    shared,
    with_microbatches,
)
from lagom_megatron.sim.constants import CONSTANTS, get, overridden

PAPER_VS_NCCL = (1.07, 1.33)
"""Measured speed-ups over NCCL defaults (this) and AutoCCL (next): Lagom (arXiv 2602.20656) abstract."""
PAPER_VS_AUTOCCL = (1.03, 1.27)

ROWS: tuple[tuple[str, str, int], ...] = (
    # the paper's regime: A40 nodes, PCIe (200 / 100 Gb/s) and NVLink-bridged (2 x 400 Gb/s); FSDP, TP, EP
    ("llama2-7b-a40x16-fsdp", "a40-pcie-ib200", 2),
    ("llama2-7b-a40x16-fsdp", "a40-pcie-ib100", 2),
    ("llama2-7b-a40x16-fsdp", "a40-nvlink-ib800", 2),
    ("gpt3-2.7b-a40x8-fsdp", "a40-pcie-ib200", 2),
    ("gpt3-2.7b-a40x8-fsdp", "a40-nvlink-ib800", 1),
    ("llama2-7b-a40x16-tp8", "a40-pcie-ib200", 2),
    ("llama2-7b-a40x16-tp8", "a40-nvlink-ib800", 1),
    ("moe-2b-8e-a40x8-ep8", "a40-pcie-ib200", 2),
    ("moe-2b-8e-a40x8-ep8", "a40-nvlink-ib800", 2),
    ("gpt3-2.7b-a40x8-fsdp", "a40-pcie-ib100", 1),
    ("gpt3-2.7b-a40x8-fsdp", "h100-sxm-ib400", 1),
    ("llama2-7b-a40x16-fsdp", "h100-sxm-ib400", 1),
    ("llama2-7b-a40x16-fsdp", "a100-ib100", 1),
    ("gpt3-13b-h100x64", "h100-sxm-ib400", 2),
    ("gpt3-13b-h100x64", "a100-ib100", 2),
    ("llama3-8b-h100x8", "h100-sxm-ib400", 1),
    ("llama3-8b-h100x8", "h100-sxm-ib400", 2),
    ("llama3-8b-h100x8", "a100-ib100", 2),
    ("llama3-70b-h100x64", "h100-sxm-ib400", 2),
    ("mixtral-8x7b-h100x32", "h100-sxm-ib400", 2),
    ("llama2-7b-a100x32-ib100", "a100-ib100", 1),
    ("llama2-7b-a100x32-ib100", "a100-ib100", 2),
)
SEEDS = (0, 1, 2, 3, 4)

COLUMNS = (
    "preset",
    "cluster",
    "microbatches",
    "seed",
    "overlap_frac",
    "contention_bound",
    "exposed_comm_bound",
    "oracle",
    "default_ms",
    "static_caps_ms",
    "caps_raise_ms",
    "nemo_yaml_ms",
    "hp_stream_ms",
    "nccl_ub_ms",
    "nccl_ub_all_ms",
    "cta_zero_ms",
    "autoccl_no_transport_ms",
    "lagom_plan_ms",
    "lagom_kept_ms",
    "model_mape",
    "model_oos_mape",
    "predicted_gain",
    "simulated_gain",
)
"""Times in ms, medians; ``nccl_ub_ms`` / ``nccl_ub_all_ms`` empty where registration changes nothing, ``cta_zero_ms``
where no all-gather can run on copy engines. Bounds: the
speed-up with collectives holding no SM, HBM or dispatch wait (contention) and taking no time (exposed).
``model_mape``: in-sample; ``model_oos_mape``: moved sites, held-out iterations, no per-site offset."""
DETAIL_COLUMNS = COLUMNS + (
    "oracle_ms",
    "caps_raise",
    "lagom_registered",
    "lagom_hp_kept_ms",
    "lagom_phase",
    "lagom_candidate",
    "lagom_hp_groups",
    "caps",
    "verify_text",
    "autoccl_iterations",
    "wall_s",
)
BASELINES = (
    "default_ms",
    "static_caps_ms",
    "caps_raise_ms",
    "nemo_yaml_ms",
    "hp_stream_ms",
    "nccl_ub_ms",
    "nccl_ub_all_ms",
    "cta_zero_ms",
    "autoccl_no_transport_ms",
)
MAPE_LIMIT = 5.0

SENSITIVITY_ROWS: tuple[tuple[str, str, int], ...] = (
    ("llama2-7b-a40x16-fsdp", "a40-pcie-ib200", 2),
    ("gpt3-2.7b-a40x8-fsdp", "a40-nvlink-ib800", 1),
    ("llama2-7b-a40x16-tp8", "a40-pcie-ib200", 2),
    ("gpt3-2.7b-a40x8-fsdp", "h100-sxm-ib400", 1),
    ("llama3-8b-h100x8", "h100-sxm-ib400", 1),
    ("llama2-7b-a100x32-ib100", "a100-ib100", 1),
)
SENSITIVITY_COLUMNS = (
    "constant",
    "end",
    "value",
    "preset",
    "cluster",
    "microbatches",
    "kept",
    "oracle",
    "best_static",
    "contention_bound",
)


def select_rows(
    presets: list[str] | None,
    clusters: list[str] | None,
    microbatches: list[int | None],
    verify_iters: int | None,
    verify_max_iters: int | None,
) -> list[tuple[str, str, int | None]]:
    """``ROWS``, else ``presets`` x ``clusters`` x ``microbatches`` (default 2; None: the preset's); ValueError or
    FileNotFoundError for an unknown or non-GPU preset or cluster, or verify counts that do not fit a preset."""
    if presets is None and clusters is None:
        pairs = list(dict.fromkeys((p, c) for p, c, _ in ROWS))
        rows = [(p, c, m) for p, c in pairs for m in microbatches] if microbatches else list(ROWS)
    else:
        presets = presets or list(dict.fromkeys(r[0] for r in ROWS))
        pairs = (
            [(p, c) for p in presets for c in clusters]
            if clusters
            else [
                (p, c)
                for p in presets
                for c in (list(dict.fromkeys(r[1] for r in ROWS if r[0] == p)) or [load_preset(p).cluster])
            ]
        )
        rows = [(p, c, m) for p, c in pairs for m in microbatches or [2]]
    for p, c, _ in rows:
        preset = load_preset(p)
        spec = ClusterSpec.load(c)
        if ClusterSpec.load(preset.cluster).backend != "nccl":
            raise ValueError(
                f"preset {p!r} on cluster {c!r}: the simulator models GPU clusters (nccl); "
                f"CPU presets train for real with scripts/pretrain_gpt.py --preset {p} --lagom (README)"
            )
        if spec.backend != "nccl":
            raise ValueError(
                f"cluster {c!r} is a CPU (gloo) cluster; the simulator models GPU clusters: {', '.join(gpu_clusters())}"
            )
        try:
            verify_counts(preset, verify_iters, verify_max_iters)
        except ValueError as exc:
            raise ValueError(f"--verify-max-iters for preset {p!r}: {exc}") from None
    return list(dict.fromkeys(rows))


def run_table(
    rows: list[tuple[str, str, int | None]],
    out: Path,
    *,
    seeds: list[int],
    iters: int,
    verify_iters: int | None,
    verify_max_iters: int | None,
    jobs: int = 1,
    plot_png: bool = True,
) -> int:
    """Simulates ``rows``, writes simulated*.csv (and .png) under ``out``, prints; 1 if a row breaks ``must_show``."""
    t0 = time.perf_counter()
    work = [(p, c, m, seeds, iters, verify_iters, verify_max_iters) for p, c, m in rows]
    done: list[dict[str, Any]] = []

    def report(got: list[dict[str, Any]]) -> None:
        done.extend(got)
        r = got[0]
        print(
            f"  {r['preset']:24s} {r['cluster']:16s} {r['microbatches']:3d} mb  bound x{r['contention_bound']:.3f}  "
            f"oracle x{min(x['oracle'] for x in got):.3f}-{max(x['oracle'] for x in got):.3f}  "
            f"kept x{min(x['default_ms'] / x['lagom_kept_ms'] for x in got):.3f}-"
            f"{max(x['default_ms'] / x['lagom_kept_ms'] for x in got):.3f}  {sum(x['wall_s'] for x in got):.0f} s",
            flush=True,
        )

    if jobs > 1 and len(work) > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(jobs, len(work))) as pool:
            for got in pool.imap(_one, work):
                report(got)
    else:
        for job in work:
            report(_one(job))
    write_csv(done, out / "simulated.csv", COLUMNS)
    write_csv(done, out / "simulated_details.csv", DETAIL_COLUMNS)
    if plot_png:
        plot(done, out / "simulated.png", PAPER_VS_NCCL)
    failures = print_table(done, must_show, PAPER_VS_NCCL, PAPER_VS_AUTOCCL)
    print(
        f"\nwrote {out / 'simulated.csv'}"
        + (f" and {out / 'simulated.png'}" if plot_png else "")
        + f" in {time.perf_counter() - t0:.0f} s"
    )
    return 1 if failures else 0


def _one(job: tuple) -> list[dict[str, Any]]:
    preset, cluster, mb, seeds, iters, verify_iters, verify_max_iters = job
    logging.getLogger("lagom.tuner").setLevel(logging.ERROR)
    vi, cap = verify_counts(load_preset(preset), verify_iters, verify_max_iters)
    return run_row(preset, cluster, seeds=seeds, iters=iters, microbatches=mb, verify_iters=vi, verify_max_iters=cap)


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    return f"{v:.4f}" if isinstance(v, float) else v


def write_csv(rows: list[dict[str, Any]], path: Path, columns: tuple[str, ...]) -> None:
    """Writes ``columns`` of ``rows`` atomically."""
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in columns})
    tmp.replace(path)


def _median_by_row(rows: list[dict[str, Any]], key: str) -> dict[tuple, float]:
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get(key) not in (None, ""):
            groups.setdefault((r["preset"], r["cluster"], r["microbatches"]), []).append(
                float(r["default_ms"]) / float(r[key])
            )
    return {k: statistics.median(v) for k, v in groups.items()}


def plot(rows: list[dict[str, Any]], path: Path, paper: tuple[float, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [
        ("static_caps_ms", "best static caps"),
        ("hp_stream_ms", "high-priority stream"),
        ("nccl_ub_ms", "NCCL UB"),
        ("caps_raise_ms", "best caps, raise or lower"),
        ("nccl_ub_all_ms", "NCCL UB, every group"),
        ("cta_zero_ms", "CTA policy ZERO, gathers"),
        ("autoccl_no_transport_ms", "AutoCCL's search, no transport subspace"),
        ("oracle_ms", "oracle"),
        ("lagom_plan_ms", "lagom plan"),
        ("lagom_kept_ms", "lagom (after verify)"),
    ]
    keys = list(dict.fromkeys((r["preset"], r["cluster"], r["microbatches"]) for r in rows))
    labels = [f"{p}\n{c} {m}mb" for p, c, m in keys]
    fig, ax = plt.subplots(figsize=(max(9, 0.9 * len(keys)), 6.0))
    width = 0.8 / (len(methods) + 1)
    values = []
    for j, (key, name) in enumerate(methods):
        med = _median_by_row(rows, key)
        ys = [med.get(k, 0.0) for k in keys]
        values += [y for y in ys if y]
        ax.bar([i + (j - len(methods) / 2) * width for i in range(len(keys))], ys, width, label=name)
    bound = {(r["preset"], r["cluster"], r["microbatches"]): float(r["contention_bound"]) for r in rows}
    ax.bar(
        [i + (len(methods) / 2) * width for i in range(len(keys))],
        [bound[k] for k in keys],
        width,
        color="none",
        edgecolor="black",
        hatch="//",
        label="contention bound",
    )
    ax.axhspan(
        *paper, color="grey", alpha=0.15, label=f"paper: {paper[0]}-{paper[1]}x over NCCL (measured, real clusters)"
    )
    ax.axhline(1.0, color="black", linewidth=0.8)
    values += list(bound.values())
    ax.set_ylim(min(0.8, min(values) - 0.02), max(paper[1], max(values)) + 0.05)
    ax.set_xticks(list(range(len(keys))))
    ax.set_xticklabels(labels, fontsize=6, rotation=35, ha="right")
    ax.set_ylabel("speed-up over NCCL defaults, median over seeds (SIMULATED)")
    ax.set_title("lagom_megatron on simulated clusters (not measurements)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def print_table(
    rows: list[dict[str, Any]],
    must_show: Callable[[dict[str, Any]], list[str]],
    paper_nccl: tuple[float, float],
    paper_autoccl: tuple[float, float],
) -> int:
    """Prints the table; returns the number of ``must_show`` failures (each printed)."""
    print("\nSIMULATED iteration times (ms, median) -- from lagom_megatron's simulator, not real hardware")
    hdr = (
        f"{'preset':22s} {'cluster':16s} {'mb':>2s} {'s':>1s} {'ovl':>4s} {'cont':>5s} {'expo':>5s} {'oracle':>6s} "
        f"{'default':>8s} {'caps':>8s} {'raise':>8s} {'nemo':>8s} {'hp':>8s} {'ub':>8s} {'ub_all':>8s} {'ce':>8s} "
        f"{'ac-notr':>8s} {'plan':>8s} {'kept':>8s} {'mape':>4s} {'oos':>4s}"
    )
    print(hdr)

    def ms(v: Any) -> str:
        return f"{v:8.1f}" if v not in (None, "") else f"{'':8s}"

    for r in rows:
        oos = r.get("model_oos_mape")
        print(
            f"{r['preset'][:22]:22s} {r['cluster'][:16]:16s} {r['microbatches']:2d} {r['seed']:1d} {r['overlap_frac']:4.2f} "
            f"{r['contention_bound']:5.3f} {r['exposed_comm_bound']:5.3f} {r['oracle']:6.3f} {r['default_ms']:8.1f} "
            f"{ms(r['static_caps_ms'])} {ms(r['caps_raise_ms'])} {ms(r['nemo_yaml_ms'])} {ms(r['hp_stream_ms'])} "
            f"{ms(r.get('nccl_ub_ms'))} {ms(r.get('nccl_ub_all_ms'))} {ms(r.get('cta_zero_ms'))} "
            f"{ms(r['autoccl_no_transport_ms'])} "
            f"{r['lagom_plan_ms']:8.1f} {r['lagom_kept_ms']:8.1f} {r['model_mape']:4.1f} "
            + (f"{oos:4.1f}" if oos is not None else f"{'-':>4s}")
        )
    cont = [r["contention_bound"] for r in rows]
    expo = [r["exposed_comm_bound"] for r in rows]
    kept = [r["default_ms"] / r["lagom_kept_ms"] for r in rows]
    best = [best_baseline_ms(r) / r["lagom_kept_ms"] for r in rows]
    print(
        f"\ncontention bound (collectives hold no SM, HBM or dispatch wait), simulated: {min(cont):.3f}-{max(cont):.3f}x; "
        f"exposed-communication bound (they take no time): {min(expo):.3f}-{max(expo):.3f}x"
    )
    print(
        f"lagom kept over NCCL defaults, simulated: {min(kept):.3f}-{max(kept):.3f}x; over the best baseline "
        f"{min(best):.3f}-{max(best):.3f}x   paper, lagom over NCCL (measured): {paper_nccl[0]}-{paper_nccl[1]}x "
        f"(over AutoCCL {paper_autoccl[0]}-{paper_autoccl[1]}x; the AutoCCL column here lacks its transport subspace)"
    )
    failures = 0
    for r in rows:
        for f in must_show(r):
            failures += 1
            print(f"  NOT MET {r['preset']} {r['cluster']} {r['microbatches']} mb seed {r['seed']}: {f}")
    print("must-show: " + ("met on every row" if not failures else f"{failures} failure(s)"))
    return failures


def best_baseline_ms(row: dict[str, Any]) -> float:
    return min(float(row[k]) for k in BASELINES if row.get(k) not in (None, ""))


def must_show(row: dict[str, Any], *, noise: float | None = None) -> list[str]:
    """Claim failures: kept <= 1.005 x best baseline; plan gain >= 0.9 x oracle's (if > 2 sigma); model_mape < 5."""
    noise = get("sigma_iteration") if noise is None else noise
    out = []
    best = best_baseline_ms(row)
    if float(row["lagom_kept_ms"]) > 1.005 * best:
        out.append(f"kept {float(row['lagom_kept_ms']):.1f} ms > 1.005 x best baseline {best:.1f} ms")
    ref = float(row["oracle"]) - 1.0
    if ref > 2.0 * noise:
        got = float(row["default_ms"]) / float(row["lagom_plan_ms"]) - 1.0
        if got < 0.9 * ref:
            out.append(f"plan gain {got:.4f} < 0.9 x oracle gain {ref:.4f}")
    mape = float(row["model_mape"])
    if not mape < MAPE_LIMIT:
        out.append(f"model MAPE {mape:.1f}% >= {MAPE_LIMIT:.0f}%")
    return out


def sensitivity_row(
    preset_name: str, cluster: str, mb: int | None, verify_iters: int | None, verify_max_iters: int | None = None
) -> dict[str, float]:
    preset = load_preset(preset_name)
    vi, cap = verify_counts(preset, verify_iters, verify_max_iters)
    sim = SimulatedCluster(with_microbatches(preset, mb) if mb else preset, cluster, seed=0)
    base = shared(sim)
    groups = frozenset(groups_of(sim))
    default = median_us(sim, iters=5)
    static = [
        median_us(sim, iters=5, group_caps=base["caps"]),
        median_us(sim, iters=5, group_caps={g: c for g, c in NEMO_CAPS.items() if g in groups}),
        median_us(sim, iters=5, high_priority=groups),
    ]
    caps, floors = base["raise"]
    static.append(median_us(sim, iters=5, group_caps=caps, group_floors=floors))
    if base["ub"]:
        static.append(median_us(sim, iters=5, registered=UB_GROUPS))
    if base["ub_all"]:
        static.append(median_us(sim, iters=5, registered=groups))
    zero_groups, zero = cta_zero_assignment(sim)
    if zero:
        static.append(median_us(sim, iters=5, registered=zero_groups, assignment=zero))
    verify = {"verify_iters": vi, "verify_max_iters": cap}
    r = run_lifecycle(sim, method="priority", **verify, after_iters=0)
    kept, _ = lagom_kept_us(sim, r, default_us=default, iters=5, verify=verify)
    return {
        "kept": default / kept,
        "oracle": default / median_us(sim, iters=5, assignment=base["oracle_plan"]),
        "best_static": default / min(static),
        "contention_bound": base["contention_bound"],
    }


def run_sensitivity(
    out: Path,
    *,
    presets: list[str] | None,
    clusters: list[str] | None,
    microbatches: list[int | None],
    constants: list[str] | None,
    verify_iters: int | None,
    verify_max_iters: int | None,
) -> int:
    """Runs ``SENSITIVITY_ROWS`` (or the given cross product), writes ``sensitivity.csv``, prints the tornado."""
    t0 = time.perf_counter()
    if presets is None and clusters is None:
        rows = list(SENSITIVITY_ROWS)
    else:
        presets = presets or list(dict.fromkeys(r[0] for r in ROWS))
        mbs = [m for m in microbatches or [2] if m is not None] or [None]
        rows = [
            (p, c or next((r[1] for r in ROWS if r[0] == p), None), m)
            for p in presets
            for c in clusters or [None]
            for m in mbs
        ]
        rows = [r for r in rows if r[1] is not None]
    names = constants or list(CONSTANTS)
    lines: list[dict[str, Any]] = []
    central = {r: sensitivity_row(*r, verify_iters, verify_max_iters) for r in rows}
    for r, v in central.items():
        lines.append(
            {"constant": "-", "end": "value", "value": "", "preset": r[0], "cluster": r[1], "microbatches": r[2], **v}
        )
    for name in names:
        c = CONSTANTS[name]
        for end in ("low", "high"):
            x = getattr(c, end)
            with overridden({name: x}):
                for r in rows:
                    lines.append(
                        {
                            "constant": name,
                            "end": end,
                            "value": x,
                            "preset": r[0],
                            "cluster": r[1],
                            "microbatches": r[2],
                            **sensitivity_row(*r, verify_iters, verify_max_iters),
                        }
                    )
        print(f"  {name}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    write_csv(lines, out / "sensitivity.csv", SENSITIVITY_COLUMNS)
    print_tornado(lines, rows)
    print(f"\nwrote {out / 'sensitivity.csv'} in {time.perf_counter() - t0:.0f} s")
    return 0


def print_tornado(lines: list[dict[str, Any]], rows: list[tuple]) -> None:
    print(f"\nSENSITIVITY (SIMULATED, seed 0, {len(rows)} rows): speed-up over NCCL defaults, low end -> high end")
    for r in rows:
        key = (r[0], r[1], r[2])
        mine = [ln for ln in lines if (ln["preset"], ln["cluster"], ln["microbatches"]) == key]
        c = next(ln for ln in mine if ln["end"] == "value")
        print(
            f"\n{r[0]} on {r[1]}, {r[2]} micro-batch(es): contention bound {c['contention_bound']:.3f}, kept {c['kept']:.3f}, "
            f"oracle {c['oracle']:.3f}, best static {c['best_static']:.3f}"
        )
        print(f"  {'constant':18s} {'low..high':>13s}  {'kept':>13s}  {'oracle':>13s}  {'best static':>13s}")
        per: dict[str, dict[str, dict[str, Any]]] = {}
        for ln in mine:
            if ln["end"] != "value":
                per.setdefault(ln["constant"], {})[ln["end"]] = ln
        for name in sorted(per, key=lambda n: -abs(per[n]["high"]["kept"] - per[n]["low"]["kept"])):
            lo, hi, cst = per[name]["low"], per[name]["high"], CONSTANTS[name]
            print(
                f"  {name:18s} {f'{cst.low:g}..{cst.high:g}':>13s}  "
                + "  ".join(f"{lo[k]:.3f}->{hi[k]:.3f}" for k in ("kept", "oracle", "best_static"))
            )
