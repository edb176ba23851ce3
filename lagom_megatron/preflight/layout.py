"""The layout rules: sizes, world, batch, heads, layers, experts, sequence, uneven pipelines (Megatron-LM's
``validate_args``); line numbers: Megatron-LM core_v0.16.1 ``megatron/training/arguments.py``, megatron-core 0.16.1
``transformer_config.py``."""

from __future__ import annotations

from lagom_megatron.preflight.types import Finding, RunShape, flag

POSITIVE_INTEGERS: tuple[tuple[str, str], ...] = (
    ("tensor_model_parallel_size", "world = TP x PP x CP x DP (arguments.py:317)"),
    ("pipeline_model_parallel_size", "world = TP x PP x CP x DP (arguments.py:317)"),
    ("context_parallel_size", "world = TP x PP x CP x DP (arguments.py:317)"),
    ("expert_model_parallel_size", "experts are split over EP ranks (parallel_state.initialize_model_parallel)"),
    ("expert_tensor_parallel_size", "expert layout ETP x EP x PP tiles the world (parallel_state)"),
    ("micro_batch_size", "arguments.py:496 asserts micro_batch_size > 0"),
    ("global_batch_size", "arguments.py:500 asserts global_batch_size > 0"),
    ("num_layers", "the model needs at least one layer (transformer_config.py __post_init__)"),
    ("hidden_size", "transformer_config.py divides by it"),
    ("num_attention_heads", "transformer_config.py divides hidden size by it"),
    ("num_query_groups", "transformer_config.py:940 takes it modulo TP"),
    ("num_experts", "each expert-parallel rank holds num_experts / EP experts"),
    ("num_layers_per_virtual_pipeline_stage", "arguments.py:547 divides layers per stage by it"),
    ("num_virtual_stages_per_pipeline_rank", "it becomes the virtual pipeline size (arguments.py:552)"),
    ("decoder_first_pipeline_num_layers", "transformer_config.py:1368 requires > 0"),
    ("decoder_last_pipeline_num_layers", "transformer_config.py:1387 requires > 0"),
    ("seq_length", "every sample has seq_length tokens"),
    ("train_iters", "the run trains train_iters iterations"),
    ("log_interval", "iterations are logged every log_interval (taken modulo)"),
    ("moe_router_topk", "each token goes to moe_router_topk experts"),
)
"""(argparse destination, why) of flags that must be positive integers when given."""


def rule_positive(s: RunShape) -> list[Finding]:
    """Every size of :data:`POSITIVE_INTEGERS` that is given is an integer >= 1 (not a bool)."""
    out = []
    for dest, why in POSITIVE_INTEGERS:
        value = s.args.get(dest)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            out.append(
                Finding(
                    "error",
                    "positive",
                    f"{flag(dest)} must be a positive integer; got {value!r}",
                    why,
                    f"give {flag(dest)} an integer >= 1 (or leave it out for the default)",
                )
            )
    return out


