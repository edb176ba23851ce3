"""Pre-flight checks of a training run: the parallel layout, the overlap flags and the environment.

``lagom doctor`` and the launch scripts run these rules before any rank starts, so that a bad
layout fails in a second on the login node instead of minutes into a SLURM job, and so that NCCL
variables that NCCL would silently ignore, clamp or let override lagom's choices are reported.

Each ``Finding`` has a level (error: Megatron-LM or NCCL would fail, or the run would silently not
do what is asked; warning: legal but likely unintended), what is wrong, why, and the fix. The
layout and overlap rules restate the checks of Megatron-LM's ``megatron/training/arguments.py``
(``validate_args``) and of Transformer Engine's Userbuffers (TP communication overlap) as facts;
the NCCL rules live in ``lagom_megatron.engine.nccl_env_check``. The selection of rules and their
levels are this project's design.

Input: a ``Preset`` (or its name), an ``argparse.Namespace`` of Megatron-LM arguments, or a dict of
argparse destinations; the environment the ranks will see; and the cluster (a
``lagom_megatron.engine.cluster.ClusterSpec``, its name, or any object or dict with
``gpus_per_node``, ``sm_arch``, ``nccl_version``, ``backend``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from lagom_megatron.engine.nccl_env_check import check_nccl_env, override_issues

Level = Literal["error", "warning"]

BLACKWELL_SM_ARCH = 100
"""Megatron-LM asks for CUDA_DEVICE_MAX_CONNECTIONS=1 only below compute capability 10.0."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of a rule.

    Attributes:
        level: "error" stops the launch; "warning" is printed only.
        rule: short rule id, e.g. ``world-size`` or ``nccl-env``.
        what: one line: what is wrong, with the values seen.
        why: what would happen and where the requirement comes from.
        fix: what to change.
    """

    level: Level
    rule: str
    what: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.level}: [{self.rule}] {self.what}\n    why: {self.why}\n    fix: {self.fix}"


@dataclass(frozen=True, slots=True)
class RunShape:
    """What the rules look at, normalised from a preset, a namespace or a dict.

    Attributes:
        args: argparse destinations -> values (Megatron-LM names).
        environ: environment of the ranks.
        world_size: ranks in the job; None = unknown (rules that need it are skipped).
        gpus_per_node: GPUs (ranks) per node; None = unknown.
        sm_arch: compute capability x 10 (90 = Hopper); None = unknown, treated as pre-Blackwell.
        nccl_version: e.g. "2.27.3"; None = unknown.
        backend: "nccl" or "gloo" (CPU: the CUDA and NCCL rules do not apply).
    """

    args: Mapping[str, Any]
    environ: Mapping[str, str]
    world_size: int | None
    gpus_per_node: int | None
    sm_arch: int | None
    nccl_version: str | None
    backend: str

    def get(self, name: str, default: Any = None) -> Any:
        value = self.args.get(name, default)
        return default if value is None else value

    @property
    def tp(self) -> int:
        return int(self.get("tensor_model_parallel_size", 1))

    @property
    def pp(self) -> int:
        return int(self.get("pipeline_model_parallel_size", 1))

    @property
    def cp(self) -> int:
        return int(self.get("context_parallel_size", 1))

    @property
    def ep(self) -> int:
        return int(self.get("expert_model_parallel_size", 1))

    @property
    def fsdp(self) -> bool:
        return bool(self.get("use_torch_fsdp2", False) or self.get("use_megatron_fsdp", False))

    @property
    def lagom(self) -> bool:
        return bool(self.get("lagom", False))


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
            world_size: int | None = None, gpus_per_node: int | None = None) -> RunShape:
    """Normalises the inputs of ``run_doctor`` into a ``RunShape``.

    A preset's ``env`` is laid over ``environ`` (the launch scripts export it before the ranks
    start) and its ``cluster`` is loaded when ``cluster`` is None. World size comes from the
    argument, the preset, ``args.world_size`` or ``WORLD_SIZE``; GPUs per node from the argument,
    the cluster, the preset's ``slurm`` section or ``LOCAL_WORLD_SIZE`` / ``SLURM_GPUS_ON_NODE``.

    Raises:
        ValueError: an unknown preset or cluster name (from the loaders), or an input type that
            is none of Preset, str, Namespace, Mapping.
    """
    from lagom_megatron.presets import Preset, load_preset

    environ = dict(os.environ if environ is None else environ)
    if isinstance(args_or_preset, (str, os.PathLike)):
        args_or_preset = load_preset(args_or_preset)
    if isinstance(args_or_preset, Preset):
        preset = args_or_preset
        args: dict[str, Any] = preset.to_args()
        environ.update(preset.env)
        world_size = world_size or preset.world_size
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
        gpus_per_node = _field(cluster, "gpus_per_node") or _int_env(
            environ, "LOCAL_WORLD_SIZE", "SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE")
    backend = _field(cluster, "backend") or "nccl"
    return RunShape(
        args=args, environ=environ, world_size=int(world_size) if world_size else None,
        gpus_per_node=int(gpus_per_node) if gpus_per_node else None,
        sm_arch=_field(cluster, "sm_arch"), nccl_version=_field(cluster, "nccl_version"),
        backend=str(backend),
    )


# ----------------------------------------------------------------------------------------------
# Rules. Each takes a RunShape and returns findings; RULES lists them in report order.

def rule_world_size(s: RunShape) -> list[Finding]:
    """world size = TP x PP x CP x DP; experts: world divisible by ETP x EP x PP."""
    out = []
    if s.world_size is None:
        return out
    model_parallel = s.tp * s.pp * s.cp
    if s.world_size % model_parallel:
        out.append(Finding(
            "error", "world-size",
            f"world size {s.world_size} is not divisible by TP x PP x CP = {s.tp} x {s.pp} x {s.cp} = {model_parallel}",
            "Megatron-LM builds world = TP x PP x CP x DP and fails at initialize_model_parallel",
            f"use a world size that is a multiple of {model_parallel}, or change TP/PP/CP",
        ))
        return out
    etp = int(s.get("expert_tensor_parallel_size", s.tp))
    if s.ep > 1 and s.world_size % (etp * s.ep * s.pp):
        out.append(Finding(
            "error", "world-size",
            f"world size {s.world_size} is not divisible by ETP x EP x PP = {etp} x {s.ep} x {s.pp} = {etp * s.ep * s.pp}",
            "the expert layout (expert tensor x expert x pipeline x expert data parallel) must tile "
            "the world (megatron/core/parallel_state.py)",
            "change EP or expert TP so that ETP x EP x PP divides the world size",
        ))
    return out


def rule_batch(s: RunShape) -> list[Finding]:
    """global batch = micro-batch x accumulation steps x DP."""
    gbs, mbs = s.get("global_batch_size"), int(s.get("micro_batch_size", 1))
    if s.world_size is None or gbs is None or s.world_size % (s.tp * s.pp * s.cp):
        return []
    dp = s.world_size // (s.tp * s.pp * s.cp)
    if int(gbs) % (mbs * dp):
        return [Finding(
            "error", "batch",
            f"global batch {gbs} is not divisible by micro-batch x DP = {mbs} x {dp} = {mbs * dp}",
            "Megatron-LM's micro-batch calculator needs global batch = micro-batch x accumulation "
            "steps x DP",
            f"use a global batch that is a multiple of {mbs * dp}",
        )]
    return []


def rule_heads(s: RunShape) -> list[Finding]:
    """Attention heads and query groups must split evenly over TP."""
    out = []
    heads = s.get("num_attention_heads")
    groups = s.get("num_query_groups")
    if s.args.get("group_query_attention") is False:
        groups = None  # Megatron-LM's parse_args defaults num_query_groups to 1 and ignores it then
    if heads is not None and int(heads) % s.tp:
        out.append(Finding(
            "error", "heads-tp",
            f"num_attention_heads ({heads}) is not a multiple of tensor_model_parallel_size ({s.tp})",
            "each tensor-parallel rank holds whole attention heads (TransformerConfig raises)",
            "pick a TP that divides the number of heads",
        ))
    if groups is not None:
        if int(groups) % s.tp:
            out.append(Finding(
                "error", "query-groups-tp",
                f"num_query_groups ({groups}) is not a multiple of tensor_model_parallel_size ({s.tp})",
                "each tensor-parallel rank holds whole key/value groups (Megatron-LM validate_args)",
                "pick a TP that divides the number of query groups",
            ))
        if heads is not None and int(heads) % int(groups):
            out.append(Finding(
                "error", "query-groups-tp",
                f"num_attention_heads ({heads}) is not a multiple of num_query_groups ({groups})",
                "grouped-query attention shares each key/value group among a whole number of heads",
                "use a number of query groups that divides the number of heads",
            ))
    return out


def rule_layers(s: RunShape) -> list[Finding]:
    """Layers vs PP and virtual pipeline stages."""
    out = []
    layers = s.get("num_layers")
    per_vstage = s.get("num_layers_per_virtual_pipeline_stage")
    vstages = s.get("num_virtual_stages_per_pipeline_rank")
    if per_vstage is not None and vstages is not None:
        out.append(Finding(
            "error", "virtual-stages",
            f"both num_layers_per_virtual_pipeline_stage ({per_vstage}) and "
            f"num_virtual_stages_per_pipeline_rank ({vstages}) are set",
            "Megatron-LM accepts at most one way of giving the interleaved schedule",
            "keep one of the two",
        ))
        return out
    if (per_vstage is not None or vstages is not None) and s.pp == 1:
        out.append(Finding(
            "error", "virtual-stages",
            "virtual pipeline stages are set with pipeline_model_parallel_size 1",
            "the interleaved schedule needs pipeline parallelism (Megatron-LM validate_args)",
            "set pipeline_model_parallel_size > 1 or drop the virtual stages",
        ))
        return out
    if layers is None:
        return out
    layers = int(layers)
    if layers % s.pp:
        out.append(Finding(
            "error", "layers-pp",
            f"num_layers ({layers}) is not divisible by pipeline_model_parallel_size ({s.pp})",
            "each pipeline stage holds the same number of layers (Megatron-LM validate_args)",
            "pick a PP that divides the number of layers",
        ))
        return out
    per_rank = layers // s.pp
    if per_vstage is not None and per_rank % int(per_vstage):
        out.append(Finding(
            "error", "virtual-stages",
            f"layers per pipeline rank ({layers} / {s.pp} = {per_rank}) is not divisible by "
            f"num_layers_per_virtual_pipeline_stage ({per_vstage})",
            "each virtual stage (model chunk) holds the same number of layers",
            f"use a divisor of {per_rank} layers per virtual stage",
        ))
    if vstages is not None and per_rank % int(vstages):
        out.append(Finding(
            "error", "virtual-stages",
            f"layers per pipeline rank ({layers} / {s.pp} = {per_rank}) is not divisible by "
            f"num_virtual_stages_per_pipeline_rank ({vstages})",
            "each virtual stage (model chunk) holds the same number of layers",
            f"use a divisor of {per_rank} as the number of virtual stages",
        ))
    return out


def rule_experts(s: RunShape) -> list[Finding]:
    """Experts vs expert parallelism."""
    experts = s.get("num_experts")
    if s.ep > 1 and experts is None:
        return [Finding(
            "error", "experts-ep",
            f"expert_model_parallel_size is {s.ep} but the model has no experts (num_experts unset)",
            "Megatron-LM requires num_experts for expert parallelism",
            "set num_experts or use expert_model_parallel_size 1",
        )]
    if experts is not None and int(experts) % s.ep:
        return [Finding(
            "error", "experts-ep",
            f"num_experts ({experts}) is not a multiple of expert_model_parallel_size ({s.ep})",
            "each expert-parallel rank holds the same number of whole experts",
            "pick an EP that divides the number of experts",
        )]
    return []


def rule_sequence(s: RunShape) -> list[Finding]:
    """Sequence parallelism and context parallelism vs the sequence length."""
    out = []
    seq = s.get("seq_length")
    if s.get("sequence_parallel", False) and s.tp == 1:
        out.append(Finding(
            "warning", "sequence-parallel",
            "sequence_parallel is set with tensor_model_parallel_size 1",
            "Megatron-LM turns sequence parallelism off when TP is 1: there is nothing to shard",
            "drop sequence_parallel, or use TP > 1",
        ))
    elif s.get("sequence_parallel", False) and seq is not None and int(seq) % s.tp:
        out.append(Finding(
            "error", "sequence-parallel",
            f"seq_length ({seq}) is not divisible by tensor_model_parallel_size ({s.tp}) with sequence parallelism",
            "sequence parallelism splits the sequence dimension over the TP ranks",
            f"use a sequence length that is a multiple of {s.tp}",
        ))
    if s.cp > 1 and seq is not None and int(seq) % (2 * s.cp):
        out.append(Finding(
            "error", "context-parallel",
            f"seq_length ({seq}) is not divisible by 2 x context_parallel_size = {2 * s.cp}",
            "load-balanced context parallelism cuts the sequence into 2 x CP chunks "
            "(megatron.core.utils.get_batch_on_this_cp_rank)",
            f"use a sequence length that is a multiple of {2 * s.cp}",
        ))
    return out


def rule_tp_comm_overlap(s: RunShape) -> list[Finding]:
    """--tp-comm-overlap needs sequence parallelism and a TP group inside one node."""
    if not s.get("tp_comm_overlap", False):
        return []
    out = []
    if s.backend == "gloo":
        out.append(Finding(
            "error", "tp-comm-overlap", "tp_comm_overlap is set on a CPU (gloo) cluster",
            "TP communication/GEMM overlap is Transformer Engine's Userbuffers, which needs CUDA",
            "drop tp_comm_overlap on CPU",
        ))
        return out
    if s.tp == 1:
        out.append(Finding(
            "warning", "tp-comm-overlap", "tp_comm_overlap is set with tensor_model_parallel_size 1",
            "there is no tensor-parallel communication to overlap",
            "drop tp_comm_overlap or use TP > 1",
        ))
        return out
    if not s.get("sequence_parallel", False):
        out.append(Finding(
            "error", "tp-comm-overlap", "tp_comm_overlap is set without sequence_parallel",
            "Megatron-LM: 'Tensor parallel communication/GEMM overlap can happen only when "
            "sequence parallelism is enabled'",
            "add --sequence-parallel or drop --tp-comm-overlap",
        ))
    if s.gpus_per_node is not None and s.tp > s.gpus_per_node:
        out.append(Finding(
            "error", "tp-comm-overlap",
            f"tp_comm_overlap with TP {s.tp} larger than the {s.gpus_per_node} GPUs of a node",
            "Userbuffers overlap works only inside one NVLink domain; a TP group spanning nodes "
            "fails at IPC/multicast initialisation (TransformerEngine issues 966, 1071)",
            f"use TP <= {s.gpus_per_node} or drop --tp-comm-overlap",
        ))
    return out


def rule_overlap_param_gather(s: RunShape) -> list[Finding]:
    """--overlap-param-gather needs the distributed optimizer and --overlap-grad-reduce."""
    out = []
    if s.get("overlap_param_gather", False):
        if not (s.get("use_distributed_optimizer", False) or s.get("use_megatron_fsdp", False)):
            out.append(Finding(
                "error", "overlap-param-gather",
                "overlap_param_gather is set without use_distributed_optimizer",
                "parameters are all-gathered only when the optimizer state is sharded "
                "(Megatron-LM validate_args asserts --use-distributed-optimizer)",
                "add --use-distributed-optimizer or drop --overlap-param-gather",
            ))
        if not s.get("overlap_grad_reduce", False):
            out.append(Finding(
                "error", "overlap-param-gather",
                "overlap_param_gather is set without overlap_grad_reduce",
                "Megatron-LM validate_args asserts --overlap-grad-reduce with --overlap-param-gather",
                "add --overlap-grad-reduce",
            ))
    if s.get("overlap_param_gather_with_optimizer_step", False):
        interleaved = s.get("num_layers_per_virtual_pipeline_stage") or s.get("num_virtual_stages_per_pipeline_rank")
        if not (s.get("overlap_param_gather", False) and s.get("use_distributed_optimizer", False) and interleaved):
            out.append(Finding(
                "error", "overlap-param-gather",
                "overlap_param_gather_with_optimizer_step needs overlap_param_gather, the "
                "distributed optimizer and an interleaved pipeline",
                "Megatron-LM validate_args asserts all three",
                "add the missing flags or drop --overlap-param-gather-with-optimizer-step",
            ))
    return out


def rule_ddp_bucket_size(s: RunShape) -> list[Finding]:
    """--ddp-bucket-size: a positive number of parameters, used only with overlap_grad_reduce."""
    size = s.args.get("ddp_bucket_size")
    if size is None:
        return []
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        return [Finding(
            "error", "ddp-bucket-size", f"ddp_bucket_size {size!r} is not a positive integer",
            "the bucket size counts parameters; a bool passes as an int and silently disables "
            "bucketing (NVIDIA recsys-examples PR 374)",
            "give a positive number of parameters, e.g. 40000000",
        )]
    if not s.get("overlap_grad_reduce", False):
        return [Finding(
            "warning", "ddp-bucket-size", f"ddp_bucket_size {size} is set without overlap_grad_reduce",
            "Megatron-Core uses one bucket when gradients are not reduced during backward",
            "add --overlap-grad-reduce or drop --ddp-bucket-size",
        )]
    return []


def rule_cuda_device_max_connections(s: RunShape) -> list[Finding]:
    """CUDA_DEVICE_MAX_CONNECTIONS: 1 with TP or CP > 1 before Blackwell without FSDP; not 1 with FSDP."""
    if s.backend == "gloo":
        return []
    cdmc = s.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    pre_blackwell = s.sm_arch is None or int(s.sm_arch) < BLACKWELL_SM_ARCH
    arch = f"sm_{s.sm_arch}" if s.sm_arch is not None else "an unknown GPU (taken as pre-Blackwell)"
    if s.fsdp:
        if cdmc == "1":
            return [Finding(
                "error", "cuda-device-max-connections",
                "CUDA_DEVICE_MAX_CONNECTIONS=1 with FSDP",
                "FSDP2 and Megatron-FSDP need several hardware queues to overlap their all-gathers "
                "and reduce-scatters; Megatron-LM asserts it is not 1",
                "unset CUDA_DEVICE_MAX_CONNECTIONS (or set it to 32)",
            )]
        return []
    if (s.tp > 1 or s.cp > 1) and pre_blackwell and cdmc != "1":
        return [Finding(
            "error", "cuda-device-max-connections",
            f"CUDA_DEVICE_MAX_CONNECTIONS is {cdmc!r} with TP {s.tp}, CP {s.cp} on {arch}",
            "Megatron-LM asserts 'Using tensor model parallelism or context parallelism require "
            "setting the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1': with one hardware "
            "queue, TP/CP communication kernels are issued before the compute they overlap",
            "export CUDA_DEVICE_MAX_CONNECTIONS=1 (the preset's env does this)",
        )]
    out = []
    if cdmc == "1" and s.tp == 1 and s.cp == 1 and (
            s.get("overlap_grad_reduce", False) or s.get("overlap_param_gather", False)):
        out.append(Finding(
            "warning", "cuda-device-max-connections",
            "CUDA_DEVICE_MAX_CONNECTIONS=1 with TP = CP = 1 and overlapped data-parallel communication",
            "one hardware queue serialises the gradient/parameter collectives with compute, so "
            "there is no overlap for lagom to tune (Megatron-LM issue 1468)",
            "unset CUDA_DEVICE_MAX_CONNECTIONS",
        ))
    if cdmc == "1" and s.get("overlap_moe_expert_parallel_comm", False):
        out.append(Finding(
            "warning", "cuda-device-max-connections",
            "CUDA_DEVICE_MAX_CONNECTIONS=1 with overlap_moe_expert_parallel_comm",
            "expert-parallel all-to-all overlap needs several queues; 32 doubled the measured gain "
            "(Megatron-LM PR 6311)",
            "export CUDA_DEVICE_MAX_CONNECTIONS=32",
        ))
    return out


def rule_nccl_env(s: RunShape) -> list[Finding]:
    """NCCL variables outside NCCL's domains (``engine.nccl_env_check.check_nccl_env``)."""
    if s.backend == "gloo":
        return []
    return [Finding(i.level, "nccl-env", i.what, i.why, i.fix)
            for i in check_nccl_env(s.environ, nccl_version=s.nccl_version)]


