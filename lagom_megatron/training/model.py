"""``pretrain_gpt.py``'s ``GPTModel`` chunks in DDP. Unlike Megatron-LM's, initialisation is layout-invariant: each
layer reseeds from ``--seed`` and its global number, CPU init shards the full matrix (TP, PP, DP match one process)."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

LAYER_SEED_STRIDE = 1009
"""Seed of global layer k (1-based) = --seed + k x 1009 (a prime, so nearby seeds never collide)."""


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # also a TE build that fails to load its CUDA library
        return False
    return True


def use_transformer_engine(args: argparse.Namespace) -> bool:
    """Resolves ``--transformer-impl``; ValueError for transformer_engine without TE or a GPU."""
    if args.transformer_impl == "local":
        return False
    usable = torch.cuda.is_available() and te_available()
    if args.transformer_impl == "transformer_engine" and not usable:
        raise ValueError(
            "--transformer-impl transformer_engine needs Transformer Engine and a CUDA GPU; "
            "use --transformer-impl local"
        )
    return usable


def transformer_config(args: argparse.Namespace, *, on_gpu: bool):
    """Megatron-Core ``TransformerConfig`` from validated arguments; on CPU, fused kernels off."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    fused = (
        {}
        if on_gpu
        else dict(
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        )
    )
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=getattr(args, "kv_channels", None),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_token_dispatcher_type=getattr(args, "moe_token_dispatcher_type", "allgather"),
        moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
        add_bias_linear=getattr(args, "add_bias_linear", True),
        use_cpu_initialization=args.use_cpu_initialization or not on_gpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        tp_comm_overlap=args.tp_comm_overlap,
        overlap_p2p_comm=args.overlap_p2p_comm,
        batch_p2p_comm=not args.overlap_p2p_comm,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion and on_gpu,
        init_method_std=args.init_method_std,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        attention_backend=AttnBackend[args.attention_backend],
        # a gloo isend reads the tensor later from its own thread: freeing it after posting sends freed storage
        deallocate_pipeline_outputs=on_gpu,
        **fused,
        **_megatron_lm_fields(args, on_gpu=on_gpu),
    )


def _megatron_lm_fields(args: argparse.Namespace, *, on_gpu: bool) -> dict:
    """Fields of ``parity_flags``' flags (Megatron-LM core_v0.16.1 ``core_transformer_config_from_args``)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return dict(
        layernorm_zero_centered_gamma=get("layernorm_zero_centered_gamma", False),
        moe_ffn_hidden_size=get("moe_ffn_hidden_size") or (args.ffn_hidden_size if args.num_experts else None),
        moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
        moe_shared_expert_overlap=get("moe_shared_expert_overlap", False),
        moe_router_load_balancing_type=get("moe_router_load_balancing_type", "aux_loss"),
        moe_aux_loss_coeff=get("moe_aux_loss_coeff", 0.0),
        overlap_moe_expert_parallel_comm=get("overlap_moe_expert_parallel_comm", False),
        expert_tensor_parallel_size=get("expert_tensor_parallel_size"),
        num_layers_in_first_pipeline_stage=get("decoder_first_pipeline_num_layers"),
        num_layers_in_last_pipeline_stage=get("decoder_last_pipeline_num_layers"),
        cross_entropy_loss_fusion=get("cross_entropy_loss_fusion", False) and on_gpu,
        # FP8 in Transformer Engine's layers (argument_checks refuses it with the local ones); fp8_param as
        # Megatron-LM core_v0.16.1 arguments.py:1331, the rest by name (:1320-1323)
        fp8=get("fp8"),
        fp8_amax_history_len=get("fp8_amax_history_len", 1),
        fp8_amax_compute_algo=get("fp8_amax_compute_algo", "most_recent"),
        fp8_param=get("fp8_param_gather", False),
    )


def layer_spec(args: argparse.Namespace, *, use_te: bool):
    """The transformer-layer ``ModuleSpec`` (TE or local), with layout-invariant seeding."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts, moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False)
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=args.num_experts,
            moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
            normalization=args.normalization,
        )
    spec.module = seeded_layer_class(spec.module, args.seed)
    return spec


