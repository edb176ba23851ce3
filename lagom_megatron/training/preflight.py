"""The one pre-flight validation of a training run, shared by ``lagom doctor`` and ``scripts/pretrain_gpt.py``.

Both call :func:`check_run` on the same inputs and so reach the same verdict: the doctor for a
target cluster (chosen by the one rule of ``training.target_cluster``: a cluster on the command
line, ``$LAGOM_CLUSTER``, the preset's cluster, this machine), training on rank 0 before any process
group exists (:func:`pretrain_preflight`), which also refuses a cluster this machine does not match. A verdict is a list of ``Finding`` s; any ``error`` stops the run
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

from lagom_megatron.training.arguments import LAYOUT_FLAGS
from lagom_megatron.training.comm_config import rule_comm_config
from lagom_megatron.training.preflight_env import rule_cuda_device_max_connections, rule_nccl_env, rule_nccl_overrides
from lagom_megatron.training.preflight_files import rule_master_port, rule_output_folders, rule_output_names, rule_plan_lock
from lagom_megatron.training.preflight_moe import rule_moe_overlap, rule_uneven_pipeline
from lagom_megatron.training.preflight_rules import (
    rule_batch, rule_ddp_bucket_size, rule_experts, rule_fsdp_sharding, rule_heads, rule_layers, rule_nodes,
    rule_overlap_param_gather, rule_positive, rule_sequence, rule_tp_comm_overlap, rule_world_size,
)
from lagom_megatron.training.preflight_types import Finding, RunShape
from lagom_megatron.training.lagom_flags import rule_lagom_flags
from lagom_megatron.training.preflight_values import rule_megatron_flags, rule_values, rule_versions
from lagom_megatron.training.target_cluster import (  # noqa: F401 (load_cluster, cuda_certainly_absent: public here too)
    choose_cluster, cuda_certainly_absent, load_cluster, mismatch, this_machine,
)

ARGUMENT_RULES: tuple[Callable[[RunShape], list[Finding]], ...] = (
    rule_values, rule_megatron_flags, rule_lagom_flags, rule_world_size, rule_batch, rule_heads, rule_layers,
    rule_uneven_pipeline, rule_experts, rule_moe_overlap, rule_sequence, rule_overlap_param_gather, rule_fsdp_sharding,
    rule_ddp_bucket_size, rule_output_folders, rule_output_names, rule_plan_lock, rule_master_port, rule_versions,
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


MAX_WORLD_SIZE = 1 << 20
"""Largest world size the checks accept (a million ranks; a typo of twenty digits is not a job)."""
MAX_GPUS_PER_NODE = 1024
"""Largest GPUs per node the checks accept."""


def env_count(environ: Mapping[str, str], name: str, hi: int, default_of: str) -> int | None:
    """``$name`` as a count in 1..``hi``, or None when unset or empty.

    Args:
        environ: the environment.
        name: ``WORLD_SIZE`` or ``LOCAL_WORLD_SIZE``.
        hi: the largest value allowed.
        default_of: what the variable stands in for, for the message (``--world-size``).

    Raises:
        ValueError: set to anything else (``abc``, ``0``, ``-1``, twenty digits), naming the variable.
    """
    text = environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= hi:
        raise ValueError(f"{name}={environ[name]!r} is not an integer in 1..{hi} (it stands for {default_of}): "
                         "set it to a count, or unset it")
    return int(text)


def detect_cluster(preset_name: str | None = None, environ: Mapping[str, str] | None = None) -> Any:
    """The cluster a run on this machine is checked against without a cluster on its command line:
    ``training.target_cluster.choose_cluster`` (``$LAGOM_CLUSTER``, the preset's cluster, this machine).

    Returns:
        A ``ClusterSpec`` or, for this machine's GPU, a dict with ``gpus_per_node``
        (``$LOCAL_WORLD_SIZE``), ``sm_arch``, ``nccl_version`` and ``backend`` from torch.

    Raises:
        ValueError: ``$LAGOM_CLUSTER`` names an unknown cluster (the message names the variable,
            its value and the known clusters), or the preset is unknown.
    """
    return choose_cluster(preset_name, environ).cluster


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


def preset_world_problem(args: Any, world_size: int) -> Finding | None:
    """A preset run with another world size than the preset names, or None when they agree.

    A preset names a layout (``cpu-tp2-dp2``: TP 2 x DP 2 on 4 processes); run with another process
    count it would silently train another one (2 processes: DP 1) and, with ``--lagom``, save that
    layout's plan in the preset's folder. Without a layout flag of
    ``training.arguments.LAYOUT_FLAGS`` on the command line that is an error naming both world sizes
    and the launch that fits; with one the command line names the layout itself: a warning.

    Args:
        args: ``pretrain_gpt.py``'s namespace (``preset_world_size``, ``layout_flags_given`` and the
            layout sizes, ``training.arguments.parse_args``).
        world_size: the job's ranks (``WORLD_SIZE``; 1 for a plain ``python`` run).

    Returns:
        A ``Finding`` of rule ``preset-world-size`` (error or warning), or None.
    """
    want = getattr(args, "preset_world_size", None)
    if want is None or want == world_size:
        return None
    from lagom_megatron.config.presets import load_preset

    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    layout = (f"TP={args.tensor_model_parallel_size} x PP={args.pipeline_model_parallel_size} x "
              f"CP={args.context_parallel_size} x DP={world_size // mp}")
    name = args.preset_name
    given = getattr(args, "layout_flags_given", ())
    ranks = f"this job has {world_size} process{'es' if world_size != 1 else ''} (WORLD_SIZE={world_size})"
    if given:
        return Finding("warning", "preset-world-size",
                       f"preset {name!r} is for world size {want} but {ranks}: training {layout}, the layout "
                       f"{', '.join(given)} give{'s' if len(given) == 1 else ''}",
                       "the command line names the layout itself", f"launch {want} processes for the preset's own layout")
    slurm = load_preset(args.preset).slurm if getattr(args, "preset", None) else None
    if slurm is not None and slurm.nodes > 1:
        launch = (f"launch it on {slurm.nodes} nodes x {slurm.gpus_per_node} GPUs "
                  f"(scripts/slurm/lagom_pretrain.sbatch --preset {name})")
    else:
        launch = f"launch it with torchrun --nproc-per-node {want}"
    return Finding("error", "preset-world-size",
                   f"preset {name!r} is for world size {want} but {ranks}, which would train {layout} instead of "
                   f"the preset's DP={want // mp}: {launch}, or give the layout on the command line "
                   f"({', '.join(LAYOUT_FLAGS)}) to train another one on {world_size} process{'es' if world_size != 1 else ''}",
                   STOP, launch)


def pretrain_preflight(args: argparse.Namespace, environ: Mapping[str, str] | None = None, *,
                       log: Callable[[str], None] | None = None) -> int:
    """``scripts/pretrain_gpt.py``'s pre-flight: :func:`check_run` on this machine, before any process group.

    The cluster is ``target_cluster.choose_cluster`` (``--lagom-cluster``, ``$LAGOM_CLUSTER``, the
    preset's, this machine); one this machine does not match is refused with
    ``target_cluster.mismatch``'s line. The argument rules and ``validate_args`` run first (finding
    the machine may import torch), and a refusal there stops before detection:
    the same verdict, in a fraction of the time; the line is the first error of the rules in
    :data:`RULES` order unless only a machine rule would have found one before ``validate_args``.

    A preset launched with another world size than it names is refused after the argument rules
    (:func:`preset_world_problem`; a warning when the layout flags are on the command line).

    Prints the first error once (rank 0; other ranks stay silent and exit with the same code) as
    one line ``pretrain_gpt.py: error: <what>``, and the warnings with ``--lagom``; then rank 0 takes the
    lock of every folder the run writes (``preflight_files.hold_run_locks``: the default run folder
    too) for the process's life. The chosen cluster's
    name is left in ``args.lagom_cluster`` for lagom's controller (unless it is this machine's GPU,
    which has no cluster file).

    Returns:
        0 when the run may start, 2 when it must not.
    """
    from lagom_megatron.training.preflight_files import hold_run_locks

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

    try:
        world_size = env_count(environ, "WORLD_SIZE", MAX_WORLD_SIZE, "the job's world size") or 1
        # what the arguments alone refuse first: the same line as the doctor's, and no torch import
        # (detecting a GPU takes seconds) for a line that cannot start anyway
        if refused(check_run(args, environ, None, world_size=world_size, local=True, ours=True, machine=False)):
            return 2
        preset_world = preset_world_problem(args, world_size)  # the arguments passed: they divide this world
        if preset_world is not None:
            if refused([preset_world]):
                return 2
            say(f"pretrain_gpt.py: warning: {preset_world.what}")
        machine = this_machine()
        target = choose_cluster(getattr(args, "preset_name", None), environ, getattr(args, "lagom_cluster", None),
                                "--lagom-cluster", machine)
        problem = mismatch(target, machine)
        if problem:
            say(f"pretrain_gpt.py: error: {problem}")
            return 2
        findings = check_run(args, environ, target.cluster, world_size=world_size, local=True, ours=True)
        if not isinstance(target.cluster, Mapping):  # lagom's cost model starts from the same cluster
            args.lagom_cluster = target.name
    except ValueError as exc:
        say(f"pretrain_gpt.py: error: {exc}")
        return 2
    if refused(findings):
        return 2
    if getattr(args, "lagom", False):
        for f in findings:
            say(f"lagom doctor: {f}")
        if rank0:
            try:
                hold_run_locks(vars(args), environ)
            except ValueError as exc:
                say(f"pretrain_gpt.py: error: {exc}")
                return 2
    return 0