def rule_nodes(s: RunShape) -> list[Finding]:
    """World size >= 1, GPUs per node >= 1; on GPUs, whole nodes and TP groups that do not straddle nodes."""
    out = []
    if s.world_size is not None and s.world_size < 1:
        out.append(
            Finding(
                "error",
                "world-size",
                f"world size {s.world_size} is not a positive integer",
                "the job needs at least one rank; torchrun and Megatron-LM refuse a world size below 1",
                "give the number of ranks (nodes x GPUs per node), e.g. --world-size 64",
            )
        )
    if s.gpus_per_node is not None and s.gpus_per_node < 1:
        out.append(
            Finding(
                "error",
                "gpus-per-node",
                f"GPUs per node {s.gpus_per_node} is not a positive integer",
                "every node runs at least one rank; the layout checks divide by the GPUs per node",
                "give the GPUs (ranks) of one node, e.g. --gpus-per-node 8",
            )
        )
    if out or s.world_size is None or s.gpus_per_node is None or s.backend == "gloo":
        return out  # gloo: CPU processes on one host; the cluster's GPUs per node are nominal
    gpn = s.gpus_per_node
    if s.world_size > gpn and s.world_size % gpn:
        out.append(
            Finding(
                "error",
                "gpus-per-node",
                f"world size {s.world_size} is not a multiple of the {gpn} GPUs per node",
                "SLURM and torchrun start the same number of ranks on every node, so a job spans whole "
                "nodes: nodes x GPUs per node = world size",
                f"use a world size that is a multiple of {gpn}, or fix --gpus-per-node",
            )
        )
    tp = s.tp
    if tp > 1 and ((tp <= gpn and gpn % tp) or (tp > gpn and tp % gpn)):
        out.append(
            Finding(
                "error",
                "tp-node",
                f"--tensor-model-parallel-size {tp} does not tile the {gpn} GPUs of a node",
                "Megatron-LM puts consecutive ranks in a TP group; unless the GPUs per node are a multiple "
                "of TP, some TP groups straddle two nodes and their per-layer collectives silently go "
                "over the network instead of NVLink",
                f"use a TP that divides {gpn} (or a multiple of {gpn}), or fix --gpus-per-node",
            )
        )
    return out


def rule_world_size(s: RunShape) -> list[Finding]:
    """world size = TP x PP x CP x DP; experts: world divisible by ETP x EP x PP."""
    out = []
    if s.world_size is None or s.world_size < 1:
        return out
    model_parallel = s.tp * s.pp * s.cp
    if s.world_size % model_parallel:
        out.append(
            Finding(
                "error",
                "world-size",
                f"world size {s.world_size} is not divisible by TP x PP x CP = {s.tp} x {s.pp} x {s.cp} = {model_parallel}",
                "Megatron-LM builds world = TP x PP x CP x DP and fails at initialize_model_parallel",
                f"use a world size that is a multiple of {model_parallel}, or change TP/PP/CP",
            )
        )
        return out
    etp = int(s.get("expert_tensor_parallel_size", s.tp))
    if s.ep > 1 and s.world_size % (etp * s.ep * s.pp):
        out.append(
            Finding(
                "error",
                "world-size",
                f"world size {s.world_size} is not divisible by ETP x EP x PP = {etp} x {s.ep} x {s.pp} = {etp * s.ep * s.pp}",
                "the expert layout (expert tensor x expert x pipeline x expert data parallel) must tile "
                "the world (megatron/core/parallel_state.py)",
                "change EP or expert TP so that ETP x EP x PP divides the world size",
            )
        )
    return out


def rule_batch(s: RunShape) -> list[Finding]:
    """global batch = micro-batch x accumulation steps x DP."""
    gbs, mbs = s.get("global_batch_size"), int(s.get("micro_batch_size", 1))
    if s.world_size is None or s.world_size < 1 or gbs is None or s.world_size % (s.tp * s.pp * s.cp):
        return []
    dp = s.world_size // (s.tp * s.pp * s.cp)
    if int(gbs) % (mbs * dp):
        return [
            Finding(
                "error",
                "batch",
                f"global batch {gbs} is not divisible by micro-batch x DP = {mbs} x {dp} = {mbs * dp}",
                "Megatron-LM's micro-batch calculator needs global batch = micro-batch x accumulation steps x DP",
                f"use a global batch that is a multiple of {mbs * dp}",
            )
        ]
    return []


