"""Pre-flight checks of a training run: the parallel layout, the overlap flags and the environment.

``lagom doctor`` and the launch scripts run these rules before any rank starts, so that a bad
layout fails in a second on the login node instead of minutes into a SLURM job, and so that NCCL
variables that NCCL would silently ignore, clamp or let override lagom's choices are reported.

Each ``Finding`` has a level (error: Megatron-LM or NCCL would fail, or the run would silently not
do what is asked; warning: legal but likely unintended), what is wrong, why, and the fix. The
rules are in ``lagom_megatron.launch.doctor_rules`` (``RULES``, the layout and overlap rules) and
``lagom_megatron.launch.doctor_env_rules`` (CUDA and NCCL environment), their data types in
``lagom_megatron.launch.doctor_types``; this module normalises the input, runs them, and
holds the entry points for training scripts (``preflight``, ``preflight_pretrain``).

Input: a ``Preset`` (or its name), an ``argparse.Namespace`` of Megatron-LM arguments, or a dict of
argparse destinations; the environment the ranks will see; and the cluster (a
``lagom_megatron.engine.cluster.ClusterSpec``, its name, or any object or dict with
``gpus_per_node``, ``sm_arch``, ``nccl_version``, ``backend``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Mapping

from lagom_megatron.launch.doctor_env_rules import BLACKWELL_SM_ARCH
from lagom_megatron.launch.doctor_rules import RULES
from lagom_megatron.launch.doctor_types import Finding, Level, RunShape

__all__ = ["BLACKWELL_SM_ARCH", "RULES", "Finding", "Level", "RunShape", "resolve", "run_doctor", "errors",
           "preflight", "detect_cluster", "preflight_pretrain", "check_command_line"]


def _load_cluster(name: str) -> Any:
    from lagom_megatron.engine.cluster import ClusterSpec

    return ClusterSpec.load(name)


def _field(cluster: Any, name: str) -> Any:
    if cluster is None:
        return None
    if isinstance(cluster, Mapping):
        return cluster.get(name)
    return getattr(cluster, name, None)


def _int_env(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name)
        if value and value.strip().isdigit():
            return int(value)
    return None


def resolve(args_or_preset: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
            world_size: int | None = None, gpus_per_node: int | None = None,
            preset_env: Mapping[str, str] | None = None) -> RunShape:
    """Normalises the inputs of ``run_doctor`` into a ``RunShape``.

    A preset's ``env`` is laid over ``environ`` (the launch scripts export it before the ranks
    start) and its ``cluster`` is loaded when ``cluster`` is None. World size comes from the
    argument, the preset, ``args.world_size`` or ``WORLD_SIZE``; GPUs per node from the argument,
    the cluster, the preset's ``slurm`` section or ``LOCAL_WORLD_SIZE`` / ``SLURM_GPUS_ON_NODE``.
    An explicit 0 or negative value is kept (the rules report it), not taken as unset.
    ``preset_env`` is the preset's env section when the caller laid it over ``environ`` itself.

    Raises:
        ValueError: an unknown preset or cluster name (from the loaders), or an input type that
            is none of Preset, str, Namespace, Mapping.
    """
    from lagom_megatron.config.presets import Preset, load_preset

    environ = dict(os.environ if environ is None else environ)
    preset_env = dict(preset_env or {})
    if isinstance(args_or_preset, (str, os.PathLike)):
        args_or_preset = load_preset(args_or_preset)
    if isinstance(args_or_preset, Preset):
        preset = args_or_preset
        args: dict[str, Any] = preset.to_args()
        environ.update(preset.env)
        preset_env.update(preset.env)
        if world_size is None:
            world_size = preset.world_size
        if cluster is None:
            cluster = preset.cluster
        if gpus_per_node is None and preset.slurm is not None:
            gpus_per_node = preset.slurm.gpus_per_node
    elif isinstance(args_or_preset, argparse.Namespace):
        args = dict(vars(args_or_preset))
    elif isinstance(args_or_preset, Mapping):
        args = dict(args_or_preset)
    else:
        raise ValueError(
            f"doctor input must be a Preset, a preset name, an argparse.Namespace or a dict; "
            f"got {type(args_or_preset).__name__}"
        )
    if cluster is None and args.get("lagom_cluster"):
        cluster = args["lagom_cluster"]
    if isinstance(cluster, (str, os.PathLike)):
        cluster = _load_cluster(str(cluster))
    if world_size is None:
        world_size = args.get("world_size") or _int_env(environ, "WORLD_SIZE")
    if gpus_per_node is None:
        gpus_per_node = _field(cluster, "gpus_per_node")
        if gpus_per_node is None:
            gpus_per_node = _int_env(environ, "LOCAL_WORLD_SIZE", "SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE")
    backend = _field(cluster, "backend") or "nccl"
    return RunShape(
        args=args, environ=environ, world_size=None if world_size is None else int(world_size),
        gpus_per_node=None if gpus_per_node is None else int(gpus_per_node),
        sm_arch=_field(cluster, "sm_arch"), nccl_version=_field(cluster, "nccl_version"),
        backend=str(backend), preset_env=preset_env,
    )


def run_doctor(args_or_preset: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
               world_size: int | None = None, gpus_per_node: int | None = None,
               preset_env: Mapping[str, str] | None = None) -> list[Finding]:
    """Runs every rule.

    Args:
        args_or_preset: a ``Preset``, a preset name or path, an ``argparse.Namespace`` of
            Megatron-LM arguments, or a dict of argparse destinations.
        environ: the ranks' environment; None = ``os.environ``. A preset's ``env`` is laid over it.
        cluster: a ClusterSpec, its name, a dict/object with ``gpus_per_node``, ``sm_arch``,
            ``nccl_version``, ``backend``, or None (a preset's own cluster, else
            ``args.lagom_cluster`` when present, else unknown: backend "nccl", GPU taken as
            pre-Blackwell). CPU runs must pass a cluster whose backend is "gloo" (``cpu-gloo``).
        world_size: ranks in the job, overriding the preset / ``WORLD_SIZE``.
        gpus_per_node: overriding the cluster / ``LOCAL_WORLD_SIZE``.
        preset_env: the preset's env section, when the caller resolved the preset itself.

    Returns:
        Findings, errors and warnings in rule order; empty = all clear.

    Raises:
        ValueError: unknown preset or cluster, or an unsupported input type.
    """
    shape = resolve(args_or_preset, environ, cluster, world_size=world_size, gpus_per_node=gpus_per_node,
                    preset_env=preset_env)
    findings: list[Finding] = []
    for rule in RULES:
        findings.extend(rule(shape))
    return findings


def check_command_line(argv: list[str], world_size: int | None) -> list[Finding]:
    """Parses a ``scripts/pretrain_gpt.py`` command line as that script does.

    ``training.arguments.parse_args`` then ``training.argument_checks.validate_args`` (on the line's
    own namespace), so an unknown flag, an invalid choice or a bad value is an error naming it, as
    the real launch would stop on it. A line without a data source gets a warning and is checked
    as if it had ``--mock-data`` (the data flags are usually added at launch). ``world_size`` None
    or below 1 is replaced by TP x PP x CP (the rules report it).

    Returns:
        At most two findings: ``command-line`` (argparse refused the line) or ``pretrain-args``
        (``validate_args`` refused it, its first complaint), and the ``data`` warning.
    """
    from lagom_megatron.training.argument_checks import validate_args
    from lagom_megatron.training.arguments import parse_args

    stop = "scripts/pretrain_gpt.py would stop here with exit code 2, before any rank trains"
    try:
        ns = parse_args(argv, exit_on_error=False)
    except (ValueError, FileNotFoundError) as exc:
        return [Finding("error", "command-line", str(exc), stop,
                        "fix the flag or value named (python scripts/pretrain_gpt.py --help lists them); "
                        "a Megatron-LM checkout's line is checked with lagom doctor --megatron-lm")]
    out = []
    if not ns.mock_data and not ns.data_path:
        out.append(Finding(
            "warning", "data", "no training data: neither --mock-data nor --data-path is given",
            "pretrain_gpt.py stops without a data source; the rest of the line was checked as if "
            "--mock-data were given",
            "add --mock-data or --data-path PREFIX to the launch command",
        ))
        ns.mock_data = True
    if world_size is None or world_size < 1:
        world_size = ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size * ns.context_parallel_size
    try:
        validate_args(ns, world_size)
    except (ValueError, FileNotFoundError, TypeError, ZeroDivisionError) as exc:
        out.insert(0, Finding("error", "pretrain-args", str(exc), stop,
                              "change the value named; the other doctor findings explain layout problems"))
    return out


def errors(findings: list[Finding]) -> list[Finding]:
    """The findings of level "error"."""
    return [f for f in findings if f.level == "error"]


def preflight(args: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
              log: Callable[[str], None] = print) -> list[Finding]:
    """Runs the doctor for a training entry point and stops on errors.

    Prints every finding through ``log`` and a summary line.

    Returns:
        The findings (warnings only) when there is no error.

    Raises:
        SystemExit: with code 1 when there is at least one error (after printing them).
    """
    findings = run_doctor(args, environ, cluster)
    for f in findings:
        log(f"lagom doctor: {f}")
    n_err = len(errors(findings))
    if n_err:
        log(f"lagom doctor: {n_err} error(s), {len(findings) - n_err} warning(s); stopping before training")
        raise SystemExit(1)
    return findings


def detect_cluster(preset_name: str | None = None, environ: Mapping[str, str] | None = None) -> Any:
    """The cluster a training process checks against, in this order: ``$LAGOM_CLUSTER`` (the SLURM
    scripts export the preset's); ``cpu-gloo`` without CUDA; the preset's cluster; else what torch
    reports about the local GPU.

    Returns:
        A ``ClusterSpec`` or a dict with ``gpus_per_node`` (``$LOCAL_WORLD_SIZE``), ``sm_arch``,
        ``nccl_version`` and ``backend`` from torch.

    Raises:
        ValueError: ``$LAGOM_CLUSTER`` or the preset names an unknown cluster or preset.
    """
    environ = os.environ if environ is None else environ
    if environ.get("LAGOM_CLUSTER"):
        return _load_cluster(environ["LAGOM_CLUSTER"])
    import torch

    if not torch.cuda.is_available():
        return _load_cluster("cpu-gloo")
    if preset_name:
        from lagom_megatron.config.presets import load_preset

        return _load_cluster(load_preset(preset_name).cluster)
    major, minor = torch.cuda.get_device_capability()
    nccl = torch.cuda.nccl.version()
    return {"gpus_per_node": _int_env(environ, "LOCAL_WORLD_SIZE"), "sm_arch": major * 10 + minor,
            "backend": "nccl", "nccl_version": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}


def preflight_pretrain(args: Any, environ: Mapping[str, str] | None = None) -> list[Finding]:
    """``pretrain_gpt.py --lagom``: ``preflight`` on the parsed arguments with ``detect_cluster``.

    Call it before any process group is created; prints on rank 0 only.

    Raises:
        SystemExit: code 1 when the doctor finds errors.
    """
    environ = os.environ if environ is None else environ

    def log(line: str) -> None:
        if environ.get("RANK", "0") == "0":
            print(line, flush=True)

    cluster = detect_cluster(getattr(args, "preset_name", None), environ)
    return preflight(args, environ, cluster, log=log)
