"""The overlap rules: the flags that decide which collectives overlap compute, so what lagom tunes (TP comm
overlap, param gather, DDP buckets, FSDP sharding, MoE overlap); line numbers: Megatron-LM core_v0.16.1
``megatron/training/arguments.py``, megatron-core 0.16.1."""

from __future__ import annotations

from lagom_megatron.preflight.types import Finding, RunShape


def rule_tp_comm_overlap(s: RunShape) -> list[Finding]:
    """--tp-comm-overlap needs sequence parallelism and a TP group inside one node."""
    if not s.get("tp_comm_overlap", False):
        return []
    out = []
    if s.backend == "gloo":
        out.append(
            Finding(
                "error",
                "tp-comm-overlap",
                "--tp-comm-overlap is set on a CPU (gloo) cluster; it needs CUDA",
                "TP communication/GEMM overlap is Transformer Engine's Userbuffers, which needs CUDA",
                "drop tp_comm_overlap on CPU",
            )
        )
        return out
    if s.tp == 1:
        out.append(
            Finding(
                "warning",
                "tp-comm-overlap",
                "--tp-comm-overlap is set with --tensor-model-parallel-size 1",
                "there is no tensor-parallel communication to overlap",
                "drop tp_comm_overlap or use TP > 1",
            )
        )
        return out
    if not s.get("sequence_parallel", False):
        out.append(
            Finding(
                "error",
                "tp-comm-overlap",
                "--tp-comm-overlap needs --sequence-parallel",
                "Megatron-LM: 'Tensor parallel communication/GEMM overlap can happen only when "
                "sequence parallelism is enabled'",
                "add --sequence-parallel or drop --tp-comm-overlap",
            )
        )
    if s.gpus_per_node is not None and s.gpus_per_node >= 1 and s.tp > s.gpus_per_node:
        out.append(
            Finding(
                "error",
                "tp-comm-overlap",
                f"--tp-comm-overlap with --tensor-model-parallel-size {s.tp} larger than the {s.gpus_per_node} GPUs of a node",
                "Userbuffers overlap works only inside one NVLink domain; a TP group spanning nodes "
                "fails at IPC/multicast initialisation (TransformerEngine issues 966, 1071)",
                f"use TP <= {s.gpus_per_node} or drop --tp-comm-overlap",
            )
        )
    return out


def rule_overlap_param_gather(s: RunShape) -> list[Finding]:
    """--overlap-param-gather needs the distributed optimizer and --overlap-grad-reduce."""
    out = []
    if s.get("overlap_param_gather", False):
        if not (s.get("use_distributed_optimizer", False) or s.get("use_megatron_fsdp", False)):
            out.append(
                Finding(
                    "error",
                    "overlap-param-gather",
                    "--overlap-param-gather needs --use-distributed-optimizer",
                    "parameters are all-gathered only when the optimizer state is sharded "
                    "(Megatron-LM validate_args asserts --use-distributed-optimizer)",
                    "add --use-distributed-optimizer or drop --overlap-param-gather",
                )
            )
        if not s.get("overlap_grad_reduce", False):
            out.append(
                Finding(
                    "error",
                    "overlap-param-gather",
                    "--overlap-param-gather needs --overlap-grad-reduce",
                    "Megatron-LM validate_args asserts --overlap-grad-reduce with --overlap-param-gather",
                    "add --overlap-grad-reduce",
                )
            )
    if s.get("overlap_param_gather_with_optimizer_step", False):
        interleaved = s.get("num_layers_per_virtual_pipeline_stage") or s.get("num_virtual_stages_per_pipeline_rank")
        if not (s.get("overlap_param_gather", False) and s.get("use_distributed_optimizer", False) and interleaved):
            out.append(
                Finding(
                    "error",
                    "overlap-param-gather",
                    "overlap_param_gather_with_optimizer_step needs overlap_param_gather, the "
                    "distributed optimizer and an interleaved pipeline",
                    "Megatron-LM validate_args asserts all three",
                    "add the missing flags or drop --overlap-param-gather-with-optimizer-step",
                )
            )
    return out


