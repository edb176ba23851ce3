"""``lagom plan show | diff | validate | export``; exit 1 on differences, a mismatch, or a rejected plan's export."""

from __future__ import annotations

import argparse
import json
import sys

from lagom_megatron.cli.options import (
    FORCE_HELP,
    first_line,
    readable_file,
    refuse_overwriting_an_input,
    refuse_replacing,
    writable_file,
)
from lagom_megatron.nccl.export import FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plan_command", metavar="ACTION", required=True)
    p = sub.add_parser("show", help="print a plan: fingerprint, statistics, env and one line per site")
    p.add_argument("plan", type=readable_file)
    p = sub.add_parser(
        "diff", help="differences between two plans, their verification verdict included (exit 1 when they differ)"
    )
    p.add_argument("first", type=readable_file)
    p.add_argument("second", type=readable_file)
    p = sub.add_parser("validate", help="check every field and config against the backend's rules and the fingerprint")
    p.add_argument("plan", type=readable_file)
    p.add_argument("--cluster", default=None, help="cluster to check against (default: the plan's fingerprint)")
    p.add_argument(
        "--profile", default=None, type=readable_file, help="a profile whose fingerprint the plan must match"
    )
    p = sub.add_parser("export", help="write the plan in a format NCCL or Megatron-LM reads")
    p.add_argument("plan", type=readable_file)
    p.add_argument("--format", required=True, choices=list(FORMATS))
    p.add_argument("--extended", action="store_true", help="nccl-tuner-csv: add lagom's chunkSize and commTag columns")
    p.add_argument(
        "--allow-rejected",
        action="store_true",
        help="export a plan its own verification rejected (by default refused with exit 1)",
    )
    p.add_argument(
        "-o",
        "--output",
        default=None,
        type=writable_file,
        help="file to write (atomically); default: standard output. An existing file that is not lagom's "
        "export in this format is kept unless --force",
    )
    p.add_argument("--force", action="store_true", help=FORCE_HELP)


def run(args: argparse.Namespace) -> int:
    from lagom_megatron.config.plan_files import load_plan

    command = f"lagom plan {args.plan_command}"
    if args.plan_command == "export" and args.extended and args.format != "nccl-tuner-csv":
        raise ValueError(f"--extended is for --format nccl-tuner-csv only; got --format {args.format}")
    if args.plan_command == "export":
        refuse_overwriting_an_input(args.output, "-o", {"plan": args.plan})
    if args.plan_command == "show":
        return _show(load_plan(args.plan, command))
    if args.plan_command == "diff":
        from lagom_megatron.engine.plan import diff_plans

        first, second = load_plan(args.first, command), load_plan(args.second, command)
        lines = diff_plans(first, second)
        va, vb = verification_state(first), verification_state(second)
        if va != vb:
            lines.append(f"verification: {va} -> {vb}")
        print("\n".join(lines) if lines else f"plans are identical (verification: {va})")
        return 1 if lines else 0
    if args.plan_command == "validate":
        return _validate(args, load_plan(args.plan, command))
    return _export(args, load_plan(args.plan, command))


def verification_state(plan) -> str:
    """``never verified``, ``applied`` or ``fell_back (rejected: <reason>)``."""
    state = plan.stats.get("verification")
    if state is None:
        return "never verified"
    reason = plan.stats.get("verification_reason")
    return f"{state}{' (rejected: ' + reason + ')' if state == 'fell_back' and reason else ''}"


def _show(plan) -> int:
    from lagom_megatron.megatron.outputs.report import default_config_text, registration_text

    print(
        f"method {plan.method}, backend {plan.backend}, mechanism {plan.mechanism}, digest {plan.digest()[:12]}, "
        f"verification: {verification_state(plan)}"
    )
    print("fingerprint: " + json.dumps(plan.fingerprint, sort_keys=True))
    print("stats: " + json.dumps(plan.stats, sort_keys=True))
    print("env: " + (" ".join(f"{k}={v}" for k, v in sorted(plan.env.items())) or "(none)"))
    if plan.registered_groups:  # a plan file at rest: no launch has registered them for it yet
        print(registration_text(plan.registered_groups, registered_now=False))
    default = f"default ({default_config_text(plan.backend)})"
    print(f"{'site':<44} {'group':<6} {'op':<15} {'bytes':>11} {'default ms':>11} {'planned ms':>11}  config")
    for site_id, e in plan.entries.items():
        cfg = ", ".join(f"{k}={v}" for k, v in e.config.to_dict().items()) or default
        print(
            f"{site_id:<44} {e.group:<6} {e.op:<15} {e.nbytes:>11} {e.predicted_default_t_region_us / 1e3:>11.3f} "
            f"{e.predicted_t_region_us / 1e3:>11.3f}  {cfg}"
        )
    return 0


