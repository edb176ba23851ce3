"""The pre-flight of ``lagom doctor`` and ``scripts/pretrain_gpt.py`` (docs/training.md tables every check)."""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Mapping
from typing import Any

from lagom_megatron.preflight.cluster import choose_cluster, cluster_field, load_cluster
from lagom_megatron.preflight.environment import (
    rule_comm_config,
    rule_cuda_device_max_connections,
    rule_nccl_env,
    rule_nccl_overrides,
)
from lagom_megatron.preflight.files import rule_master_port, rule_output_folders, rule_output_names, rule_plan_lock
from lagom_megatron.preflight.lagom_flags import rule_lagom_flags, rule_tuning_iterations
from lagom_megatron.preflight.layout import (
    rule_batch,
    rule_experts,
    rule_heads,
    rule_layers,
    rule_nodes,
    rule_positive,
    rule_sequence,
    rule_uneven_pipeline,
    rule_world_size,
)
from lagom_megatron.preflight.overlap import (
    rule_ddp_bucket_size,
    rule_fsdp_sharding,
    rule_moe_overlap,
    rule_overlap_param_gather,
    rule_tp_comm_overlap,
)
from lagom_megatron.preflight.types import Finding, RunShape
from lagom_megatron.preflight.values import rule_megatron_flags, rule_values, rule_versions

ARGUMENT_RULES: tuple[Callable[[RunShape], list[Finding]], ...] = (
    rule_values,
    rule_megatron_flags,
    rule_lagom_flags,
    rule_world_size,
    rule_batch,
    rule_heads,
    rule_layers,
    rule_uneven_pipeline,
    rule_experts,
    rule_moe_overlap,
    rule_sequence,
    rule_overlap_param_gather,
    rule_fsdp_sharding,
    rule_ddp_bucket_size,
    rule_output_folders,
    rule_output_names,
    rule_plan_lock,
    rule_master_port,
    rule_versions,
)
"""Rules that read nothing of the cluster (training runs them before detecting the machine)."""

MACHINE_RULES: tuple[Callable[[RunShape], list[Finding]], ...] = (
    rule_nodes,
    rule_tp_comm_overlap,
    rule_comm_config,
    rule_cuda_device_max_connections,
    rule_nccl_env,
    rule_nccl_overrides,
    rule_tuning_iterations,
)

RULES: tuple[Callable[[RunShape], list[Finding]], ...] = ARGUMENT_RULES + MACHINE_RULES

STOP = "the run stops here with exit code 2, before any rank starts"


def _int_env(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name)
        if value and value.strip().isdigit():
            return int(value)
    return None


def env_count(environ: Mapping[str, str], name: str, hi: int, default_of: str) -> int | None:
    """``$name`` as a count in 1..``hi``, None when unset; ValueError naming it (and ``default_of``) otherwise."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= hi:
        raise ValueError(
            f"{name}={environ[name]!r} is not an integer in 1..{hi} (it stands for {default_of}): "
            "set it to a count, or unset it"
        )
    return int(text)


def detect_cluster(preset: Any = None, environ: Mapping[str, str] | None = None) -> Any:
    """The cluster without ``--lagom-cluster`` (a dict for this GPU); ``preset``: a ``Preset``, or its name or path
    as given; ValueError: bad ``$LAGOM_CLUSTER`` or preset."""
    return choose_cluster(preset, environ).cluster


def resolve(
    args_or_preset: Any,
    environ: Mapping[str, str] | None = None,
    cluster: Any = None,
    *,
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    preset_env: Mapping[str, str] | None = None,
    local: bool = False,
    megatron_lm: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> RunShape:
    """A preset, namespace or dict as a ``RunShape`` (preset ``env`` over ``environ``); ValueError: unknown or bad."""
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
        raise ValueError(
            f"doctor input must be a Preset, a preset name, an argparse.Namespace or a dict; "
            f"got {type(args_or_preset).__name__}"
        )
    if cluster is None and args.get("lagom_cluster"):
        cluster = args["lagom_cluster"]
    if isinstance(cluster, (str, os.PathLike)):
        cluster = load_cluster(str(cluster), "cluster")
    if world_size is None:
        world_size = args.get("world_size") or _int_env(environ, "WORLD_SIZE")
    if gpus_per_node is None:
        gpus_per_node = cluster_field(cluster, "gpus_per_node")
        if gpus_per_node is None:
            gpus_per_node = _int_env(environ, "LOCAL_WORLD_SIZE", "SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE")
    return RunShape(
        args=args,
        environ=environ,
        world_size=None if world_size is None else int(world_size),
        gpus_per_node=None if gpus_per_node is None else int(gpus_per_node),
        sm_arch=cluster_field(cluster, "sm_arch"),
        nccl_version=cluster_field(cluster, "nccl_version"),
        backend=str(cluster_field(cluster, "backend") or "nccl"),
        preset_env=preset_env,
        local=local,
        megatron_lm=megatron_lm,
        defaults=dict(defaults or {}),
        cluster=cluster,
    )


def run_rules(shape: RunShape, *, machine: bool = True) -> list[Finding]:
    """``rule_positive`` (its errors stop there: later rules divide), then RULES (``machine`` False: ARGUMENT_RULES)."""
    findings = rule_positive(shape)
    if any(f.level == "error" for f in findings):
        return findings
    for rule in RULES if machine else ARGUMENT_RULES:
        findings.extend(rule(shape))
    return findings


def check_run(
    args: Any,
    environ: Mapping[str, str] | None = None,
    cluster: Any = None,
    *,
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    preset_env: Mapping[str, str] | None = None,
    local: bool = False,
    machine: bool = True,
    validate: Callable[[Any, int], Any] | None = None,
    installed: Callable[..., None] | None = None,
) -> list[Finding]:
    """Findings, then ``validate`` / ``installed`` on a copy of ``args`` (their errors: ``pretrain-args``)."""
    shape = resolve(
        args, environ, cluster, world_size=world_size, gpus_per_node=gpus_per_node, preset_env=preset_env, local=local
    )
    findings = run_rules(shape, machine=machine)
    if validate is not None and not any(f.level == "error" for f in findings):
        ns = copy.deepcopy(args)
        try:
            validate(ns, shape.world_size or 1)
            if installed is not None and local and machine:
                installed(ns, on_gpu=shape.backend == "nccl")
        except (ValueError, FileNotFoundError) as exc:
            fix = "change the value named (python scripts/pretrain_gpt.py --help lists the flags)"
            findings.insert(0, Finding("error", "pretrain-args", str(exc), STOP, fix))
    return findings
