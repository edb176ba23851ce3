"""lagom's ``--lagom*`` flags (for ``pretrain_gpt.py`` and the Megatron-LM patches) and their rule. No torch."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from lagom_megatron.engine.search import LAGOM_METHODS
from lagom_megatron.engine.tuner import (
    DEFAULT_CONFIG,
    MAX_VERIFY_ITERS,
    MAX_VERIFY_MAX_ITERS,
    MAX_WARMUP_ITERS,
    MIN_ITERS,
)
from lagom_megatron.megatron.pool.comm_pool import DEFAULT_BUDGET_MIB
from lagom_megatron.preflight.types import Finding, RunShape

LAGOM_FLAGS: frozenset[str] = frozenset(
    {
        "--lagom",
        "--lagom-warmup-iters",
        "--lagom-verify-iters",
        "--lagom-verify-max-iters",
        "--lagom-plan",
        "--lagom-method",
        "--lagom-report",
        "--lagom-pool-budget-mib",
        "--lagom-allow-untested-versions",
        "--lagom-cluster",
    }
)


def add_lagom_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the :data:`LAGOM_FLAGS` (usable as Megatron-LM's ``extra_args_provider``); returns the parser."""
    g = parser.add_argument_group("lagom")
    g.add_argument(
        "--lagom",
        action="store_true",
        help="Profile overlapped collectives during warm-up, search and apply per-collective configs.",
    )
    g.add_argument(
        "--lagom-warmup-iters",
        type=int,
        default=DEFAULT_CONFIG.warmup_iters,
        help="Untimed iterations under defaults before profiling; profiling then takes one "
        "default, one serialized and one iteration per probe config.",
    )
    g.add_argument(
        "--lagom-verify-iters",
        type=int,
        default=DEFAULT_CONFIG.verify_iters,
        help="Measured iterations per arm (plan, defaults; alternating) before the plan is kept or dropped.",
    )
    g.add_argument(
        "--lagom-verify-max-iters",
        type=int,
        default=DEFAULT_CONFIG.verify_max_iters,
        help="Most measured iterations per arm: an undecided verdict doubles the iterations per arm up to "
        "this (default: --lagom-verify-iters, one verdict); the false-accept rate stays 5%%.",
    )
    g.add_argument(
        "--lagom-plan",
        default=None,
        help="Plan file: reused when it exists and its fingerprint matches (applied if verified, "
        "verified first if never verified, skipped if rejected); written after the search otherwise.",
    )
    g.add_argument(
        "--lagom-method",
        choices=LAGOM_METHODS,
        default=DEFAULT_CONFIG.method,
        help="Searcher: priority (Lagom), autoccl (each collective for its own speed), nccl-default.",
    )
    g.add_argument(
        "--lagom-report",
        default=None,
        help="Per-site report (.md, .csv or .json, by suffix) and a PNG beside it; "
        "default report.md in the plan's folder.",
    )
    g.add_argument(
        "--lagom-pool-budget-mib",
        type=float,
        default=float(DEFAULT_BUDGET_MIB),
        help="Bound on the estimated GPU memory (MiB per rank) of lagom's extra communicators; "
        "sites whose communicators would pass it keep NCCL's defaults.",
    )
    g.add_argument(
        "--lagom-cluster",
        default=None,
        metavar="NAME|PATH",
        help="The cluster this run is checked against and lagom's cost model starts from "
        "(configs/clusters/ name or YAML path); default $LAGOM_CLUSTER, else the preset's "
        "cluster, else this machine. A cluster this machine does not match is refused: "
        "--lagom-cluster cpu-gloo runs a GPU preset on CPU anyway.",
    )
    g.add_argument(
        "--lagom-allow-untested-versions",
        action="store_true",
        help="Run even when torch or megatron-core is outside the tested ranges "
        "(lagom_megatron.megatron.hooks.versions; also LAGOM_ALLOW_UNTESTED_VERSIONS=1).",
    )
    return parser


LAGOM_ONLY_FLAGS = (
    "--lagom-warmup-iters",
    "--lagom-verify-iters",
    "--lagom-verify-max-iters",
    "--lagom-plan",
    "--lagom-method",
    "--lagom-report",
    "--lagom-pool-budget-mib",
)
"""Options only the ``--lagom`` controller reads (not ``--lagom-allow-untested-versions``, ``--lagom-cluster``)."""


