"""``lagom search``: fit the cost model on a profile and search a plan.

    lagom search --profile profile.json [--cluster h100-sxm-ib400] [--method priority] [--verbose] -o plan.json
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="profile JSON written by the warm-up profiler or the simulator")
    parser.add_argument("--cluster", default=None, help="cluster name under configs/clusters or a YAML path (default: the profile's)")
    parser.add_argument("--method", default="priority", help="priority (default), autoccl, exhaustive or nccl-default")
    parser.add_argument("--mechanism", default=None, help="how the plan is applied: tuner, communicator, env (NCCL) or gloo")
    parser.add_argument("-o", "--output", required=True, help="plan JSON to write (atomically)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the cost model's fit summary: MAPE, its floor on these samples, time-weighted error")


def run(args: argparse.Namespace) -> int:
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.engine.fit import fit_cost_model
    from lagom_megatron.engine.profile import Profile
    from lagom_megatron.engine.search import METHODS, search
    from lagom_megatron.megatron.backends import rules_for

    if args.method not in METHODS:
        raise ValueError(f"--method must be one of {list(METHODS)}; got {args.method!r}")
    profile = Profile.load(args.profile)
    cluster = ClusterSpec.load(args.cluster or profile.cluster)
    model = fit_cost_model(profile, cluster)
    if args.verbose:
        print(model.fit_summary())
    rules = rules_for(profile.backend, cluster, args.mechanism)
    result = search(profile, rules=rules, method=args.method, model=model)
    result.plan.save(args.output)
    s = result.stats
    print(f"{args.method}: {s['n_sites']} sites, {s['model_evaluations']:,} model evaluations, {s['wall_time_s']:.3f} s; "
          f"cost model MAPE {s['model_mape_pct']}% (floor on these samples {s['model_mape_floor_pct']}%)")
    print(f"predicted iteration {s['predicted_iteration_us']:.1f} us vs NCCL defaults {s['default_iteration_us']:.1f} us "
          f"(x{s['predicted_speedup']}); plan written to {args.output}")
    return 0
