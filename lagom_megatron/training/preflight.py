"""The one pre-flight validation of a training run, shared by ``lagom doctor`` and ``scripts/pretrain_gpt.py``.

Both call :func:`check_run` on the same inputs and so reach the same verdict: the doctor for a
target cluster (the local machine by default, detected as training detects it:
:func:`detect_cluster`), training on rank 0 before any process group exists
(:func:`pretrain_preflight`). A verdict is a list of ``Finding`` s; any ``error`` stops the run
with exit code 2 and one line per error naming the flag or variable, the bad value and what is
allowed. The rules are in ``preflight_rules`` (layout and overlap flags: Megatron-LM's
``validate_args`` and megatron-core's config ``__post_init__``), ``preflight_moe`` (experts and
uneven pipelines), ``preflight_values`` (optimizer, seed, split and other value domains), ``preflight_env`` (CUDA
and NCCL variables), ``comm_config`` (the
``--nccl-communicator-config-path`` YAML) and ``preflight_files`` (output folders, the plan lock,
the rendezvous port); ``docs/training.md`` tables every check with its source and its test.
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any, Callable, Mapping

from lagom_megatron.training.comm_config import rule_comm_config
from lagom_megatron.training.preflight_env import rule_cuda_device_max_connections, rule_nccl_env, rule_nccl_overrides
from lagom_megatron.training.preflight_files import rule_master_port, rule_output_folders, rule_plan_lock
from lagom_megatron.training.preflight_moe import rule_moe_overlap, rule_uneven_pipeline
from lagom_megatron.training.preflight_rules import (
    rule_batch, rule_ddp_bucket_size, rule_experts, rule_fsdp_sharding, rule_heads, rule_layers, rule_nodes,
    rule_overlap_param_gather, rule_positive, rule_sequence, rule_tp_comm_overlap, rule_world_size,
)
from lagom_megatron.training.preflight_types import Finding, RunShape
from lagom_megatron.training.lagom_flags import rule_lagom_flags
from lagom_megatron.training.preflight_values import rule_megatron_flags, rule_values, rule_versions

ARGUMENT_RULES: tuple[Callable[[RunShape], list[Finding]], ...] = (
    rule_values, rule_megatron_flags, rule_lagom_flags, rule_world_size, rule_batch, rule_heads, rule_layers,
    rule_uneven_pipeline, rule_experts, rule_moe_overlap, rule_sequence, rule_overlap_param_gather, rule_fsdp_sharding,
    rule_ddp_bucket_size, rule_output_folders, rule_plan_lock, rule_master_port, rule_versions,
)
"""The rules that read the arguments, the environment and local files but nothing of the cluster
(GPUs per node, compute capability, NCCL version, backend): training runs them before detecting
the machine (:func:`pretrain_preflight`)."""

MACHINE_RULES: tuple[Callable[[RunShape], list[Finding]], ...] = (
    rule_nodes, rule_tp_comm_overlap, rule_comm_config, rule_cuda_device_max_connections, rule_nccl_env,
    rule_nccl_overrides,
)
"""The rules that read the cluster's fields."""

RULES: tuple[Callable[[RunShape], list[Finding]], ...] = ARGUMENT_RULES + MACHINE_RULES
"""Every rule after ``rule_positive``, in report order: the argument rules, then the machine rules."""

STOP = "the run stops here with exit code 2, before any rank starts"


def load_cluster(name: str, source: str) -> Any:
    """``ClusterSpec.load(name)``, with an error naming where the name came from.

    Args:
        name: a cluster name under ``configs/clusters/`` or a YAML path.
        source: what gave it, e.g. ``LAGOM_CLUSTER`` or ``--cluster``.

    Raises:
        ValueError: ``<source>=<name>: ...`` with the known names (an unknown name) or the file's error.
    """
    from lagom_megatron.engine.cluster import ClusterSpec, available_clusters

    try:
        return ClusterSpec.load(name)
    except FileNotFoundError:
        raise ValueError(f"{source}={name!r} is not a known cluster or a cluster file; allowed: "
                         f"{', '.join(available_clusters())} or a path to a cluster YAML") from None
    except ValueError as exc:
        raise ValueError(f"{source}={name!r}: {exc}") from None


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


