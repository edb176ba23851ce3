"""``lagom bench search | simulated``: search scaling and optimality; the simulated-cluster comparison table."""

from __future__ import annotations

import argparse
from pathlib import Path

MAX_SITES = 100_000
"""Largest ``--sizes`` value (10x the 10,000-site target); arrays grow per site, 1e11 sites would need 745 GiB."""

BENCHMARKS = {
    "search": "search time and evaluations vs sites; priority vs exhaustive",
    "simulated": "iteration time under each method on simulated GPU clusters",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), help="which benchmark to run")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def run(args: argparse.Namespace) -> int:
    if args.benchmark == "search":
        return search_main(args.bench_args)
    return simulated_main(args.bench_args)


def search_main(argv: list[str] | None = None) -> int:
    """``lagom bench search``: ``engine.bench``'s tables; 0 when 10,000 sites take < 2 s and priority is within 1% of
    exhaustive on >= 95% of instances, else 1; 2 for a bad option or ``--cluster``."""
    from lagom_megatron.cli.main import LagomParser
    from lagom_megatron.cli.options import int_range
    from lagom_megatron.engine.bench import optimality, scaling_table
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.nccl.rules import NcclRules

    parser = LagomParser(prog="lagom bench search", description="Search cost and quality on seeded synthetic problems.")
    parser.add_argument(
        "--sizes",
        type=int_range(1, MAX_SITES),
        nargs="+",
        default=[10, 100, 1000, 10000],
        help=f"site counts to time (1..{MAX_SITES:,})",
    )
    parser.add_argument("--instances", type=int_range(1), default=200, help="small instances compared with exhaustive")
    parser.add_argument("--seed", type=int_range(0), default=0)
    parser.add_argument("--cluster", default="h100-sxm-ib400")
    try:
        args = parser.parse_args(argv)
        try:
            rules = NcclRules(ClusterSpec.load(args.cluster))
        except (ValueError, FileNotFoundError) as exc:
            parser.error(str(exc))
    except SystemExit as exc:  # --help (0), or a usage error already printed on one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    print(f"search scaling on {args.cluster} (seed {args.seed})")
    print(f"{'sites':>7} {'method':>9} {'model evals':>12} {'evals/site':>10} {'wall s':>8} {'pred. speedup':>13}")
    rows = scaling_table(args.sizes, seed=args.seed, rules=rules)
    for r in rows:
        print(
            f"{r['sites']:>7} {r['method']:>9} {r['evaluations']:>12,} {r['evaluations'] / r['sites']:>10.1f} "
            f"{r['wall_s']:>8.3f} {r['speedup']:>13.4f}"
        )
    opt = optimality(instances=args.instances, seed=args.seed + 1, rules=rules)
    print(f"\npriority vs exhaustive on {opt['instances']} seeded instances of 2-3 sites:")
    print(
        f"  within 1% of the optimum: {opt['within']}/{opt['instances']} = {100 * opt['share']:.1f}%  "
        f"(mean gap {100 * opt['mean_gap']:.3f}%, worst {100 * opt['worst_gap']:.2f}%, least {100 * opt['least_gap']:.3f}%)"
    )
    big = [r for r in rows if r["method"] == "priority" and r["sites"] == max(args.sizes)]
    ok_time = all(r["wall_s"] < 2.0 for r in big) if max(args.sizes) >= 10000 else True
    ok_opt = opt["share"] >= 0.95
    print(
        f"\ntargets: {max(args.sizes):,} sites < 2 s: {'met' if ok_time else 'NOT met'}; "
        f">= 95% within 1%: {'met' if ok_opt else 'NOT met'}"
    )
    return 0 if ok_time and ok_opt else 1


