"""lagom's command-line flags (``--lagom*``): their one definition, which ``scripts/pretrain_gpt.py`` and
the patches for a Megatron-LM checkout share, and the pre-flight rule that refuses an option only
``--lagom`` reads when ``--lagom`` is not given (it would be ignored silently otherwise). Two options
are read on every run and so need no ``--lagom``: ``--lagom-allow-untested-versions`` and
``--lagom-cluster`` (:data:`LAGOM_ONLY_FLAGS`).

This module imports neither torch nor Megatron.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from lagom_megatron.engine.search import METHODS
from lagom_megatron.training.preflight_types import Finding, RunShape

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
"""The public ``--lagom*`` surface; ``tests/training/test_args.py`` freezes it."""

LAGOM_METHODS = tuple(m for m in METHODS if m != "exhaustive")
"""Values of ``--lagom-method``: the searchers of ``lagom_megatron.engine.search`` except
``exhaustive``, which is for small offline instances only."""


def add_lagom_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``--lagom*`` flags (the set :data:`LAGOM_FLAGS`).

    This is the single definition used by ``scripts/pretrain_gpt.py`` and by the patches for
    Megatron-LM checkouts (pass it as ``extra_args_provider``).

    Args:
        parser: the parser to extend.

    Returns:
        The same parser.
    """
    g = parser.add_argument_group("lagom")
    g.add_argument("--lagom", action="store_true",
                   help="Profile overlapped collectives during warm-up, search and apply per-collective configs.")
    g.add_argument("--lagom-warmup-iters", type=int, default=4,
                   help="Untimed iterations under defaults before profiling; profiling then takes one "
                        "default, one serialized and one iteration per probe config.")
    g.add_argument("--lagom-verify-iters", type=int, default=4,
                   help="Measured iterations per arm (plan, defaults; alternating) before the plan is kept or dropped.")
    g.add_argument("--lagom-verify-max-iters", type=int, default=None,
                   help="Most measured iterations per arm: an undecided verdict doubles the iterations per arm up to "
                        "this (default: --lagom-verify-iters, one verdict); the false-accept rate stays 5%%.")
    g.add_argument("--lagom-plan", default=None,
                   help="Plan file: reused when it exists and its fingerprint matches (applied if verified, "
                        "verified first if never verified, skipped if rejected); written after the search otherwise.")
    g.add_argument("--lagom-method", choices=LAGOM_METHODS, default="priority",
                   help="Searcher: priority (Lagom), autoccl (each collective for its own speed), nccl-default.")
    g.add_argument("--lagom-report", default=None,
                   help="Per-site report (.md, .csv or .json, by suffix) and a PNG beside it; "
                        "default report.md in the plan's folder.")
    g.add_argument("--lagom-pool-budget-mib", type=float, default=512.0,
                   help="Bound on the estimated GPU memory (MiB per rank) of lagom's extra communicators; "
                        "sites whose communicators would pass it keep NCCL's defaults.")
    g.add_argument("--lagom-cluster", default=None, metavar="NAME|PATH",
                   help="The cluster this run is checked against and lagom's cost model starts from "
                        "(configs/clusters/ name or YAML path); default $LAGOM_CLUSTER, else the preset's "
                        "cluster, else this machine. A cluster this machine does not match is refused: "
                        "--lagom-cluster cpu-gloo runs a GPU preset on CPU anyway.")
    g.add_argument("--lagom-allow-untested-versions", action="store_true",
                   help="Run even when torch or megatron-core is outside the tested ranges "
                        "(lagom_megatron.megatron.versions; also LAGOM_ALLOW_UNTESTED_VERSIONS=1).")
    return parser


LAGOM_ONLY_FLAGS = ("--lagom-warmup-iters", "--lagom-verify-iters", "--lagom-verify-max-iters", "--lagom-plan", "--lagom-method", "--lagom-report",
                    "--lagom-pool-budget-mib")
"""The ``--lagom-*`` options that only the ``--lagom`` controller reads (``megatron.controller.LagomController
.from_args``). ``--lagom-allow-untested-versions`` is not one: ``pretrain_gpt.py`` checks the versions on
every run, nor is ``--lagom-cluster``: the pre-flight checks every run against its cluster."""