def cuda_certainly_absent() -> bool:
    """True when ``torch.cuda.is_available()`` is certainly False, decided without importing torch
    (importing it takes seconds, far more on a loaded machine).

    Either torch is a CPU build (``cuda`` and ``hip`` both None in ``torch/version.py``, which torch's
    build writes; read with ``ast``, not imported), or it is a CUDA build on Linux and the NVIDIA
    driver library ``libcuda.so.1`` cannot be loaded (the CUDA runtime that torch asks for the device
    count loads the driver under that name and reports no device without it). False means: ask torch.
    """
    import ast
    import importlib.util
    import sys
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("torch")
        folder = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
        tree = ast.parse((folder / "version.py").read_text(encoding="utf-8")) if folder else None
    except (ImportError, ValueError, OSError, SyntaxError):
        return False
    build: dict[str, Any] = {}
    for node in tree.body if tree else ():
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
            node, "target", None) if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip") and node.value is not None:
            try:
                build[target.id] = ast.literal_eval(node.value)
            except ValueError:
                return False
    if set(build) != {"cuda", "hip"} or build["hip"] is not None:
        return False
    if build["cuda"] is None:
        return True
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def detect_cluster(preset_name: str | None = None, environ: Mapping[str, str] | None = None) -> Any:
    """The cluster a training process checks against, in this order: ``$LAGOM_CLUSTER`` (the SLURM
    scripts export the preset's); ``cpu-gloo`` without CUDA (:func:`cuda_certainly_absent` first, which
    does not import torch, else ``torch.cuda.is_available()``); the preset's cluster; else what torch
    reports about the local GPU.

    Returns:
        A ``ClusterSpec`` or a dict with ``gpus_per_node`` (``$LOCAL_WORLD_SIZE``), ``sm_arch``,
        ``nccl_version`` and ``backend`` from torch.

    Raises:
        ValueError: ``$LAGOM_CLUSTER`` names an unknown cluster (the message names the variable,
            its value and the known clusters), or the preset is unknown.
    """
    environ = os.environ if environ is None else environ
    if environ.get("LAGOM_CLUSTER"):
        return load_cluster(environ["LAGOM_CLUSTER"], "LAGOM_CLUSTER")
    if cuda_certainly_absent():
        return load_cluster("cpu-gloo", "cluster")
    import torch

    if not torch.cuda.is_available():
        return load_cluster("cpu-gloo", "cluster")
    if preset_name:
        from lagom_megatron.config.presets import load_preset

        return load_cluster(load_preset(preset_name).cluster, f"preset {preset_name!r} cluster")
    major, minor = torch.cuda.get_device_capability()
    nccl = torch.cuda.nccl.version()
    return {"gpus_per_node": _int_env(environ, "LOCAL_WORLD_SIZE"), "sm_arch": major * 10 + minor,
            "backend": "nccl", "nccl_version": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}


