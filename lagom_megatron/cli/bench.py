"""``lagom bench search | simulated``: search scaling and optimality; the simulated-cluster comparison table."""

from __future__ import annotations

import argparse

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
    from lagom_megatron.cli.main import LagomParser
    from lagom_megatron.sim.bench.table import main

    return int(main(args.bench_args, parser_class=LagomParser) or 0)


def search_main(argv: list[str] | None = None) -> int:
    """``lagom bench search``: ``engine.bench``'s scaling and optimality tables on synthetic NCCL problems.

    Returns 0 when 10,000 sites take < 2 s and priority is within 1% of exhaustive on >= 95% of instances, else 1;
    2 for a bad option or ``--cluster``.
    """
    from lagom_megatron.cli.main import LagomParser  # one-line usage errors, as every lagom command
    from lagom_megatron.cli.options import int_range
    from lagom_megatron.engine.bench import optimality, scaling_table
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.nccl.rules import NcclRules

    parser = LagomParser(prog="lagom bench search",
                         description="Search cost and quality on seeded synthetic problems.")
    parser.add_argument("--sizes", type=int_range(1, MAX_SITES), nargs="+", default=[10, 100, 1000, 10000],
                        help=f"site counts to time (1..{MAX_SITES:,})")
    parser.add_argument("--instances", type=int_range(1), default=200, help="small instances compared with exhaustive")
    parser.add_argument("--seed", type=int_range(0), default=0)
    parser.add_argument("--cluster", default="h100-sxm-ib400")
    try:
        args = parser.parse_args(argv)
        try:
            rules = NcclRules(ClusterSpec.load(args.cluster))
        except (ValueError, FileNotFoundError) as exc:  # unknown, malformed, or a gloo cluster
            parser.error(str(exc))
    except SystemExit as exc:  # --help (0), or a usage error already printed on one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    print(f"search scaling on {args.cluster} (seed {args.seed})")
    print(f"{'sites':>7} {'method':>9} {'model evals':>12} {'evals/site':>10} {'wall s':>8} {'pred. speedup':>13}")
    rows = scaling_table(args.sizes, seed=args.seed, rules=rules)
    for r in rows:
        print(f"{r['sites']:>7} {r['method']:>9} {r['evaluations']:>12,} {r['evaluations'] / r['sites']:>10.1f} "
              f"{r['wall_s']:>8.3f} {r['speedup']:>13.4f}")
    opt = optimality(instances=args.instances, seed=args.seed + 1, rules=rules)
    print(f"\npriority vs exhaustive on {opt['instances']} seeded instances of 2-3 sites:")
    print(f"  within 1% of the optimum: {opt['within']}/{opt['instances']} = {100 * opt['share']:.1f}%  "
          f"(mean gap {100 * opt['mean_gap']:.3f}%, worst {100 * opt['worst_gap']:.2f}%, least {100 * opt['least_gap']:.3f}%)")
    big = [r for r in rows if r["method"] == "priority" and r["sites"] == max(args.sizes)]
    ok_time = all(r["wall_s"] < 2.0 for r in big) if max(args.sizes) >= 10000 else True
    ok_opt = opt["share"] >= 0.95
    print(f"\ntargets: {max(args.sizes):,} sites < 2 s: {'met' if ok_time else 'NOT met'}; "
          f">= 95% within 1%: {'met' if ok_opt else 'NOT met'}")
    return 0 if ok_time and ok_opt else 1