def rule_ddp_bucket_size(s: RunShape) -> list[Finding]:
    """--ddp-bucket-size: a positive number of parameters, used only with overlap_grad_reduce."""
    size = s.args.get("ddp_bucket_size")
    if size is None:
        return []
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        return [
            Finding(
                "error",
                "ddp-bucket-size",
                f"--ddp-bucket-size {size!r} is not a positive integer; allowed: a number of parameters >= 1",
                "the bucket size counts parameters; megatron-core does not check it (distributed_data_parallel.py:64: "
                "a negative size silently gives one bucket per parameter) and a bool passes as an int and silently "
                "disables bucketing (NVIDIA recsys-examples PR 374)",
                "give a positive number of parameters, e.g. 40000000",
            )
        ]
    if not s.get("overlap_grad_reduce", False):
        return [
            Finding(
                "warning",
                "ddp-bucket-size",
                f"--ddp-bucket-size {size} is set without --overlap-grad-reduce",
                "Megatron-Core uses one bucket when gradients are not reduced during backward",
                "add --overlap-grad-reduce or drop --ddp-bucket-size",
            )
        ]
    return []


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Choices of arguments.py:2307-2309 (same in core_v0.17.1, core_v0.18.2); Megatron-FSDP raises on any other
(megatron-core 0.16.1 ``megatron_fsdp/param_and_grad_buffer.py:1865-1868``)."""


def no_shard_finding(origin: str = "") -> Finding:
    """The warning for Megatron-FSDP sharding nothing (``origin``: where no_shard came from; sources in ``why``)."""
    return Finding(
        "warning",
        "fsdp-sharding",
        f"--use-megatron-fsdp with --data-parallel-sharding-strategy no_shard{origin}",
        "Megatron-FSDP then shards nothing: no parameter gathers, every gradient bucket all-reduced in the last "
        "micro-batch as Megatron-Core's DDP does, through its own hooks and buffers (extra cost, no memory saved; "
        "megatron_fsdp.py:425-426, 656-662, param_and_grad_buffer.py:3224-3230)",
        "add --data-parallel-sharding-strategy optim_grads_params (ZeRO-3), or drop --use-megatron-fsdp",
    )


def rule_fsdp_sharding(s: RunShape) -> list[Finding]:
    """``--data-parallel-sharding-strategy`` in SHARDING_STRATEGIES; warns on no_shard with FSDP, and without FSDP on
    a strategy that is not the parser's default (Megatron-LM's is optim_grads_params from core_v0.18: ``arguments.py
    :2805`` @core_v0.18.2, ``:3023`` @core_v0.19.0, ``:3190`` @main; ours no_shard)."""
    strategy = s.args.get("data_parallel_sharding_strategy")
    if strategy is None:
        return []
    if strategy not in SHARDING_STRATEGIES:
        return [
            Finding(
                "error",
                "fsdp-sharding",
                f"--data-parallel-sharding-strategy {strategy!r} is not one of {', '.join(SHARDING_STRATEGIES)}",
                "Megatron-LM's parser allows only these (arguments.py:2307-2309); "
                "Megatron-FSDP raises on any other (param_and_grad_buffer.py:1865-1868)",
                "use optim_grads_params for ZeRO-3 (parameters, gradients and optimizer state sharded)",
            )
        ]
    if s.get("use_megatron_fsdp", False):
        return [no_shard_finding()] if strategy == "no_shard" else []
    if strategy == "no_shard" or strategy == s.defaults.get("data_parallel_sharding_strategy"):
        return []
    return [
        Finding(
            "warning",
            "fsdp-sharding",
            f"--data-parallel-sharding-strategy {strategy} without --use-megatron-fsdp",
            "only Megatron-FSDP reads it: Megatron-Core's DDP and torch FSDP2 ignore it, so nothing is sharded "
            "beyond what --use-distributed-optimizer shards",
            "add --use-megatron-fsdp, or drop the flag",
        )
    ]


def _vpp(s: RunShape) -> bool:
    """An interleaved (virtual) pipeline is asked for (arguments.py:520-557)."""
    per = s.get("num_layers_per_virtual_pipeline_stage")
    n = s.get("num_virtual_stages_per_pipeline_rank")
    if n is not None:
        return int(n) > 1
    if per is not None and s.get("num_layers") is not None and s.pp > 0:
        return (int(s.get("num_layers")) // s.pp) // max(int(per), 1) > 1
    return bool(s.get("pipeline_model_parallel_layout"))


def rule_moe_overlap(s: RunShape) -> list[Finding]:
    """``--overlap-moe-expert-parallel-comm``: transformer_config.py:1852-1892's asserts, before process groups."""
    if not s.get("overlap_moe_expert_parallel_comm", False):
        return []
    flag = "--overlap-moe-expert-parallel-comm"
    why = "megatron-core 0.16.1 asserts it in TransformerConfig.__post_init__ (transformer_config.py:1852-1892)"
    problems = []
    if s.get("num_experts") is None:
        problems.append(
            (
                f"{flag} is set but the model has no experts (--num-experts unset)",
                "add --num-experts and --expert-model-parallel-size > 1, or drop the flag",
            )
        )
    if s.ep <= 1:
        problems.append(
            (
                f"{flag} needs --expert-model-parallel-size > 1; got {s.ep}",
                "use expert parallelism (EP > 1) or drop the flag",
            )
        )
    dispatcher = s.get("moe_token_dispatcher_type", "allgather")
    if dispatcher not in ("alltoall", "flex"):
        problems.append(
            (
                f"{flag} needs --moe-token-dispatcher-type alltoall or flex; got {dispatcher!r}",
                "pass --moe-token-dispatcher-type alltoall",
            )
        )
    if s.get("moe_shared_expert_overlap", False):
        problems.append((f"{flag} cannot be combined with --moe-shared-expert-overlap", "drop one of the two"))
    if not (s.get("bf16", False) or s.get("fp16", False)):
        problems.append((f"{flag} needs --bf16 or --fp16 (the model is fp32)", "add --bf16"))
    if (
        s.get("recompute_granularity") == "full"
        or s.get("recompute_method") is not None
        or s.get("recompute_num_layers") is not None
    ):
        problems.append(
            (
                f"{flag} cannot be combined with full recomputation (--recompute-granularity full, "
                "--recompute-method, --recompute-num-layers)",
                "drop the recomputation flags",
            )
        )
    if s.pp > 1 and not _vpp(s):
        problems.append(
            (
                f"{flag} with --pipeline-model-parallel-size {s.pp} needs a virtual pipeline",
                "add --num-virtual-stages-per-pipeline-rank N (N > 1)",
            )
        )
    return [Finding("error", "moe-overlap", what, why, fix) for what, fix in problems]
