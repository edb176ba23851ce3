"""``lagom plan show | diff | validate | export``: inspect, compare, check and convert plan files.

    lagom plan show plan.json
    lagom plan diff old.json new.json           # exit 1 when they differ
    lagom plan validate plan.json [--cluster C] [--profile P]   # exit 1 on a fingerprint mismatch
    lagom plan export plan.json --format megatron-yaml|nccl-tuner-csv|env [--extended] [-o FILE]
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", metavar="ACTION", required=True)
    p = sub.add_parser("show", help="print a plan: fingerprint, statistics, env and one line per site")
    p.add_argument("plan")
    p = sub.add_parser("diff", help="differences between two plans (exit 1 when they differ)")
    p.add_argument("first")
    p.add_argument("second")
    p = sub.add_parser("validate", help="check every config against NCCL's rules and the fingerprint")
    p.add_argument("plan")
    p.add_argument("--cluster", default=None, help="cluster to check against (default: the plan's fingerprint)")
    p.add_argument("--profile", default=None, help="a profile whose fingerprint the plan must match")
    p = sub.add_parser("export", help="write the plan in a format NCCL or Megatron-LM reads")
    p.add_argument("plan")
    p.add_argument("--format", required=True, help="megatron-yaml, nccl-tuner-csv or env")
    p.add_argument("--extended", action="store_true", help="nccl-tuner-csv: add lagom's chunkSize and commTag columns")
    p.add_argument("-o", "--output", default=None, help="file to write (atomically); default: standard output")


def run(args: argparse.Namespace) -> int:
    from lagom_megatron.engine.plan import Plan

    if args.plan_command == "show":
        return _show(Plan.load(args.plan))
    if args.plan_command == "diff":
        from lagom_megatron.engine.plan import diff_plans

        lines = diff_plans(Plan.load(args.first), Plan.load(args.second))
        print("\n".join(lines) if lines else "plans are identical")
        return 1 if lines else 0
    if args.plan_command == "validate":
        return _validate(args, Plan.load(args.plan))
    return _export(args, Plan.load(args.plan))


def _show(plan) -> int:
    print(f"method {plan.method}, backend {plan.backend}, mechanism {plan.mechanism}, digest {plan.digest()[:16]}")
    print("fingerprint: " + json.dumps(plan.fingerprint, sort_keys=True))
    print("stats: " + json.dumps(plan.stats, sort_keys=True))
    print("env: " + (" ".join(f"{k}={v}" for k, v in sorted(plan.env.items())) or "(none)"))
    print(f"{'site':<44} {'group':<6} {'op':<15} {'bytes':>11} {'default us':>11} {'planned us':>11}  config")
    for site_id, e in plan.entries.items():
        cfg = ", ".join(f"{k}={v}" for k, v in e.config.to_dict().items()) or "NCCL default"
        print(f"{site_id:<44} {e.group:<6} {e.op:<15} {e.nbytes:>11} {e.predicted_default_t_region_us:>11.1f} "
              f"{e.predicted_t_region_us:>11.1f}  {cfg}")
    return 0


def _validate(args, plan) -> int:
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.nccl.env_vars import validate_env

    cluster_name = args.cluster or plan.fingerprint.get("cluster")
    if not cluster_name:
        raise ValueError(f"{args.plan}: the plan's fingerprint names no cluster; pass --cluster")
    cluster = ClusterSpec.load(cluster_name)
    if plan.backend == "gloo" and cluster.backend != "gloo":
        raise ValueError(f"{args.plan}: a gloo plan cannot be checked against NCCL cluster {cluster.name!r}")
    _check_entries(args.plan, plan, cluster)
    validate_env(plan.env)
    _warn_if_rejected(args.plan, plan)
    if args.profile:
        from lagom_megatron.engine.plan import shown
        from lagom_megatron.engine.profile import Profile

        expected = dict(Profile.load(args.profile).fingerprint)
        diff = plan.fingerprint_mismatch(expected)
        if diff:
            for k in diff:
                print(f"fingerprint mismatch: {k}: plan {shown(plan.fingerprint, k)}, profile {shown(expected, k)}",
                      file=sys.stderr)
            return 1
    print(f"{args.plan}: valid ({len(plan.entries)} entries, cluster {cluster.name}, NCCL {cluster.nccl_version})")
    return 0


def _check_entries(name, plan, cluster) -> None:
    """Every entry's config against the knob rules of ``cluster``'s backend under the plan's mechanism
    (NCCL's documented domains, or gloo's).

    Raises:
        ValueError: the first bad entry, naming the file, the site id and the knob; or a mechanism
            the cluster's backend does not have.
    """
    from lagom_megatron.megatron.backends import rules_for

    rules = rules_for(cluster.backend, cluster, plan.mechanism)
    for site_id, e in plan.entries.items():
        try:
            rules.validate(e.config, op=e.op, n_nodes=e.n_nodes, group_size=e.group_size or None)
        except ValueError as exc:
            raise ValueError(f"{name}: entry {site_id!r}: {exc}") from None


def _warn_if_rejected(name, plan) -> None:
    """One stderr line when the plan's own verification rejected it (measured no better than the defaults)."""
    if plan.rejected:
        print(f"warning: {name} was rejected by its verification ({plan.stats.get('verification_reason') or 'no reason saved'}); "
              "a training run reusing it keeps the defaults", file=sys.stderr)


def _export(args, plan) -> int:
    from lagom_megatron.nccl.export import export_plan

    cluster = None
    if plan.fingerprint.get("cluster"):
        from lagom_megatron.engine.cluster import ClusterSpec

        try:
            cluster = ClusterSpec.load(plan.fingerprint["cluster"])
        except FileNotFoundError:
            cluster = None
    if cluster is not None and plan.backend != "gloo":
        _check_entries(args.plan, plan, cluster)  # never export a value NCCL would reject
    _warn_if_rejected(args.plan, plan)
    text = export_plan(plan, args.format, extended=args.extended, cluster=cluster)
    if args.output:
        from lagom_megatron.engine.files import write_text_atomic

        write_text_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0