MAX_WARMUP_ITERS = 1000
"""Upper bound of ``--lagom-warmup-iters``: untimed iterations before profiling (the first few settle
allocator, communicators and kernels; a thousand more only postpone tuning)."""
MAX_VERIFY_ITERS = 200
"""Upper bound of ``--lagom-verify-iters`` (and of ``lagom simulate --verify-iters``): measured
iterations per arm, plan and defaults alternating, before the verdict."""
MAX_VERIFY_MAX_ITERS = 1000
"""Upper bound of ``--lagom-verify-max-iters``: a gain of 0.3% at 1% iteration noise takes a few hundred
pairs to confirm; beyond a thousand the run spends its first 2000 iterations alternating."""


def lagom_value_problems(args: Mapping[str, Any]) -> list[Finding]:
    """``--lagom-warmup-iters`` outside 1..:data:`MAX_WARMUP_ITERS`, ``--lagom-verify-iters`` outside
    1..:data:`MAX_VERIFY_ITERS` (an unbounded count made the run alternate an unverified plan with the
    defaults to its end and report that tuning needed 2e20 iterations), ``--lagom-verify-max-iters``
    outside 1..:data:`MAX_VERIFY_MAX_ITERS` or below ``--lagom-verify-iters``.

    Returns:
        One ``Finding`` of level error, rule id ``lagom-flags``, per value out of range.
    """
    out = []
    for flag, hi, why in (
            ("--lagom-warmup-iters", MAX_WARMUP_ITERS, "untimed iterations before profiling starts"),
            ("--lagom-verify-iters", MAX_VERIFY_ITERS, "measured iterations per arm (plan, defaults) before the "
                                                       "verdict; the run needs twice as many"),
            ("--lagom-verify-max-iters", MAX_VERIFY_MAX_ITERS, "the most measured iterations per arm while the "
                                                               "verdict is undecided")):
        value = args.get(flag[2:].replace("-", "_"))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
            out.append(Finding("error", "lagom-flags", f"{flag} {value} is out of range; allowed: an integer in 1..{hi}",
                               f"{flag} counts {why}", f"give {flag} a value in 1..{hi}"))
    first, cap = args.get("lagom_verify_iters"), args.get("lagom_verify_max_iters")
    if not out and isinstance(cap, int) and isinstance(first, int) and cap < first:
        out.append(Finding("error", "lagom-flags", f"--lagom-verify-max-iters {cap} is below --lagom-verify-iters "
                                                   f"{first}; allowed: an integer in {first}..{MAX_VERIFY_MAX_ITERS}",
                           "the cap bounds the iterations per arm that --lagom-verify-iters starts with",
                           f"raise --lagom-verify-max-iters to {first} or more, or drop it"))
    return out


def lagom_flag_problems(args: Mapping[str, Any]) -> list[Finding]:
    """Each of :data:`LAGOM_ONLY_FLAGS` given a value other than its default without ``--lagom``: the run
    would install no hooks and ignore it silently (the value would only show in the training log's
    ``lagom=False ... lagom_plan=...`` line). The defaults are :func:`add_lagom_args`'s, so a flag
    given its default value, or absent (a Megatron-LM line without lagom's flags), passes.

    With ``--lagom``: :func:`lagom_value_problems` instead.

    Returns:
        One ``Finding`` of level error, rule id ``lagom-flags``, per such flag, in flag order.
    """
    if args.get("lagom"):
        return lagom_value_problems(args)
    defaults = add_lagom_args(argparse.ArgumentParser(add_help=False))
    out = []
    for flag in LAGOM_ONLY_FLAGS:
        dest = flag[2:].replace("-", "_")
        default = defaults.get_default(dest)
        value = args.get(dest, default)
        if value is not None and value != default:
            out.append(Finding("error", "lagom-flags", f"{flag} needs --lagom (or drop {flag})",
                               f"without --lagom no hook is installed and {flag} {value!r} would be ignored",
                               f"add --lagom, or drop {flag}"))
    return out


def rule_lagom_flags(s: RunShape) -> list[Finding]:
    """:func:`lagom_flag_problems` on the run's arguments."""
    return lagom_flag_problems(s.args)
