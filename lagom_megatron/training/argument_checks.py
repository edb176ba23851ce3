"""Checks of ``scripts/pretrain_gpt.py``'s parsed arguments after ``preflight``'s rules; no torch, no Megatron."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from lagom_megatron.preflight.lagom_flags import lagom_value_problems
from lagom_megatron.training.arguments import apply_megatron_lm_defaults
from lagom_megatron.training.data import DATASET_HINT, check_data_path
from lagom_megatron.training.parity_flags import implementation_refusals, refusals
from lagom_megatron.training.tokenizer import resolve_vocab


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def one_line(problems: list[str]) -> str:
    """The refusal of a line as one line: the problem, or each of several numbered."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems with this line: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def local_layers(args: argparse.Namespace, *, on_gpu: bool) -> bool:
    """Whether megatron-core's local layers run: ``--transformer-impl`` as ``model.use_transformer_engine`` resolves
    it (its default None: Transformer Engine with a CUDA GPU and TE installed, else local)."""
    impl = getattr(args, "transformer_impl", None)
    if impl is not None:
        return impl == "local"
    return not (on_gpu and _installed("transformer_engine"))


FLASH_ATTN_MODULES = ("flash_attn", "flash_attn_3")
"""FlashAttention 2 (Megatron-LM core_v0.16.1 ``megatron/legacy/model/transformer.py:52-59, 544-547``) and 3
(megatron-core 0.16.1 ``transformer/attention.py:62``)."""


def install_problems(args: argparse.Namespace, *, on_gpu: bool) -> list[str]:
    """What this machine's libraries cannot run, naming the flag and what to install (APEX for gradient
    accumulation fusion on local GPU layers: megatron-core 0.16.1 ``tensor_parallel/layers.py:44-48, 924-933``)."""
    out = []
    cp = args.context_parallel_size
    if cp > 1 and not _installed("transformer_engine"):
        out.append(
            f"--context-parallel-size {cp} needs Transformer Engine (megatron-core runs context-parallel "
            "attention in TEDotProductAttention), which is not installed; install transformer_engine "
            "or use --context-parallel-size 1"
        )
    flash = [
        f
        for f, on in (
            ("--attention-backend flash", getattr(args, "attention_backend", None) == "flash"),
            ("--use-flash-attn", getattr(args, "use_flash_attn", False)),
        )
        if on
    ]
    if flash and not any(_installed(m) for m in FLASH_ATTN_MODULES):
        out.append(
            f"{flash[0]} needs FlashAttention (the flash-attn package: module flash_attn or "
            "flash_attn_3), which is not installed; install flash-attn, or use --attention-backend "
            "auto (Transformer Engine picks an installed kernel) without --use-flash-attn"
        )
    fsdp = [
        f
        for f, on in (
            ("--use-megatron-fsdp", getattr(args, "use_megatron_fsdp", False)),
            ("--use-torch-fsdp2", getattr(args, "use_torch_fsdp2", False)),
        )
        if on
    ]
    if fsdp and not on_gpu:  # Megatron-FSDP builds its buffers on f"cuda:{current_device()}" (megatron-core 0.16.1)
        out.append(
            f"{fsdp[0]} needs CUDA GPUs (megatron-core's FSDP wrappers allocate on the CUDA device); "
            "on CPU use --use-distributed-optimizer for sharded optimizer state"
        )
    if fsdp == ["--use-megatron-fsdp"] and not _installed("einops"):
        out.append(
            "--use-megatron-fsdp needs einops (megatron-core's distributed/fsdp/mcore_fsdp_adapter.py "
            "asserts it): pip install einops"
        )
    local = local_layers(args, on_gpu=on_gpu)
    impl = getattr(args, "transformer_impl", None)
    if (
        on_gpu
        and getattr(args, "gradient_accumulation_fusion", False)
        and local
        and not _installed("fused_weight_gradient_mlp_cuda")
    ):
        out.append(
            "gradient accumulation fusion (on by default) with the local layers (--transformer-impl "
            f"{impl or 'local: Transformer Engine is not installed'}) needs APEX's fused_weight_gradient_"
            "mlp_cuda extension, which is not installed; pass --no-gradient-accumulation-fusion or "
            "install APEX with its CUDA extensions"
        )
    return out + implementation_refusals(args, local_layers=local, on_gpu=on_gpu)


def check_installed(args: argparse.Namespace, *, on_gpu: bool = False) -> None:
    """ValueError listing every :func:`install_problems` in one line."""
    problems = install_problems(args, on_gpu=on_gpu)
    _check(not problems, one_line(problems))