def _validate(args, plan) -> int:
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.nccl.env_vars import validate_env

    cluster_name = args.cluster or plan.fingerprint.get("cluster")
    if not cluster_name:
        raise ValueError(f"{args.plan}: the plan's fingerprint names no cluster; pass --cluster")
    cluster = ClusterSpec.load(cluster_name)
    if (plan.backend == "gloo") != (cluster.backend == "gloo"):
        raise ValueError(
            f"{args.plan}: a {plan.backend} plan cannot be checked against {cluster.backend} cluster {cluster.name!r}"
        )
    _check_entries(args.plan, plan, cluster)
    _check_env(args.plan, plan, cluster.nccl_version if cluster.backend != "gloo" else None)
    validate_env(plan.env)
    _warn_if_rejected(args.plan, plan)
    if args.profile:
        from lagom_megatron.config.plan_files import load_profile
        from lagom_megatron.engine.plan import shown

        expected = dict(load_profile(args.profile, "lagom plan validate --profile").fingerprint)
        diff = plan.fingerprint_mismatch(expected)
        if diff:
            for k in diff:
                print(
                    f"fingerprint mismatch: {k}: plan {shown(plan.fingerprint, k)}, profile {shown(expected, k)}",
                    file=sys.stderr,
                )
            return 1
    _note_if_training_will_not_reuse(args.plan, plan)
    version = f"NCCL {cluster.nccl_version}" if cluster.backend != "gloo" else "gloo"
    print(
        f"{args.plan}: valid ({len(plan.entries)} entries, cluster {cluster.name}, {version}; "
        f"verification: {verification_state(plan)})"
    )
    return 0


def _check_entries(name, plan, cluster) -> None:
    from lagom_megatron.megatron.outputs.run_files import entries_problem

    problem = entries_problem(plan, cluster)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")


def _check_env(name, plan, nccl_version: str | None) -> None:
    """ValueError for the first ``env`` entry a launch must not get: any on gloo (it reads no NCCL variable), a
    name that is not NCCL's, or a value the doctor's ``nccl-env`` grammar refuses (``nccl.env_check``)."""
    if plan.backend == "gloo" and plan.env:
        raise ValueError(
            f"{name}: env: {', '.join(sorted(plan.env))}: a gloo plan sets no variable (gloo reads no NCCL_* "
            "variable; its knob is the worker threads of each group); allowed: an empty env"
        )
    for key in plan.env:
        if not key.startswith("NCCL_"):
            raise ValueError(f"{name}: env: {key!r} is not an NCCL variable; allowed: NCCL_* variables only")
    from lagom_megatron.nccl.env_check import check_nccl_env
    from lagom_megatron.nccl.env_network import check_network_env

    for issue in check_nccl_env(plan.env, nccl_version=nccl_version) + check_network_env(plan.env):
        if issue.level == "error":
            raise ValueError(f"{name}: env: {issue.what}; {issue.why}")


def _note_if_training_will_not_reuse(name, plan) -> None:
    """A training run reuses a plan only when its fingerprint matches the run's (``RunFiles.saved_plan``)."""
    from lagom_megatron.megatron.outputs.run_files import RUN_KEYS

    missing = [k for k in RUN_KEYS if plan.fingerprint.get(k) is None]
    if not plan.fingerprint:
        why = "it has no fingerprint"
    elif missing:
        why = f"its fingerprint lacks {', '.join(missing)}, which every run sets"
    elif plan.fingerprint.get("backend") not in ("nccl", "gloo"):
        why = f"its fingerprint's backend is {plan.fingerprint['backend']!r} (a simulated run), not nccl or gloo"
    else:
        return
    print(
        f"note: a training run will not reuse {name}: {why}; given as --lagom-plan, the run moves it aside and "
        "searches a new plan (lagom plan export gives its values to a launch)",
        file=sys.stderr,
    )


def _warn_if_rejected(name, plan) -> None:
    if plan.rejected:
        print(
            f"warning: {name} was rejected by its verification ({plan.stats.get('verification_reason') or 'no reason saved'}); "
            "a training run reusing it keeps the defaults",
            file=sys.stderr,
        )


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
    _check_env(args.plan, plan, cluster.nccl_version if cluster is not None and cluster.backend != "gloo" else None)
    if plan.backend == "gloo" and args.format != "env":
        raise ValueError(
            f"{args.plan}: a gloo plan has no {args.format} form (it sets no NCCL knob); export it with "
            "--format env, or give the plan itself to the training run (--lagom-plan)"
        )
    if args.format == "nccl-tuner-csv" and plan.mechanism != "tuner":
        raise ValueError(
            f"{args.plan}: a plan of mechanism {plan.mechanism!r} has no tuner table"
            + (
                f" (NCCL {cluster.nccl_version} on {cluster.name!r} loads no lagom tuner plugin)"
                if cluster is not None and cluster.backend != "gloo"
                else ""
            )
            + "; export it with --format megatron-yaml or --format env"
        )
    if plan.rejected and not args.allow_rejected:
        print(
            f"lagom plan: {args.plan} was rejected by its verification "
            f"({plan.stats.get('verification_reason') or 'no reason saved'}): not exported; "
            "pass --allow-rejected to export it anyway",
            file=sys.stderr,
        )
        return 1
    _warn_if_rejected(args.plan, plan)
    try:
        text = export_plan(plan, args.format, extended=args.extended, cluster=cluster)
    except ValueError as exc:
        raise ValueError(f"{args.plan}: {exc}") from None
    if args.output:
        from lagom_megatron.engine.files import write_text_atomic

        # the header's part shared by all variants (the tuner table's column count differs)
        header = text.split("\n", 1)[0].split(" (")[0]
        refuse_replacing(args.output, "-o", f"a lagom {args.format} export", first_line(header), force=args.force)
        write_text_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0