def resolve(args_or_preset: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
            world_size: int | None = None, gpus_per_node: int | None = None,
            preset_env: Mapping[str, str] | None = None, local: bool = False) -> RunShape:
    """Normalises a preset, a namespace or a dict of argparse destinations into a ``RunShape``.

    A preset's ``env`` is laid over ``environ`` (the launch scripts export it before the ranks
    start) and its ``cluster`` is loaded when ``cluster`` is None. World size comes from the
    argument, the preset, ``args.world_size`` or ``WORLD_SIZE``; GPUs per node from the argument,
    the cluster, the preset's ``slurm`` section or ``LOCAL_WORLD_SIZE`` / ``SLURM_GPUS_ON_NODE``.
    An explicit 0 or negative value is kept (the rules report it), not taken as unset.
    ``local`` says the run is on this machine (files, ports and installed libraries are checked).

    Raises:
        ValueError: an unknown preset or cluster name, or an input type that is none of Preset,
            str, Namespace, Mapping.
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
        world_size = preset.world_size if world_size is None else world_size
        cluster = preset.cluster if cluster is None else cluster
        if gpus_per_node is None and preset.slurm is not None:
            gpus_per_node = preset.slurm.gpus_per_node
    elif isinstance(args_or_preset, argparse.Namespace):
        args = dict(vars(args_or_preset))
    elif isinstance(args_or_preset, Mapping):
        args = dict(args_or_preset)
    else:
        raise ValueError(f"doctor input must be a Preset, a preset name, an argparse.Namespace or a dict; "
                         f"got {type(args_or_preset).__name__}")
    if cluster is None and args.get("lagom_cluster"):
        cluster = args["lagom_cluster"]
    if isinstance(cluster, (str, os.PathLike)):
        cluster = load_cluster(str(cluster), "cluster")
    if world_size is None:
        world_size = args.get("world_size") or _int_env(environ, "WORLD_SIZE")
    if gpus_per_node is None:
        gpus_per_node = _field(cluster, "gpus_per_node")
        if gpus_per_node is None:
            gpus_per_node = _int_env(environ, "LOCAL_WORLD_SIZE", "SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE")
    return RunShape(
        args=args, environ=environ, world_size=None if world_size is None else int(world_size),
        gpus_per_node=None if gpus_per_node is None else int(gpus_per_node),
        sm_arch=_field(cluster, "sm_arch"), nccl_version=_field(cluster, "nccl_version"),
        backend=str(_field(cluster, "backend") or "nccl"), preset_env=preset_env, local=local,
    )


def run_rules(shape: RunShape, *, machine: bool = True) -> list[Finding]:
    """``rule_positive`` first (a zero or negative size stops there: later rules divide by it),
    then every rule of :data:`RULES` (``machine`` False: of :data:`ARGUMENT_RULES` only)."""
    findings = rule_positive(shape)
    if any(f.level == "error" for f in findings):
        return findings
    for rule in RULES if machine else ARGUMENT_RULES:
        findings.extend(rule(shape))
    return findings


def check_run(args: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
              world_size: int | None = None, gpus_per_node: int | None = None,
              preset_env: Mapping[str, str] | None = None, local: bool = False,
              ours: bool = False, machine: bool = True) -> list[Finding]:
    """The verdict on one run: every rule, then (``ours``) ``validate_args`` of ``pretrain_gpt.py``.

    Args:
        args: a ``pretrain_gpt.py`` namespace (``ours``), or a preset / dict for a Megatron-LM line.
        environ, cluster, world_size, gpus_per_node, preset_env: as :func:`resolve`.
        local: the run is on this machine: output folders, the plan lock, the rendezvous port and
            the installed libraries (Transformer Engine for context parallelism) are checked.
        ours: ``args`` is our script's namespace: ``training.argument_checks.validate_args`` runs on
            a copy (its complaint is kept when the rules found no error: most of it restates them).
        machine: False: only the rules that need nothing of the cluster (:data:`ARGUMENT_RULES`) and
            ``validate_args``; the installed libraries are not checked (``cluster`` may be None).

    Returns:
        Findings in rule order; an empty list or warnings only = the run may start.
    """
    from lagom_megatron.training.argument_checks import check_installed, validate_args

    shape = resolve(args, environ, cluster, world_size=world_size, gpus_per_node=gpus_per_node,
                    preset_env=preset_env, local=local)
    findings = run_rules(shape, machine=machine)
    if ours and not any(f.level == "error" for f in findings):
        ns = copy.deepcopy(args)
        try:
            validate_args(ns, shape.world_size or 1)
            if local and machine:
                check_installed(ns, on_gpu=shape.backend == "nccl")
        except (ValueError, FileNotFoundError) as exc:
            findings.insert(0, Finding("error", "pretrain-args", str(exc), STOP,
                                       "change the value named (python scripts/pretrain_gpt.py --help lists the flags)"))
    return findings


def pretrain_preflight(args: argparse.Namespace, environ: Mapping[str, str] | None = None, *,
                       log: Callable[[str], None] | None = None) -> int:
    """``scripts/pretrain_gpt.py``'s pre-flight: :func:`check_run` on this machine, before any process group.

    When finding the machine would import torch (a CUDA build with a driver, no ``$LAGOM_CLUSTER``),
    the argument rules and ``validate_args`` run first, and a refusal there stops before detection:
    the same verdict, in a fraction of the time; the line is the first error of the rules in
    :data:`RULES` order unless only a machine rule would have found one before ``validate_args``.

    Prints the first error once (rank 0; other ranks stay silent and exit with the same code) as
    one line ``pretrain_gpt.py: error: <what>``, and the warnings with ``--lagom``. On success rank 0 takes
    the advisory lock of ``--lagom-plan`` (``preflight_files.hold_plan_lock``) for the process's life.

    Returns:
        0 when the run may start, 2 when it must not.
    """
    from lagom_megatron.training.preflight_files import hold_plan_lock

    environ = os.environ if environ is None else environ
    rank0 = environ.get("RANK", "0") == "0"

    def say(line: str) -> None:
        if rank0:
            (log or (lambda s: print(s, flush=True)))(line)

    def refused(findings: list[Finding]) -> bool:
        bad = [f for f in findings if f.level == "error"]
        if bad:  # one line: the first error; lagom doctor prints all of them with why and fix
            more = f" (and {len(bad) - 1} more error(s): lagom doctor lists them)" if len(bad) > 1 else ""
            say(f"pretrain_gpt.py: error: {bad[0].what}{more}")
        return bool(bad)

    world_size = _int_env(environ, "WORLD_SIZE") or 1
    try:
        if not environ.get("LAGOM_CLUSTER") and not cuda_certainly_absent():
            # detecting the GPU imports torch (seconds): first refuse what the arguments alone refuse
            if refused(check_run(args, environ, None, world_size=world_size, local=True, ours=True, machine=False)):
                return 2
        cluster = detect_cluster(getattr(args, "preset_name", None), environ)
        findings = check_run(args, environ, cluster, world_size=world_size, local=True, ours=True)
    except ValueError as exc:
        say(f"pretrain_gpt.py: error: {exc}")
        return 2
    if refused(findings):
        return 2
    if getattr(args, "lagom", False):
        for f in findings:
            say(f"lagom doctor: {f}")
        if rank0 and getattr(args, "lagom_plan", None):
            try:
                hold_plan_lock(args.lagom_plan, environ)
            except ValueError as exc:
                say(f"pretrain_gpt.py: error: {exc}")
                return 2
    return 0