def rule_nccl_overrides(s: RunShape) -> list[Finding]:
    """With --lagom: NCCL variables that silently override lagom's choices."""
    if s.backend == "gloo" or not s.lagom:
        return []
    return [Finding(i.level, "nccl-override", i.what, i.why, i.fix) for i in override_issues(s.environ)]


RULES: tuple[Callable[[RunShape], list[Finding]], ...] = (
    rule_world_size, rule_batch, rule_heads, rule_layers, rule_experts, rule_sequence,
    rule_tp_comm_overlap, rule_overlap_param_gather, rule_ddp_bucket_size,
    rule_cuda_device_max_connections, rule_nccl_env, rule_nccl_overrides,
)
"""Every rule, in report order."""


def run_doctor(args_or_preset: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
               world_size: int | None = None, gpus_per_node: int | None = None) -> list[Finding]:
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

    Returns:
        Findings, errors and warnings in rule order; empty = all clear.

    Raises:
        ValueError: unknown preset or cluster, or an unsupported input type.
    """
    shape = resolve(args_or_preset, environ, cluster, world_size=world_size, gpus_per_node=gpus_per_node)
    findings: list[Finding] = []
    for rule in RULES:
        findings.extend(rule(shape))
    return findings


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
    import torch

    environ = os.environ if environ is None else environ
    if environ.get("LAGOM_CLUSTER"):
        return _load_cluster(environ["LAGOM_CLUSTER"])
    if not torch.cuda.is_available():
        return _load_cluster("cpu-gloo")
    if preset_name:
        from lagom_megatron.presets import load_preset

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
