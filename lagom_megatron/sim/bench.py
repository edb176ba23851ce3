"""``lagom bench simulated``: the paper-style comparison table on simulated clusters.

Median iteration ms per (preset, cluster, micro-batches) and seed under each baseline, AutoCCL and lagom.
SIMULATED (one representative rank per preset), not measurements.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from lagom_megatron.sim.bench_output import plot, print_table, write_csv
from lagom_megatron.sim.bench_row import with_microbatches  # noqa: F401  (part of this module's API)
from lagom_megatron.sim.constants import get

PAPER_VS_NCCL = (1.07, 1.33)
"""Lagom (arXiv 2602.20656) abstract: measured speed-up over NCCL defaults."""
PAPER_VS_AUTOCCL = (1.03, 1.27)
"""Lagom (arXiv 2602.20656) abstract: measured speed-up over AutoCCL."""

ROWS: tuple[tuple[str, str, int], ...] = (
    # the paper's regime: A40 nodes, PCIe (200 / 100 Gb/s) and NVLink-bridged (2 x 400 Gb/s); FSDP, TP, EP
    ("llama2-7b-a40x16-fsdp", "a40-pcie-ib200", 2), ("llama2-7b-a40x16-fsdp", "a40-pcie-ib100", 2),
    ("llama2-7b-a40x16-fsdp", "a40-nvlink-ib800", 2), ("gpt3-2.7b-a40x8-fsdp", "a40-pcie-ib200", 2),
    ("gpt3-2.7b-a40x8-fsdp", "a40-nvlink-ib800", 1), ("llama2-7b-a40x16-tp8", "a40-pcie-ib200", 2),
    ("llama2-7b-a40x16-tp8", "a40-nvlink-ib800", 1), ("moe-2b-8e-a40x8-ep8", "a40-pcie-ib200", 2),
    ("moe-2b-8e-a40x8-ep8", "a40-nvlink-ib800", 2), ("gpt3-2.7b-a40x8-fsdp", "a40-pcie-ib100", 1),
    # FSDP on NVSwitch clusters, one micro-batch
    ("gpt3-2.7b-a40x8-fsdp", "h100-sxm-ib400", 1), ("llama2-7b-a40x16-fsdp", "h100-sxm-ib400", 1),
    ("llama2-7b-a40x16-fsdp", "a100-ib100", 1),
    # the H100 / A100 presets
    ("gpt3-13b-h100x64", "h100-sxm-ib400", 2), ("gpt3-13b-h100x64", "a100-ib100", 2),
    ("llama3-8b-h100x8", "h100-sxm-ib400", 1), ("llama3-8b-h100x8", "h100-sxm-ib400", 2),
    ("llama3-8b-h100x8", "a100-ib100", 2), ("llama3-70b-h100x64", "h100-sxm-ib400", 2),
    ("mixtral-8x7b-h100x32", "h100-sxm-ib400", 2), ("llama2-7b-a100x32-ib100", "a100-ib100", 1),
    ("llama2-7b-a100x32-ib100", "a100-ib100", 2),
)
SEEDS = (0, 1, 2, 3, 4)

COLUMNS = (
    "preset", "cluster", "microbatches", "seed", "overlap_frac", "free_comm_bound", "oracle", "default_ms",
    "static_caps_ms", "nemo_yaml_ms", "hp_stream_ms", "nccl_ub_ms", "autoccl_ms", "lagom_plan_ms", "lagom_kept_ms",
    "model_mape",
)
"""Times in ms, medians; ``nccl_ub_ms`` empty where it does not apply."""
DETAIL_COLUMNS = COLUMNS + ("oracle_ms", "lagom_hp_kept_ms", "lagom_phase", "lagom_candidate", "lagom_hp_groups", "caps",
                            "verify_text", "autoccl_iterations", "wall_s")
BASELINES = ("default_ms", "static_caps_ms", "nemo_yaml_ms", "hp_stream_ms", "nccl_ub_ms", "autoccl_ms")
MAPE_LIMIT = 5.0


def best_baseline_ms(row: dict[str, Any]) -> float:
    """The fastest baseline (``BASELINES``) of a row."""
    return min(float(row[k]) for k in BASELINES if row.get(k) not in (None, ""))


def must_show(row: dict[str, Any], *, noise: float | None = None) -> list[str]:
    """The row's claim failures: kept <= 1.005 x best baseline; plan gain >= 0.9 x oracle gain where the oracle's
    exceeds 2 ``sigma_iteration``; ``model_mape < 5``.
    """
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


def _positive_int(lo: int):
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
    """``preset`` (None) or an integer >= 1; ValueError otherwise."""
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
    """Entry point of ``lagom bench simulated``; returns 1 when a row breaks ``must_show``, else 0."""
    ap = parser_class(prog="lagom bench simulated", description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--out", default="bench_out", help="output folder for simulated.csv and simulated.png")
    ap.add_argument("--presets", nargs="+", default=None, help="presets (default: the table's rows)")
    ap.add_argument("--clusters", nargs="+", default=None, help="clusters each preset runs on (default: the table's rows)")
    ap.add_argument("--seeds", type=_positive_int(0), nargs="+", default=list(SEEDS), help="noise seeds (default 0-4)")
    ap.add_argument("--iters", type=_positive_int(1), default=5, help="simulated iterations per median")
    ap.add_argument("--verify-iters", type=_positive_int(1), default=None,
                    help="lagom's verification iterations per arm at its first look (default: each preset's "
                         "lagom_verify_iters; given alone, also the cap)")
    ap.add_argument("--verify-max-iters", type=_positive_int(1), default=None,
                    help="the most verification iterations per arm while the verdict is undecided (default: each "
                         "preset's lagom_verify_max_iters, or --verify-iters when that is given)")
    ap.add_argument("--microbatches", nargs="+", default=None,
                    help="micro-batches per DP rank for --presets / --clusters rows: 'preset' and/or integers >= 1 "
                         "(default: the table's rows, or 2)")
    ap.add_argument("--jobs", type=_positive_int(1), default=1, help="rows simulated in parallel processes")
    ap.add_argument("--sensitivity", action="store_true",
                    help="run the sensitivity (tornado) table of the ranged constants instead (sim.bench_sensitivity)")
    ap.add_argument("--constants", nargs="+", default=None,
                    help="with --sensitivity: only these ranged constants (default: all of sim.constants)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    from lagom_megatron.sim.constants import CONSTANTS

    unknown = [c for c in args.constants or [] if c not in CONSTANTS]
    if unknown:
        ap.error(f"--constants: unknown {unknown}; the ranged constants are {sorted(CONSTANTS)}")
    if args.constants and not args.sensitivity:
        ap.error("--constants needs --sensitivity")
    accum = []
    for m in args.microbatches or []:
        try:
            accum.append(_microbatches(m))
        except ValueError as exc:
            ap.error(str(exc))
    rows = _rows(ap, args, accum)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out {str(out)!r} is a file; give a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {str(out)!r} cannot be created: {exc.strerror or exc}")
    if not os.access(out, os.W_OK):
        ap.error(f"--out {str(out)!r} is not writable")
    tuner_log = logging.getLogger("lagom.tuner")
    level = tuner_log.level
    tuner_log.setLevel(logging.ERROR)  # fall-backs are columns of the table
    try:
        if args.sensitivity:
            from lagom_megatron.sim.bench_sensitivity import run_sensitivity

            return run_sensitivity(args, out, constants=args.constants, table=ROWS)
        return _run(args, rows, out)
    finally:
        tuner_log.setLevel(level)


def _rows(ap: argparse.ArgumentParser, args: argparse.Namespace, accum: list[int | None]) -> list[tuple[str, str, int | None]]:
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.sim.backend import verify_counts

    def load(p: str):
        try:
            return load_preset(p)
        except (ValueError, FileNotFoundError) as exc:
            ap.error(str(exc))

    if args.presets is None and args.clusters is None:
        pairs = list(dict.fromkeys((p, c) for p, c, _ in ROWS))
        rows = [(p, c, m) for p, c in pairs for m in accum] if accum else list(ROWS)
    else:
        mbs = accum or [2]
        presets = args.presets or list(dict.fromkeys(r[0] for r in ROWS))
        pairs = [(p, c) for p in presets for c in args.clusters] if args.clusters else \
            [(p, c) for p in presets for c in (list(dict.fromkeys(r[1] for r in ROWS if r[0] == p)) or [load(p).cluster])]
        rows = [(p, c, m) for p, c in pairs for m in mbs]
    for p, c, _ in rows:
        preset = load(p)
        try:
            spec = ClusterSpec.load(c)
        except (ValueError, FileNotFoundError) as exc:
            ap.error(str(exc))
        if ClusterSpec.load(preset.cluster).backend != "nccl":
            ap.error(f"preset {p!r} on cluster {c!r}: the simulator models GPU clusters (nccl); "
                     f"CPU presets train for real with scripts/pretrain_gpt.py --preset {p} --lagom (README)")
        if spec.backend != "nccl":
            ap.error(f"cluster {c!r} is a CPU (gloo) cluster; the simulator models GPU clusters: {', '.join(gpu_clusters())}")
        try:
            verify_counts(preset, args.verify_iters, args.verify_max_iters)
        except ValueError as exc:
            ap.error(f"--verify-max-iters for preset {p!r}: {exc}")
    return list(dict.fromkeys(rows))


def gpu_clusters() -> list[str]:
    """The shipped clusters of backend nccl (those the simulator models)."""
    from lagom_megatron.engine.cluster import ClusterSpec, available_clusters

    return [n for n in available_clusters() if ClusterSpec.load(n).backend == "nccl"]


def _one(job: tuple) -> list[dict[str, Any]]:
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.sim.backend import verify_counts
    from lagom_megatron.sim.bench_row import run_row

    preset, cluster, mb, seeds, iters, verify_iters, verify_max_iters = job
    logging.getLogger("lagom.tuner").setLevel(logging.ERROR)
    vi, cap = verify_counts(load_preset(preset), verify_iters, verify_max_iters)
    return run_row(preset, cluster, seeds=seeds, iters=iters, microbatches=mb, verify_iters=vi, verify_max_iters=cap)


def _run(args: argparse.Namespace, pairs: list[tuple[str, str, int | None]], out: Path) -> int:
    t0 = time.perf_counter()
    jobs = [(p, c, m, list(args.seeds), args.iters, args.verify_iters, args.verify_max_iters) for p, c, m in pairs]
    rows: list[dict[str, Any]] = []

    def report(got: list[dict[str, Any]]) -> None:
        rows.extend(got)
        r = got[0]
        print(f"  {r['preset']:24s} {r['cluster']:16s} {r['microbatches']:3d} mb  bound x{r['free_comm_bound']:.3f}  "
              f"oracle x{min(x['oracle'] for x in got):.3f}-{max(x['oracle'] for x in got):.3f}  "
              f"kept x{min(x['default_ms'] / x['lagom_kept_ms'] for x in got):.3f}-"
              f"{max(x['default_ms'] / x['lagom_kept_ms'] for x in got):.3f}  {sum(x['wall_s'] for x in got):.0f} s", flush=True)

    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(args.jobs, len(jobs))) as pool:
            for got in pool.imap(_one, jobs):
                report(got)
    else:
        for job in jobs:
            report(_one(job))
    write_csv(rows, out / "simulated.csv", COLUMNS)
    write_csv(rows, out / "simulated_details.csv", DETAIL_COLUMNS)
    if not args.no_plot:
        plot(rows, out / "simulated.png", PAPER_VS_NCCL)
    failures = print_table(rows, must_show, PAPER_VS_NCCL, PAPER_VS_AUTOCCL)
    print(f"\nwrote {out / 'simulated.csv'}" + ("" if args.no_plot else f" and {out / 'simulated.png'}") +
          f" in {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0
