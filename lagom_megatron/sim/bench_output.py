"""``lagom bench simulated``'s output: the CSV files, the bar chart and the table with its claims."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any, Callable


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
            groups.setdefault((r["preset"], r["cluster"], r["microbatches"]), []).append(float(r["default_ms"]) / float(r[key]))
    return {k: statistics.median(v) for k, v in groups.items()}


def plot(rows: list[dict[str, Any]], path: Path, paper: tuple[float, float]) -> None:
    """Bar chart of median speed-ups over NCCL defaults per row and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [("static_caps_ms", "best static caps"), ("hp_stream_ms", "high-priority stream"),
               ("nccl_ub_ms", "NCCL UB"), ("autoccl_ms", "AutoCCL (online)"), ("oracle_ms", "oracle"),
               ("lagom_plan_ms", "lagom plan"), ("lagom_kept_ms", "lagom (after verify)")]
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
    bound = {(r["preset"], r["cluster"], r["microbatches"]): float(r["free_comm_bound"]) for r in rows}
    ax.bar([i + (len(methods) / 2) * width for i in range(len(keys))], [bound[k] for k in keys], width, color="none",
           edgecolor="black", hatch="//", label="free-comm bound")
    ax.axhspan(*paper, color="grey", alpha=0.15, label=f"paper: {paper[0]}-{paper[1]}x over NCCL (measured, real clusters)")
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


def print_table(rows: list[dict[str, Any]], must_show: Callable[[dict[str, Any]], list[str]],
                paper_nccl: tuple[float, float], paper_autoccl: tuple[float, float]) -> int:
    """Prints the table; returns the number of ``must_show`` failures (each printed)."""
    print("\nSIMULATED iteration times (ms, median) -- from lagom_megatron's simulator, not real hardware")
    hdr = (f"{'preset':22s} {'cluster':16s} {'mb':>2s} {'s':>1s} {'ovl':>4s} {'bound':>5s} {'oracle':>6s} {'default':>8s} "
           f"{'caps':>8s} {'nemo':>8s} {'hp':>8s} {'ub':>8s} {'autoccl':>8s} {'plan':>8s} {'kept':>8s} {'mape':>4s}")
    print(hdr)
    for r in rows:
        ub = f"{r['nccl_ub_ms']:8.1f}" if r.get("nccl_ub_ms") is not None else f"{'':8s}"
        print(f"{r['preset'][:22]:22s} {r['cluster'][:16]:16s} {r['microbatches']:2d} {r['seed']:1d} {r['overlap_frac']:4.2f} "
              f"{r['free_comm_bound']:5.3f} {r['oracle']:6.3f} {r['default_ms']:8.1f} {r['static_caps_ms']:8.1f} "
              f"{r['nemo_yaml_ms']:8.1f} {r['hp_stream_ms']:8.1f} {ub} {r['autoccl_ms']:8.1f} {r['lagom_plan_ms']:8.1f} "
              f"{r['lagom_kept_ms']:8.1f} {r['model_mape']:4.1f}")
    bound = [r["free_comm_bound"] for r in rows]
    kept = [r["default_ms"] / r["lagom_kept_ms"] for r in rows]
    auto = [r["autoccl_ms"] / r["lagom_kept_ms"] for r in rows]
    print(f"\nbound of any contention tuning (free-comm), simulated: {min(bound):.3f}-{max(bound):.3f}x   "
          f"paper, lagom over NCCL (measured): {paper_nccl[0]}-{paper_nccl[1]}x, over AutoCCL {paper_autoccl[0]}-{paper_autoccl[1]}x")
    print(f"lagom kept over NCCL defaults, simulated: {min(kept):.3f}-{max(kept):.3f}x; over AutoCCL {min(auto):.3f}-{max(auto):.3f}x")
    failures = 0
    for r in rows:
        for f in must_show(r):
            failures += 1
            print(f"  NOT MET {r['preset']} {r['cluster']} {r['microbatches']} mb seed {r['seed']}: {f}")
    print("must-show: " + ("met on every row" if not failures else f"{failures} failure(s)"))
    return failures
