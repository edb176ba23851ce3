"""The one pre-flight validation of a run, shared by ``lagom doctor`` and ``scripts/pretrain_gpt.py``
(:func:`check_run`; an error stops with exit code 2). ``docs/training.md`` tables every check and its source."""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any, Callable, Mapping

from lagom_megatron.training.arguments import LAYOUT_FLAGS
from lagom_megatron.preflight.environment import rule_comm_config
from lagom_megatron.preflight.environment import rule_cuda_device_max_connections, rule_nccl_env, rule_nccl_overrides
from lagom_megatron.preflight.files import rule_master_port, rule_output_folders, rule_output_names, rule_plan_lock
from lagom_megatron.preflight.layout import rule_moe_overlap, rule_uneven_pipeline
from lagom_megatron.preflight.layout import (
    rule_batch, rule_ddp_bucket_size, rule_experts, rule_fsdp_sharding, rule_heads, rule_layers, rule_nodes,
    rule_overlap_param_gather, rule_positive, rule_sequence, rule_tp_comm_overlap, rule_world_size,
)
from lagom_megatron.preflight.types import Finding, RunShape
from lagom_megatron.preflight.lagom_flags import rule_lagom_flags
from lagom_megatron.preflight.values import rule_megatron_flags, rule_values, rule_versions
from lagom_megatron.preflight.cluster import (  # noqa: F401 (load_cluster, cuda_certainly_absent: public here too)
    choose_cluster, cuda_certainly_absent, load_cluster, mismatch, this_machine,
)

ARGUMENT_RULES: tuple[Callable[[RunShape], list[Finding]], ...] = (
    rule_values, rule_megatron_flags, rule_lagom_flags, rule_world_size, rule_batch, rule_heads, rule_layers,
    rule_uneven_pipeline, rule_experts, rule_moe_overlap, rule_sequence, rule_overlap_param_gather, rule_fsdp_sharding,
    rule_ddp_bucket_size, rule_output_folders, rule_output_names, rule_plan_lock, rule_master_port, rule_versions,
)
"""The rules that read nothing of the cluster: training runs them before detecting the machine."""

MACHINE_RULES: tuple[Callable[[RunShape], list[Finding]], ...] = (
    rule_nodes, rule_tp_comm_overlap, rule_comm_config, rule_cuda_device_max_connections, rule_nccl_env,
    rule_nccl_overrides,
)

RULES: tuple[Callable[[RunShape], list[Finding]], ...] = ARGUMENT_RULES + MACHINE_RULES
"""Every rule after ``rule_positive``, in report order."""

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
MAX_GPUS_PER_NODE = 1024


def env_count(environ: Mapping[str, str], name: str, hi: int, default_of: str) -> int | None:
    """``$name`` as a count in 1..``hi``, None when unset; ValueError naming it (and ``default_of``) otherwise."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= hi:
        raise ValueError(f"{name}={environ[name]!r} is not an integer in 1..{hi} (it stands for {default_of}): "
                         "set it to a count, or unset it")
    return int(text)


def detect_cluster(preset_name: str | None = None, environ: Mapping[str, str] | None = None) -> Any:
    """The cluster a run without ``--lagom-cluster`` is checked against: a ``ClusterSpec``, or a dict for this
    machine's GPU. Raises ValueError: an unknown ``$LAGOM_CLUSTER`` or preset."""
    return choose_cluster(preset_name, environ).cluster


def resolve(args_or_preset: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
            world_size: int | None = None, gpus_per_node: int | None = None,
            preset_env: Mapping[str, str] | None = None, local: bool = False) -> RunShape:
    """Normalises a preset, namespace or dict into a ``RunShape`` (a preset's ``env`` over ``environ``; 0 or
    negative sizes kept for the rules). ``local``: on this machine. Raises ValueError: an unknown preset or cluster,
    or another input type."""
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
    """``rule_positive`` (an error stops there: later rules divide by sizes), then :data:`RULES`
    (``machine`` False: :data:`ARGUMENT_RULES`)."""
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
    """The verdict on one run, in rule order; ``ours``: also ``validate_args`` on a copy of ``pretrain_gpt.py``'s
    namespace. ``machine`` False: :data:`ARGUMENT_RULES` only, installed libraries not checked."""
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
    """A ``preset-world-size`` Finding when the job's world size differs from the preset's, else None:
    an error (another layout would train silently), a warning when ``LAYOUT_FLAGS`` are on the command line."""
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
    """``pretrain_gpt.py``'s pre-flight before any process group: 0 = start, 2 = stop (rank 0 prints the first
    error; with ``--lagom`` it locks every output folder). Sets ``args.lagom_cluster`` to a cluster file's name."""
    from lagom_megatron.preflight.files import hold_run_locks

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