def simulated_main(argv: list[str] | None = None) -> int:
    """``lagom bench simulated``: ``sim.bench.table``'s comparison or ``--sensitivity`` table; 1 when a row breaks
    ``must_show``, else 0; SystemExit(2) for a bad option, preset, cluster or ``--out``."""
    import logging
    import os

    from lagom_megatron.cli.main import LagomParser
    from lagom_megatron.cli.options import int_range
    from lagom_megatron.preflight.files import output_folder_problem
    from lagom_megatron.sim.bench.table import SEEDS, run_sensitivity, run_table, select_rows
    from lagom_megatron.sim.constants import CONSTANTS

    ap = LagomParser(
        prog="lagom bench simulated",
        description="lagom bench simulated: the paper-style comparison table on simulated clusters.",
    )
    ap.add_argument("--out", default="bench_out", help="output folder for simulated.csv and simulated.png")
    ap.add_argument("--presets", nargs="+", default=None, help="presets (default: the table's rows)")
    ap.add_argument(
        "--clusters", nargs="+", default=None, help="clusters each preset runs on (default: the table's rows)"
    )
    ap.add_argument("--seeds", type=int_range(0), nargs="+", default=list(SEEDS), help="noise seeds (default 0-4)")
    ap.add_argument("--iters", type=int_range(1), default=5, help="simulated iterations per median")
    ap.add_argument(
        "--verify-iters",
        type=int_range(1),
        default=None,
        help="lagom's verification iterations per arm at its first look (default: each preset's "
        "lagom_verify_iters; given alone, also the cap)",
    )
    ap.add_argument(
        "--verify-max-iters",
        type=int_range(1),
        default=None,
        help="the most verification iterations per arm while the verdict is undecided (default: each "
        "preset's lagom_verify_max_iters, or --verify-iters when that is given)",
    )
    ap.add_argument(
        "--microbatches",
        nargs="+",
        default=None,
        help="micro-batches per DP rank for --presets / --clusters rows: 'preset' and/or integers >= 1 "
        "(default: the table's rows, or 2)",
    )
    ap.add_argument("--jobs", type=int_range(1), default=1, help="rows simulated in parallel processes")
    ap.add_argument(
        "--sensitivity",
        action="store_true",
        help="run the sensitivity (tornado) table of the ranged constants instead (sim.bench.table)",
    )
    ap.add_argument(
        "--constants",
        nargs="+",
        default=None,
        help="with --sensitivity: only these ranged constants (default: all of sim.constants)",
    )
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    unknown = [c for c in args.constants or [] if c not in CONSTANTS]
    if unknown:
        ap.error(f"--constants: unknown {unknown}; the ranged constants are {sorted(CONSTANTS)}")
    if args.constants and not args.sensitivity:
        ap.error("--constants needs --sensitivity")
    microbatches = []
    for m in args.microbatches or []:
        try:
            microbatches.append(_microbatches(m))
        except ValueError as exc:
            ap.error(str(exc))
    try:
        rows = select_rows(args.presets, args.clusters, microbatches, args.verify_iters, args.verify_max_iters)
    except (ValueError, FileNotFoundError) as exc:
        ap.error(str(exc))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out {str(out)!r} is a file; give a folder")
    problem = output_folder_problem(
        out, allowed=_not_a_bench_file_or_ours, advice="lagom bench writes beside other files, never over them"
    )
    if problem:
        ap.error(f"--out {problem}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {str(out)!r} cannot be created: {exc.strerror or exc}")
    if not os.access(out, os.W_OK):
        ap.error(f"--out {str(out)!r} is not writable")
    verify = {"verify_iters": args.verify_iters, "verify_max_iters": args.verify_max_iters}
    tuner_log = logging.getLogger("lagom.tuner")
    level = tuner_log.level
    tuner_log.setLevel(logging.ERROR)  # fall-backs are columns of the table
    try:
        if args.sensitivity:
            return run_sensitivity(
                out,
                presets=args.presets,
                clusters=args.clusters,
                microbatches=microbatches,
                constants=args.constants,
                **verify,
            )
        return run_table(
            rows, out, seeds=list(args.seeds), iters=args.iters, jobs=args.jobs, plot_png=not args.no_plot, **verify
        )
    finally:
        tuner_log.setLevel(level)


BENCH_FILES = {"simulated.csv": "preset,", "simulated_details.csv": "preset,", "sensitivity.csv": "constant,"}
"""The tables ``lagom bench simulated`` writes and how each begins (its header); ``simulated.png`` goes with the first."""


def _not_a_bench_file_or_ours(path: Path) -> bool:
    """True unless ``path`` has a name the bench writes and is not an earlier bench output (a table with the bench's
    header; the figure only beside such a ``simulated.csv``)."""
    from lagom_megatron.preflight.files import first_line_is

    if path.name == "simulated.png":
        return path.is_file() and first_line_is(BENCH_FILES["simulated.csv"])(path.parent / "simulated.csv")
    header = BENCH_FILES.get(path.name)
    return header is None or first_line_is(header)(path)


def _microbatches(text: str) -> int | None:
    if text == "preset":
        return None
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"--microbatches must be 'preset' or an integer >= 1; got {text!r}") from None
    if v < 1:
        raise ValueError(f"--microbatches must be 'preset' or an integer >= 1; got {v}")
    return v
