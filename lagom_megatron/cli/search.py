"""``lagom search``: fit the cost model on a profile and search a plan; every input is checked before the fit."""

from __future__ import annotations

import argparse

from lagom_megatron.cli.options import (
    FORCE_HELP,
    is_plan_text,
    readable_file,
    refuse_large_exhaustive,
    refuse_overwriting_an_input,
    refuse_replacing,
    writable_file,
)
from lagom_megatron.engine.search import METHODS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        required=True,
        type=readable_file,
        help="profile JSON written by the warm-up profiler or the simulator",
    )
    parser.add_argument(
        "--cluster", default=None, help="cluster name under configs/clusters or a YAML path (default: the profile's)"
    )
    parser.add_argument("--method", default="priority", choices=list(METHODS), help="searcher (default: priority)")
    parser.add_argument(
        "--mechanism", default=None, help="how the plan is applied: tuner, communicator, env (NCCL) or gloo"
    )
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        type=writable_file,
        help="plan JSON to write (atomically); an existing file that is not a plan is kept unless --force",
    )
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print the cost model's fit summary: MAPE, its floor on these samples, time-weighted error",
    )


def check_inputs(args: argparse.Namespace):
    """Loads and checks (profile, cluster, rules), nothing fitted; ValueError: a refused ``-o`` or any bad input."""
    from lagom_megatron.config.plan_files import load_profile
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.megatron.pool.comm_pool import rules_for

    refuse_overwriting_an_input(args.output, "-o", {"--profile": args.profile})
    refuse_replacing(args.output, "-o", "a lagom plan", is_plan_text, force=args.force)
    profile = load_profile(args.profile, "lagom search --profile")
    cluster = ClusterSpec.load(args.cluster or profile.cluster)
    want = "gloo" if profile.backend == "gloo" else "nccl"
    if (cluster.backend == "gloo") != (want == "gloo"):
        raise ValueError(
            f"--cluster {cluster.name!r} is a {cluster.backend} cluster; profile {args.profile} was "
            f"measured on {profile.backend}: give a {want} cluster"
        )
    if args.cluster:
        refuse_another_cluster(cluster, profile, args.profile)
    rules = rules_for(profile.backend, cluster, args.mechanism)
    ops = {s.site_id: s for s in profile.sites}
    for smp in profile.samples:
        site = ops[smp.site_id]
        try:
            rules.validate(smp.config, op=site.op, n_nodes=site.n_nodes, group_size=site.group_size)
        except ValueError as exc:
            raise ValueError(
                f"{args.profile}: sample of site {smp.site_id!r} (iteration {smp.iteration}): {exc}"
            ) from None
    return profile, cluster, rules


SAME_HARDWARE = (
    "backend",
    "gpu",
    "gpus_per_node",
    "nccl_version",
    "sm_arch",
    "nvswitch",
    "intra_link",
    "collnet",
    "nvlink_domain_gpus",
)
"""Keys a differently named ``--cluster`` must share with the profile's (bandwidths and latencies may differ)."""


def refuse_another_cluster(cluster, profile, profile_path: str) -> None:
    """ValueError for a ``--cluster`` differing from the profile's (if known) in a ``SAME_HARDWARE`` key."""
    from lagom_megatron.engine.cluster import ClusterSpec

    if cluster.name == profile.cluster:
        return
    try:
        measured = ClusterSpec.load(profile.cluster)
    except FileNotFoundError:
        return
    for key in SAME_HARDWARE:
        mine, theirs = getattr(cluster, key), getattr(measured, key)
        if mine != theirs:
            raise ValueError(
                f"--cluster {cluster.name!r} is not the cluster profile {profile_path} was measured on "
                f"({profile.cluster!r}: {key} {theirs!r}, not {mine!r}); a plan is searched from a profile "
                f"of its own cluster: drop --cluster, or profile {cluster.name!r}"
            )


def run(args: argparse.Namespace) -> int:
    from lagom_megatron.engine.fit import fit_cost_model
    from lagom_megatron.engine.search import search

    profile, cluster, rules = check_inputs(args)
    if args.method == "exhaustive":
        refuse_large_exhaustive(profile.sites, rules.for_sites(profile.sites))
    model = fit_cost_model(profile, cluster)
    if args.verbose:
        print(model.fit_summary())
    result = search(profile, rules=rules, method=args.method, model=model)
    result.plan.save(args.output)
    s = result.stats
    base = "defaults (gloo: 2 worker threads, no split)" if profile.backend == "gloo" else "NCCL defaults"
    print(
        f"{args.method}: {s['n_sites']} sites, {s['model_evaluations']:,} model evaluations, {s['wall_time_s']:.3f} s; "
        f"cost model MAPE {s['model_mape_pct']}% (floor on these samples {s['model_mape_floor_pct']}%)"
    )
    print(
        f"predicted iteration {s['predicted_iteration_us'] / 1e3:.1f} ms vs {base} {s['default_iteration_us'] / 1e3:.1f} ms "
        f"(x{s['predicted_speedup']}); plan written to {args.output} (never verified: a training run measures it first)"
    )
    return 0