def rule_heads(s: RunShape) -> list[Finding]:
    """Attention heads and query groups must split evenly over TP."""
    out = []
    heads = s.get("num_attention_heads")
    groups = s.get("num_query_groups")
    if s.args.get("group_query_attention") is False:
        groups = None  # Megatron-LM's parse_args defaults num_query_groups to 1 and ignores it then
    if heads is not None and int(heads) % s.tp:
        out.append(
            Finding(
                "error",
                "heads-tp",
                f"--num-attention-heads {heads} is not a multiple of --tensor-model-parallel-size {s.tp}",
                "each tensor-parallel rank holds whole attention heads (TransformerConfig raises)",
                "pick a TP that divides the number of heads",
            )
        )
    if groups is not None:
        if int(groups) % s.tp and s.tp % int(groups):
            out.append(
                Finding(
                    "error",
                    "query-groups-tp",
                    f"--num-query-groups {groups} is neither a multiple nor a divisor of "
                    f"--tensor-model-parallel-size {s.tp}",
                    "each tensor-parallel rank holds whole key/value groups, or a group is replicated over "
                    "TP / groups ranks (transformer_config.py:939-946)",
                    "use a number of query groups that is a multiple or a divisor of TP",
                )
            )
        if heads is not None and int(heads) % int(groups):
            out.append(
                Finding(
                    "error",
                    "query-groups-tp",
                    f"--num-attention-heads {heads} is not a multiple of --num-query-groups {groups}",
                    "grouped-query attention shares each key/value group among a whole number of heads",
                    "use a number of query groups that divides the number of heads",
                )
            )
    return out


def rule_layers(s: RunShape) -> list[Finding]:
    """Layers vs PP and virtual pipeline stages."""
    out = []
    layers = s.get("num_layers")
    per_vstage = s.get("num_layers_per_virtual_pipeline_stage")
    vstages = s.get("num_virtual_stages_per_pipeline_rank")
    if per_vstage is not None and vstages is not None:
        out.append(
            Finding(
                "error",
                "virtual-stages",
                f"both --num-layers-per-virtual-pipeline-stage {per_vstage} and "
                f"--num-virtual-stages-per-pipeline-rank {vstages} are set; allowed: one of them",
                "Megatron-LM accepts at most one way of giving the interleaved schedule",
                "keep one of the two",
            )
        )
        return out
    if (per_vstage is not None or vstages is not None) and s.pp == 1:
        out.append(
            Finding(
                "error",
                "virtual-stages",
                "virtual pipeline stages are set with --pipeline-model-parallel-size 1; allowed: PP > 1",
                "the interleaved schedule needs pipeline parallelism (Megatron-LM validate_args)",
                "set pipeline_model_parallel_size > 1 or drop the virtual stages",
            )
        )
        return out
    if layers is None:
        return out
    layers = int(layers)
    if s.get("decoder_first_pipeline_num_layers") is not None or s.get("decoder_last_pipeline_num_layers") is not None:
        return out  # an uneven split: rule_uneven_pipeline checks it (arguments.py:558)
    if layers % s.pp:
        out.append(
            Finding(
                "error",
                "layers-pp",
                f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {s.pp}",
                "each pipeline stage holds the same number of layers (Megatron-LM validate_args)",
                "pick a PP that divides the number of layers",
            )
        )
        return out
    per_rank = layers // s.pp
    if per_vstage is not None and per_rank % int(per_vstage):
        out.append(
            Finding(
                "error",
                "virtual-stages",
                f"layers per pipeline rank ({layers} / {s.pp} = {per_rank}) is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {per_vstage}",
                "each virtual stage (model chunk) holds the same number of layers",
                f"use a divisor of {per_rank} layers per virtual stage",
            )
        )
    if vstages is not None and per_rank % int(vstages):
        out.append(
            Finding(
                "error",
                "virtual-stages",
                f"layers per pipeline rank ({layers} / {s.pp} = {per_rank}) is not divisible by "
                f"--num-virtual-stages-per-pipeline-rank {vstages}",
                "each virtual stage (model chunk) holds the same number of layers",
                f"use a divisor of {per_rank} as the number of virtual stages",
            )
        )
    return out


def rule_experts(s: RunShape) -> list[Finding]:
    """Experts vs expert parallelism."""
    experts = s.get("num_experts")
    if s.ep > 1 and experts is None:
        return [
            Finding(
                "error",
                "experts-ep",
                f"--expert-model-parallel-size {s.ep} needs experts (--num-experts unset)",
                "Megatron-LM requires num_experts for expert parallelism",
                "set num_experts or use expert_model_parallel_size 1",
            )
        ]
    if experts is not None and int(experts) % s.ep:
        return [
            Finding(
                "error",
                "experts-ep",
                f"--num-experts {experts} is not a multiple of --expert-model-parallel-size {s.ep}",
                "each expert-parallel rank holds the same number of whole experts",
                "pick an EP that divides the number of experts",
            )
        ]
    return []