def lagom_value_problems(args: Mapping[str, Any]) -> list[Finding]:
    """``lagom-flags`` errors: a ``--lagom-*-iters`` outside MIN_ITERS..MAX_*, a verify cap below the verify iters."""
    out = []
    for flag, hi, why in (
        ("--lagom-warmup-iters", MAX_WARMUP_ITERS, "untimed iterations before profiling starts"),
        (
            "--lagom-verify-iters",
            MAX_VERIFY_ITERS,
            "measured iterations per arm (plan, defaults) before the verdict; the run needs twice as many",
        ),
        (
            "--lagom-verify-max-iters",
            MAX_VERIFY_MAX_ITERS,
            "the most measured iterations per arm while the verdict is undecided",
        ),
    ):
        value = args.get(flag[2:].replace("-", "_"))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not MIN_ITERS <= value <= hi:
            out.append(
                Finding(
                    "error",
                    "lagom-flags",
                    f"{flag} {value} is out of range; allowed: an integer in {MIN_ITERS}..{hi}",
                    f"{flag} counts {why}",
                    f"give {flag} a value in {MIN_ITERS}..{hi}",
                )
            )
    first, cap = args.get("lagom_verify_iters"), args.get("lagom_verify_max_iters")
    if not out and isinstance(cap, int) and isinstance(first, int) and cap < first:
        out.append(
            Finding(
                "error",
                "lagom-flags",
                f"--lagom-verify-max-iters {cap} is below --lagom-verify-iters "
                f"{first}; allowed: an integer in {first}..{MAX_VERIFY_MAX_ITERS}",
                "the cap bounds the iterations per arm that --lagom-verify-iters starts with",
                f"raise --lagom-verify-max-iters to {first} or more, or drop it",
            )
        )
    return out


def lagom_flag_problems(args: Mapping[str, Any]) -> list[Finding]:
    """An error per LAGOM_ONLY_FLAGS flag off its default without ``--lagom``; with it, :func:`lagom_value_problems`."""
    if args.get("lagom"):
        return lagom_value_problems(args)
    defaults = add_lagom_args(argparse.ArgumentParser(add_help=False))
    out = []
    for flag in LAGOM_ONLY_FLAGS:
        dest = flag[2:].replace("-", "_")
        default = defaults.get_default(dest)
        value = args.get(dest, default)
        if value is not None and value != default:
            out.append(
                Finding(
                    "error",
                    "lagom-flags",
                    f"{flag} needs --lagom (or drop {flag})",
                    f"without --lagom no hook is installed and {flag} {value!r} would be ignored",
                    f"add --lagom, or drop {flag}",
                )
            )
    return out


def rule_lagom_flags(s: RunShape) -> list[Finding]:
    return lagom_flag_problems(s.args)


def tuning_iterations(args: Mapping[str, Any], cluster: Any) -> tuple[int, int, int, int] | None:
    """(probes, iterations to the search, to the first verdict, to the last) of a ``--lagom`` run on ``cluster``, as
    its ``engine.tuner.Tuner`` counts them (no capabilities yet: the cluster's probes); None without a ClusterSpec."""
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.engine.tuner import Tuner, TunerConfig
    from lagom_megatron.megatron.pool.comm_pool import rules_for

    if not isinstance(cluster, ClusterSpec):
        return None
    counts = {
        key: args.get(f"lagom_{key}") if args.get(f"lagom_{key}") is not None else getattr(DEFAULT_CONFIG, key)
        for key in ("warmup_iters", "verify_iters", "verify_max_iters")
    }
    try:
        tuner = Tuner(TunerConfig(**counts), rules=rules_for(cluster.backend, cluster))
    except (TypeError, ValueError):  # a bad count: lagom_value_problems names it
        return None
    looks = tuner.verify_looks
    return len(tuner.probes), tuner.profiling_iters, tuner.total_iters - 2 * (looks[-1] - looks[0]), tuner.total_iters


def rule_tuning_iterations(s: RunShape) -> list[Finding]:
    """A ``--lagom`` run whose ``--train-iters`` ends before the plan is searched (none is saved) or verified (it is
    saved never verified). A plan file that exists may be reused, which needs fewer: not judged here."""
    from pathlib import Path

    train_iters = s.args.get("train_iters")
    plan = s.args.get("lagom_plan")
    if not s.args.get("lagom") or not isinstance(train_iters, int) or (plan and Path(str(plan)).is_file()):
        return []
    counts = tuning_iterations(s.args, s.cluster)
    if counts is None:
        return []
    probes, searched, verified, _ = counts
    if train_iters >= verified:
        return []
    warmup = searched - 2 - probes
    profile = f"{searched} to profile: {warmup} warm-up, 1 at the defaults, 1 serialized, {probes} probe(s)"
    first = (verified - searched - 1) // 2
    if train_iters < searched:
        what = (
            f"--train-iters {train_iters} ends before lagom's profiling does: no plan will be searched or saved "
            f"(lagom needs {profile}; {verified} for a verified plan)"
        )
        fix = f"give --train-iters {verified} or more (fewer --lagom-warmup-iters lower it), or drop --lagom"
    else:
        what = (
            f"--train-iters {train_iters} ends before lagom's verification does: the plan is searched after "
            f"{searched} iterations and saved never verified (a later run measures it before applying it); a "
            f"verdict needs {verified} ({profile}; then 1 + 2 x {first} to verify)"
        )
        fix = f"give --train-iters {verified} or more (fewer --lagom-verify-iters lower it)"
    return [
        Finding(
            "warning",
            "lagom-iterations",
            what,
            "lagom profiles, searches, then alternates plan and defaults (engine.tuner); the run's last iteration "
            "ends it wherever it is",
            fix,
        )
    ]