def validate_args(
    args: argparse.Namespace, world_size: int, *, on_gpu: bool | None = None, refuse: bool = True
) -> argparse.Namespace:
    """Checks the arguments and fills in Megatron-LM's derived defaults in place; ValueError names the bad value.
    Every refused flag is named in one error: with ``on_gpu`` (this machine's) also what its libraries cannot run;
    ``refuse`` False leaves them to a later call that knows the machine (and checks nothing else while any is given)."""
    refused = refusals(args)
    if not refuse:
        if refused:  # the later call names them, with the rest of the line's checks
            return args
    elif on_gpu is None and getattr(args, "transformer_impl", None) == "local":
        refused += implementation_refusals(args, local_layers=True, on_gpu=None)
    elif on_gpu is not None:
        refused += install_problems(args, on_gpu=on_gpu)
    _check(not refused, one_line(refused))
    for flag in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "train_iters",
        "lr",
    ):
        _check(
            getattr(args, flag) is not None,
            f"--{flag.replace('_', '-')} is required (on the command line or in the --preset)",
        )
    for flag in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "train_iters",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "log_interval",
    ):
        value = getattr(args, flag)
        _check(value >= 1, f"--{flag.replace('_', '-')} must be a positive integer; got {value}")
    _check(world_size >= 1, f"world size must be a positive integer; got {world_size}")

    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    model_parallel = tp * pp * cp
    _check(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x context ({cp}) "
        f"parallel size = {model_parallel}",
    )
    dp = world_size // model_parallel
    args.data_parallel_size = dp
    ep = args.expert_model_parallel_size
    _check(ep == 1 or args.num_experts, f"--expert-model-parallel-size {ep} needs --num-experts")
    if args.moe_router_topk is None:
        args.moe_router_topk = 2
    if args.num_experts:
        _check(
            args.num_experts % ep == 0,
            f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}",
        )
        _check(
            (dp * cp) % ep == 0,
            f"data x context parallel size {dp * cp} is not divisible by --expert-model-parallel-size {ep}",
        )

    heads = args.num_attention_heads
    _check(heads % tp == 0, f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")
    _check(
        args.hidden_size % heads == 0,
        f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}",
    )
    if args.num_query_groups is not None:
        args.group_query_attention = True
    if args.group_query_attention:
        groups = args.num_query_groups
        _check(groups is not None and groups >= 1, "--group-query-attention needs --num-query-groups >= 1")
        _check(
            groups % tp == 0 or tp % groups == 0,  # megatron-core transformer_config.py:939-946
            f"--num-query-groups {groups} is neither a multiple nor a divisor of --tensor-model-parallel-size {tp}",
        )
        _check(heads % groups == 0, f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    else:
        args.num_query_groups = heads

    layers = args.num_layers
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    _check(
        uneven or layers % pp == 0,  # an uneven split is checked by preflight.layout.rule_uneven_pipeline
        f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp}",
    )
    args.virtual_pipeline_model_parallel_size = None
    per_vstage = args.num_layers_per_virtual_pipeline_stage
    n_vstages = args.num_virtual_stages_per_pipeline_rank
    _check(
        per_vstage is None or n_vstages is None,
        "pass --num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank, not both",
    )
    if n_vstages is not None:
        _check(
            pp > 1 and n_vstages >= 1,
            f"--num-virtual-stages-per-pipeline-rank {n_vstages} needs --pipeline-model-parallel-size > 1 "
            f"(got {pp}) and a value >= 1",
        )
        _check(
            uneven or (layers // pp) % n_vstages == 0,
            f"layers per pipeline stage {layers // pp} (--num-layers {layers} / --pipeline-model-parallel-size "
            f"{pp}) is not divisible by --num-virtual-stages-per-pipeline-rank {n_vstages}",
        )
        per_vstage = args.num_layers_per_virtual_pipeline_stage = (layers // pp) // n_vstages
    if per_vstage is not None:
        _check(pp > 1, f"--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1; got {pp}")
        _check(per_vstage >= 1, f"--num-layers-per-virtual-pipeline-stage must be >= 1; got {per_vstage}")
        per_stage = layers // pp
        _check(
            per_stage % per_vstage == 0,
            f"layers per pipeline stage {per_stage} (--num-layers {layers} / --pipeline-model-parallel-size "
            f"{pp}) is not divisible by --num-layers-per-virtual-pipeline-stage {per_vstage}",
        )
        args.virtual_pipeline_model_parallel_size = per_stage // per_vstage
        if args.virtual_pipeline_model_parallel_size == 1:
            args.virtual_pipeline_model_parallel_size = None
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps p2p (Megatron-LM does the same)

    mbs = args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    _check(
        gbs >= 1 and gbs % (mbs * dp) == 0,
        f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size {dp} "
        f"= {mbs * dp}",
    )
    args.num_microbatches = gbs // (mbs * dp)
    if args.virtual_pipeline_model_parallel_size is not None:
        _check(
            args.num_microbatches % pp == 0,
            f"the interleaved schedule needs micro-batches per iteration ({args.num_microbatches}) divisible "
            f"by --pipeline-model-parallel-size {pp}",
        )

    apply_megatron_lm_defaults(args)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _check(
            args.seq_length <= args.max_position_embeddings,
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}",
        )
    if tp == 1:
        args.sequence_parallel = False
    if args.sequence_parallel:
        _check(
            args.seq_length % tp == 0,
            f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
            "(needed by --sequence-parallel)",
        )
    _check(not (args.bf16 and args.fp16), "--bf16 and --fp16 are exclusive; pass one")
    # Megatron-LM core_v0.16.1 arguments.py:597-599 (the same in core_v0.18.2)
    _check(
        not args.overlap_param_gather or args.use_distributed_optimizer or args.use_megatron_fsdp,
        "--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp",
    )
    _check(
        not (args.use_megatron_fsdp and args.use_torch_fsdp2),
        "--use-megatron-fsdp and --use-torch-fsdp2 are exclusive; pass one",
    )
    _check(
        not args.overlap_param_gather or args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce"
    )
    _check(
        0.0 <= args.hidden_dropout < 1.0 and 0.0 <= args.attention_dropout < 1.0,
        f"dropout must be in [0, 1); got --hidden-dropout {args.hidden_dropout}, "
        f"--attention-dropout {args.attention_dropout}",
    )
    _check(args.lr >= args.min_lr >= 0.0, f"need --lr >= --min-lr >= 0; got --lr {args.lr}, --min-lr {args.min_lr}")
    for flag, value, low in (
        ("--eval-interval", args.eval_interval, 1),
        ("--eval-iters", args.eval_iters, 0),
        ("--exit-interval", args.exit_interval, 1),
        ("--exit-duration-in-mins", args.exit_duration_in_mins, 1),
    ):
        _check(value is None or value >= low, f"{flag} must be an integer >= {low}; got {value}")
    _check(
        not getattr(args, "fp8_param_gather", False) or args.use_distributed_optimizer or args.use_megatron_fsdp,
        "--fp8-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp (Megatron-LM asserts it)",
    )  # Megatron-LM core_v0.16.1 arguments.py:655-657
    decay_default = args.lr_decay_iters is None
    if decay_default:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:  # Megatron-LM core_v0.16.1 training.py:1367-1368
        _check(
            0.0 <= args.lr_warmup_fraction < 1.0,
            f"--lr-warmup-fraction must be in [0, 1); got {args.lr_warmup_fraction}",
        )
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    _check(
        0 <= args.lr_warmup_iters < args.lr_decay_iters,
        f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --lr-decay-iters {args.lr_decay_iters})"
        + (" (--lr-decay-iters defaults to --train-iters)" if decay_default else ""),
    )
    bounds = lagom_value_problems(
        {
            "lagom_warmup_iters": args.lagom_warmup_iters,
            "lagom_verify_iters": args.lagom_verify_iters,
            "lagom_verify_max_iters": getattr(args, "lagom_verify_max_iters", None),
        }
    )
    _check(not bounds, bounds[0].what if bounds else "")
    for flag, value in (("--lagom-report", args.lagom_report), ("--lagom-plan", args.lagom_plan)):
        if value:
            _check(not Path(value).is_dir(), f"{flag} {value!r} is a folder; give a file name")
            _check(
                not Path(value).parent.exists() or Path(value).parent.is_dir(),
                f"{flag} {value!r}: {Path(value).parent} is not a folder",
            )
    if args.lagom_report:
        suffix = Path(args.lagom_report).suffix.lower()
        _check(
            suffix in ("", ".md", ".markdown", ".csv", ".json"),
            f"--lagom-report must end in .md, .csv or .json; got {args.lagom_report!r}",
        )

    _check(
        args.mock_data or args.data_path,
        f"no training data: pass --mock-data or --data-path PREFIX ({DATASET_HINT})",
    )
    _check(not (args.mock_data and args.data_path), "pass either --mock-data or --data-path, not both")
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data and args.vocab_size else "ByteLevel"
    if args.tokenizer_type == "NullTokenizer":
        _check(
            args.vocab_size is not None and args.vocab_size >= 2,
            "--tokenizer-type NullTokenizer needs --vocab-size >= 2",
        )
    args.orig_vocab_size, args.padded_vocab_size = resolve_vocab(args)
    if args.data_path:
        check_data_path(args.data_path, args.orig_vocab_size, args.tokenizer_type)
    if args.nccl_communicator_config_path is not None:
        _check(
            Path(args.nccl_communicator_config_path).is_file(),
            f"--nccl-communicator-config-path {args.nccl_communicator_config_path!r} does not exist",
        )
    _check(
        cp == 1 or args.transformer_impl != "local",
        f"--context-parallel-size {cp} needs Transformer Engine (--transformer-impl transformer_engine)",
    )
    _check(
        not args.tp_comm_overlap or args.transformer_impl != "local",
        "--tp-comm-overlap needs Transformer Engine (--transformer-impl transformer_engine)",
    )
    return args