def seeded_layer_class(layer_cls: type, seed: int) -> type:
    """``layer_cls`` reseeding the CPU generator from ``seed`` and its global 1-based layer number."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    class SeededLayer(layer_cls):
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
            pg_collection = kwargs.get("pg_collection")
            pp_rank = get_pg_rank(pg_collection.pp) if pg_collection is not None else None
            global_number = layer_number + get_transformer_layer_offset(config, kwargs.get("vp_stage"), pp_rank)
            torch.manual_seed(seed + LAYER_SEED_STRIDE * global_number)
            super().__init__(config, submodules, layer_number, *args, **kwargs)

    SeededLayer.__name__ = SeededLayer.__qualname__ = layer_cls.__name__
    return SeededLayer


def ddp_config(args: argparse.Namespace, *, on_gpu: bool = True):
    """Megatron-Core's DDP (or FSDP2) config, as Megatron-LM core_v0.16.1 ``training.py:1287-1295`` builds it (its
    fields by name: ``--use-nccl-ub`` is ``nccl_ub``, only with NCCL)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if getattr(args, "use_torch_fsdp2", False):  # Megatron-LM core_v0.16.1 training.py:1287-1289
        from megatron.core.distributed import TorchFullyShardedDataParallelConfig

        return TorchFullyShardedDataParallelConfig()
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 and not getattr(args, "grad_reduce_in_bf16", False),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_megatron_fsdp=getattr(args, "use_megatron_fsdp", False),
        data_parallel_sharding_strategy=getattr(args, "data_parallel_sharding_strategy", "no_shard"),
        bucket_size=args.ddp_bucket_size,
        fp8_param_gather=getattr(args, "fp8_param_gather", False),
        nccl_ub=getattr(args, "nccl_ub", False) and on_gpu,
    )


def high_priority_stream_groups(args: argparse.Namespace, arch_major: int | None = None) -> list[str]:
    """``--high-priority-stream-groups`` and the groups Megatron-LM adds (core_v0.16.1 ``arguments.py:955-962``,
    core_v0.19.0 ``:1441-1448``): dp_cp, and ep_dp with expert parallelism, for torch FSDP2 and, on compute
    capability major >= 10 (``training/utils.py:446-448``), for Megatron-FSDP."""
    groups = list(getattr(args, "high_priority_stream_groups", None) or [])
    if arch_major is None and getattr(args, "use_megatron_fsdp", False):
        arch_major = torch.cuda.get_device_properties(torch.device("cuda:0")).major
    if getattr(args, "use_torch_fsdp2", False) or (getattr(args, "use_megatron_fsdp", False) and arch_major >= 10):
        for name, wanted in (("dp_cp", True), ("ep_dp", args.expert_model_parallel_size > 1)):
            if wanted and name not in groups:
                groups.append(name)
    return groups


def data_parallel_class(args: argparse.Namespace):
    """Each model chunk's wrapper, as Megatron-LM's ``get_model`` (core_v0.16.1 ``training.py:1276-1283``)."""
    if getattr(args, "use_torch_fsdp2", False):
        from megatron.core.distributed import TorchFullyShardedDataParallel

        return TorchFullyShardedDataParallel
    if getattr(args, "use_megatron_fsdp", False):
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        return FullyShardedDataParallel
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel


def build_model(args: argparse.Namespace, config, ddp_cfg, *, use_te: bool) -> list:
    """This rank's wrapped model chunks; sets ``config``'s schedule hooks as ``setup_model_and_optimizer`` does."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec(args, use_te=use_te)
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        torch.manual_seed(args.seed)  # embedding of the first stage; layers reseed themselves
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=getattr(args, "rotary_base", 10000),
            rotary_percent=getattr(args, "rotary_percent", 1.0),
            vp_stage=stage,
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if args.bf16 or args.fp16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        # as Megatron-LM: no bucketing past chunk 0 (reduced in finalize_model_grads, not overlapped)
        chunks.append(
            data_parallel_class(args)(config=config, ddp_config=ddp_cfg, module=model, disable_bucketing=vp_stage > 0)
        )
    single = len(chunks) == 1
    config.no_sync_func = chunks[0].no_sync if single else [c.no_sync for c in chunks]
    if args.overlap_grad_reduce:
        config.grad_sync_func = chunks[0].start_grad_sync if single else [c.start_grad_sync for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks
