"""Megatron-LM's flags beyond what our loop uses: accepted with no effect (``NO_EFFECT``, per device), or refused
here with the reason, so one command line runs both ``pretrain_gpt.py`` scripts (Megatron-LM core_v0.16.1
``megatron/training/arguments.py``)."""

from __future__ import annotations

import argparse

NO_EFFECT: dict[str, str] = {
    "save": "this script writes no checkpoints",
    "save_interval": "this script writes no checkpoints",
    "load": "this script loads no checkpoints",
    "ckpt_format": "this script writes no checkpoints",
    "no_load_optim": "this script loads no checkpoints",
    "no_load_rng": "this script loads no checkpoints",
    "tensorboard_dir": "no TensorBoard writer",
    "wandb_project": "no Weights & Biases writer",
    "wandb_exp_name": "no Weights & Biases writer",
    "profile": "no torch profiler",
    "profile_step_start": "no torch profiler",
    "profile_step_end": "no torch profiler",
    "manual_gc": "Python's garbage collector is left as it is",
    "num_workers": "batches are read in the loop",
    "empty_unused_memory_level": "the CUDA cache is not emptied",
    "deprecated_use_mcore_models": "always Megatron-Core",
    "mmap_bin_files": "indexed datasets are memory-mapped",
    "create_attention_mask_in_dataloader": "masks always built",
    "no_persist_layer_norm": "persistent layer-norm kernels are never used",
    "masked_softmax_fusion": "fused kernels: off on CPU, Megatron-Core's defaults on a GPU",
    "bias_gelu_fusion": "fused kernels: off on CPU, Megatron-Core's defaults on a GPU",
    "bias_swiglu_fusion": "fused kernels: off on CPU, Megatron-Core's defaults on a GPU",
    "bias_dropout_fusion": "fused kernels: off on CPU, Megatron-Core's defaults on a GPU",
    "apply_rope_fusion": "fused kernels: off on CPU, Megatron-Core's defaults on a GPU",
    "tiktoken_pattern": "tokenizers: ByteLevel and NullTokenizer only",
}

NO_EFFECT_ON_CPU: dict[str, str] = {
    "cross_entropy_loss_fusion": "no fused kernels on CPU",
    "distributed_backend": "gloo is the only backend on CPU",
    "high_priority_stream_groups": "gloo has no NCCL streams",
    "nccl_ub": "gloo has no NCCL user buffers",
}

FP8_FLAGS: dict[str, object] = {
    "fp8": None,
    "fp8_amax_history_len": 1,
    "fp8_amax_compute_algo": "most_recent",
    "fp8_param_gather": False,
}
"""Destination -> default of the FP8 flags (Megatron-LM core_v0.16.1 ``arguments.py:1370-1400``): they act in
Transformer Engine's layers only (megatron-core 0.16.1 ``transformer/transformer_config.py:429-470``)."""

GPT2_BPE_HINT = (
    "megatron-core's GPT-2 BPE tokenizer needs the transformers package, which this script does not use; its "
    "tokenizers are ByteLevel and NullTokenizer (a dataset tokenized with GPT-2 BPE trains with --tokenizer-type "
    "NullTokenizer --vocab-size 50257)"
)

REFUSED_HERE: dict[str, str] = {
    "train_samples": "sample-based training is not implemented here; give --train-iters",
    "lr_warmup_samples": "sample-based schedules are not implemented here; give --lr-warmup-iters",
    "lr_decay_samples": "sample-based schedules are not implemented here; give --lr-decay-iters",
    "rampup_batch_size": "batch-size ramp-up is not implemented here",
    "calculate_per_token_loss": "the loss is averaged per micro-batch here",
    "decoupled_lr": "one learning rate for all parameters here",
    "decoupled_min_lr": "one learning rate for all parameters here",
    "vocab_file": GPT2_BPE_HINT,
    "merge_file": GPT2_BPE_HINT,
    "tokenizer_model": "SentencePiece and HuggingFace tokenizers are not built here; its tokenizers are ByteLevel "
    "and NullTokenizer (--tokenizer-type NullTokenizer --vocab-size N trains a dataset of ids below N)",
}
"""Destination -> why a non-default value is refused (training would differ from Megatron-LM's)."""


def add_megatron_lm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the flags of the module docstring; returns the parser."""
    g = parser.add_argument_group("evaluation, exit and logging")
    g.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="Evaluate on the validation split every this many iterations (and after training).",
    )
    g.add_argument("--eval-iters", type=int, default=100, help="Iterations of each evaluation.")
    g.add_argument("--skip-train", action="store_true", help="Evaluate only (no training iterations).")
    g.add_argument("--exit-interval", type=int, default=None, help="Stop after an iteration divisible by this.")
    g.add_argument("--exit-duration-in-mins", type=int, default=None, help="Stop after this many minutes of training.")
    g.add_argument("--log-throughput", action="store_true", help="Log the TFLOP/s per GPU (throughput per GPU).")
    g.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        default="nccl",
        help="torch.distributed backend on a GPU (always gloo on CPU).",
    )
    for dest in ("tensorboard_dir", "wandb_project", "wandb_exp_name"):
        g.add_argument("--" + dest.replace("_", "-"), default=None, help=f"Accepted; {NO_EFFECT[dest]}.")
    g.add_argument("--profile", action="store_true", help="Accepted; no torch profiler.")
    g.add_argument("--profile-step-start", type=int, default=10, help="Accepted; no torch profiler.")
    g.add_argument("--profile-step-end", type=int, default=12, help="Accepted; no torch profiler.")
    g.add_argument("--manual-gc", action="store_true", help=f"Accepted; {NO_EFFECT['manual_gc']}.")
    g.add_argument(
        "--empty-unused-memory-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="Accepted; the CUDA cache is not emptied.",
    )

    # Megatron-LM core_v0.16.1 arguments.py:2095-2096 (nargs "*"), :2285-2288; core_v0.19.0 builds the first from
    # training/config/common_config.py:124 (nargs "+", arguments.py:2937-2940) and keeps :3010
    g = parser.add_argument_group("NCCL communicators (GPU)")
    g.add_argument(
        "--high-priority-stream-groups",
        nargs="*",
        default=[],
        help="Process groups (Megatron-Core names: dp_cp, ep_dp, tp, ...) whose NCCL communicators run on "
        "high-priority CUDA streams; passed to initialize_model_parallel.",
    )
    g.add_argument(
        "--use-nccl-ub",
        dest="nccl_ub",
        action="store_true",
        help="Register the DP/FSDP communication buffers with NCCL (user buffers); Megatron-Core's DDP config.",
    )

    g = parser.add_argument_group("checkpoints (accepted; this script writes and loads none)")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"], default="torch_dist")
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)

    g = parser.add_argument_group("learning rate and loss")
    g.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters).",
    )
    g.add_argument("--train-samples", type=int, default=None, help=REFUSED_HERE["train_samples"] + ".")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help=REFUSED_HERE["lr_warmup_samples"] + ".")
    g.add_argument("--lr-decay-samples", type=int, default=None, help=REFUSED_HERE["lr_decay_samples"] + ".")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, help=REFUSED_HERE["rampup_batch_size"] + ".")
    g.add_argument("--decoupled-lr", type=float, default=None, help=REFUSED_HERE["decoupled_lr"] + ".")
    g.add_argument("--decoupled-min-lr", type=float, default=None, help=REFUSED_HERE["decoupled_min_lr"] + ".")
    g.add_argument(
        "--calculate-per-token-loss", action="store_true", help=REFUSED_HERE["calculate_per_token_loss"] + "."
    )
    g.add_argument("--cross-entropy-loss-fusion", action="store_true", help="Fused cross entropy (GPU).")
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="Reduce gradients in bf16 (not fp32) across data-parallel ranks.",
    )

    g = parser.add_argument_group("model details")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="Fraction of each head's channels RoPE rotates.")
    g.add_argument(
        "--no-position-embedding",
        dest="add_position_embedding",
        action="store_false",
        help="Deprecated in Megatron-LM: only valid with --position-embedding-type rope.",
    )
    g.add_argument(
        "--apply-layernorm-1p",
        dest="layernorm_zero_centered_gamma",
        action="store_true",
        help="Zero-centred LayerNorm weights (1 + gamma); needs Transformer Engine layers.",
    )
    g.add_argument(
        "--moe-ffn-hidden-size", type=int, default=None, help="Expert MLP hidden size (default --ffn-hidden-size)."
    )
    g.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=int,
        default=None,
        help="Hidden size of the shared experts (none by default).",
    )
    g.add_argument(
        "--moe-shared-expert-overlap", action="store_true", help="Overlap the shared experts with the token dispatch."
    )
    g.add_argument(
        "--moe-router-load-balancing-type",
        default="aux_loss",
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
    )
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="Weight of the load-balancing loss.")
    g.add_argument(
        "--overlap-moe-expert-parallel-comm",
        action="store_true",
        help="Overlap the expert-parallel all-to-all of one micro-batch with another's compute.",
    )
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="Tensor parallelism inside the experts (default --tensor-model-parallel-size).",
    )
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="Layers of the first pipeline stage (an uneven split).",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="Layers of the last pipeline stage (an uneven split).",
    )
    for flag, dest in (
        ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
        ("--no-bias-gelu-fusion", "bias_gelu_fusion"),
        ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
        ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
        ("--no-rope-fusion", "apply_rope_fusion"),
    ):
        g.add_argument(flag, dest=dest, action="store_false", help=f"Accepted; {NO_EFFECT[dest]}.")
    g.add_argument(
        "--no-persist-layer-norm", action="store_true", help=f"Accepted; {NO_EFFECT['no_persist_layer_norm']}."
    )
    g.add_argument(
        "--use-mcore-models",
        dest="deprecated_use_mcore_models",
        action="store_true",
        help="Accepted (deprecated in Megatron-LM); always Megatron-Core.",
    )
    fp8 = "Transformer Engine's layers only (refused with the local layers)"
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help=f"FP8 amax history length; {fp8}.")
    g.add_argument(
        "--fp8-format", dest="fp8", choices=["e4m3", "hybrid"], default=None, help=f"FP8 (delayed scaling); {fp8}."
    )
    g.add_argument(
        "--fp8-amax-compute-algo",
        choices=["most_recent", "max"],
        default="most_recent",
        help=f"FP8 amax of the history window; {fp8}.",
    )
    g.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help=f"Keep weights in FP8 and all-gather them in FP8 (needs --use-distributed-optimizer); {fp8}.",
    )

    g = parser.add_argument_group("data and tokenizer (see --tokenizer-type)")
    for dest in ("vocab_file", "merge_file", "tokenizer_model"):
        g.add_argument("--" + dest.replace("_", "-"), default=None, help=f"Refused: {REFUSED_HERE[dest]}.")
    g.add_argument("--tiktoken-pattern", default=None, help=f"Accepted; {NO_EFFECT['tiktoken_pattern']}.")
    g.add_argument("--num-workers", type=int, default=2, help=f"Accepted; {NO_EFFECT['num_workers']}.")
    g.add_argument(
        "--no-mmap-bin-files",
        dest="mmap_bin_files",
        action="store_false",
        help=f"Accepted; {NO_EFFECT['mmap_bin_files']}.",
    )
    g.add_argument(
        "--no-create-attention-mask-in-dataloader",
        dest="create_attention_mask_in_dataloader",
        action="store_false",
        help=f"Accepted; {NO_EFFECT['create_attention_mask_in_dataloader']}.",
    )
    return parser


def inactive_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, *, on_gpu: bool) -> list[str]:
    """The flags of ``args`` away from their default that do not act here, as ``--flag (why)``, in parser order."""
    table = dict(NO_EFFECT) if on_gpu else {**NO_EFFECT, **NO_EFFECT_ON_CPU}
    out = []
    for action in parser._actions:
        why = table.get(action.dest)
        if why is None or not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if action.dest == "distributed_backend" and value == "gloo":  # what CPU runs use anyway
            continue
        if value != action.default:
            out.append(f"{action.option_strings[0]} ({why})")
            table.pop(action.dest)
    return out


def _shown(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return repr(value) if isinstance(value, str) else str(value)


def refusals(args: argparse.Namespace) -> list[str]:
    """Every flag of ``args`` refused on any machine, one sentence each (Megatron-LM core_v0.16.1
    ``arguments.py:999-1000``, ``:767-769``)."""
    defaults = {"lr_warmup_samples": 0, "calculate_per_token_loss": False}
    given: dict[str, list[str]] = {}  # why -> the flags it refuses (one sentence for --vocab-file and --merge-file)
    for dest, why in REFUSED_HERE.items():
        value = getattr(args, dest, None)
        if value not in (defaults.get(dest), None):
            flag = "--" + dest.replace("_", "-")
            given.setdefault(why, []).append(flag if value is True else f"{flag} {_shown(value)}")
    out = [
        f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} not accepted by scripts/pretrain_gpt.py: {why}"
        for why, flags in given.items()
    ]
    if not getattr(args, "add_position_embedding", True) and args.position_embedding_type != "rope":
        out.append(
            "--no-position-embedding is deprecated (Megatron-LM refuses it without RoPE): use --position-embedding-type"
        )
    if getattr(args, "lr_warmup_fraction", None) is not None and args.lr_warmup_iters:
        out.append("pass one of --lr-warmup-fraction and --lr-warmup-iters, not both")
    return out


def implementation_refusals(args: argparse.Namespace, *, local_layers: bool, on_gpu: bool | None) -> list[str]:
    """The flags the chosen layers cannot run (``local_layers``: megatron-core's local spec; ``on_gpu`` None: not
    known). megatron-core 0.16.1 ``transformer/torch_norm.py:26-28`` asserts no zero-centred gamma; FP8 runs in
    Transformer Engine's modules only (``transformer_config.py:429-470``)."""
    impl = getattr(args, "transformer_impl", None)
    out = []
    if impl == "transformer_engine" and on_gpu is False:
        out.append(
            "--transformer-impl transformer_engine needs a CUDA GPU and this machine has none; use "
            "--transformer-impl local (the default without a GPU)"
        )
    if not local_layers:
        return out
    if impl == "local":
        layers, fix = "--transformer-impl local", "use --transformer-impl transformer_engine, or drop {}"
    elif on_gpu is False:
        layers, fix = "this machine has no CUDA GPU, so the local layers run", "drop {} to run on CPU"
    else:
        layers, fix = "Transformer Engine is not installed, so the local layers run", "install it, or drop {}"
    if getattr(args, "layernorm_zero_centered_gamma", False):
        out.append(
            f"--apply-layernorm-1p needs Transformer Engine layers (megatron-core's local LayerNorm has no "
            f"zero-centred weights) but {layers}: {fix.format('it')}"
        )
    fp8 = [
        f"{action} {_shown(getattr(args, dest))}" if not isinstance(default, bool) else action
        for dest, default, action in (
            (d, v, "--fp8-format" if d == "fp8" else "--" + d.replace("_", "-")) for d, v in FP8_FLAGS.items()
        )
        if getattr(args, dest, default) != default
    ]
    if fp8:
        out.append(
            f"{', '.join(fp8)}: FP8 runs in Transformer Engine's layers only but {layers}: "
            f"{fix.format('the FP8 flags')}"
        )
    return out