def rule_sequence(s: RunShape) -> list[Finding]:
    """Sequence parallelism and context parallelism vs the sequence length."""
    out = []
    seq = s.get("seq_length")
    if s.get("sequence_parallel", False) and s.tp == 1:
        out.append(
            Finding(
                "warning",
                "sequence-parallel",
                "--sequence-parallel is set with --tensor-model-parallel-size 1",
                "Megatron-LM turns sequence parallelism off when TP is 1: there is nothing to shard",
                "drop sequence_parallel, or use TP > 1",
            )
        )
    elif s.get("sequence_parallel", False) and seq is not None and int(seq) % s.tp:
        out.append(
            Finding(
                "error",
                "sequence-parallel",
                f"--seq-length {seq} is not divisible by --tensor-model-parallel-size {s.tp} (needed by --sequence-parallel)",
                "sequence parallelism splits the sequence dimension over the TP ranks",
                f"use a sequence length that is a multiple of {s.tp}",
            )
        )
    if s.cp > 1 and seq is not None and int(seq) % (2 * s.cp):
        out.append(
            Finding(
                "error",
                "context-parallel",
                f"--seq-length {seq} is not divisible by 2 x --context-parallel-size = {2 * s.cp}",
                "load-balanced context parallelism cuts the sequence into 2 x CP chunks "
                "(megatron.core.utils.get_batch_on_this_cp_rank)",
                f"use a sequence length that is a multiple of {2 * s.cp}",
            )
        )
    return out


def rule_uneven_pipeline(s: RunShape) -> list[Finding]:
    """``--decoder-first/last-pipeline-num-layers`` (transformer_config.py:1359-1430; arguments.py:530)."""
    first, last = s.get("decoder_first_pipeline_num_layers"), s.get("decoder_last_pipeline_num_layers")
    if first is None and last is None:
        return []
    layers = s.get("num_layers")
    why = "megatron-core splits the layers so (transformer_config.py:1359-1430)"
    out = []
    if s.get("num_layers_per_virtual_pipeline_stage") is not None:
        out.append(
            Finding(
                "error",
                "uneven-pipeline",
                "--decoder-first/last-pipeline-num-layers cannot be used with --num-layers-per-virtual-pipeline-stage",
                "Megatron-LM asserts it (arguments.py:530)",
                "give the virtual pipeline as --num-virtual-stages-per-pipeline-rank",
            )
        )
        return out
    if layers is None:
        return out
    remaining, stages = int(layers), s.pp
    vpp = s.get("num_virtual_stages_per_pipeline_rank")
    for name, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is None:
            continue
        if vpp is not None and int(vpp) > 1 and int(n) % int(vpp):
            out.append(
                Finding(
                    "error",
                    "uneven-pipeline",
                    f"{name} {n} is not divisible by --num-virtual-stages-per-pipeline-rank {vpp}",
                    why,
                    f"use a multiple of {vpp}",
                )
            )
        remaining -= int(n)
        stages -= 1
    if stages < 0 or remaining < 0 or bool(remaining) != bool(stages):
        out.append(
            Finding(
                "error",
                "uneven-pipeline",
                f"--num-layers {layers} with --pipeline-model-parallel-size {s.pp}, first stage {first}, last stage "
                f"{last} leaves {remaining} layers for {max(stages, 0)} middle stages",
                why,
                "the middle stages need layers if and only if there are middle stages: change the first/last "
                "stage layers or PP",
            )
        )
    elif stages and remaining % stages:
        out.append(
            Finding(
                "error",
                "uneven-pipeline",
                f"the {remaining} middle layers (--num-layers {layers} less first {first} and last {last}) are not "
                f"divisible by the {stages} middle pipeline stages",
                why,
                "change the first/last stage layers so the rest splits evenly",
            )
        )
    return out
