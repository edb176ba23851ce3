"""``scripts/pretrain_gpt.py``'s arguments: Megatron-LM's (core_v0.16 ``arguments.py``), ``--preset``, ``--lagom*``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from lagom_megatron.preflight.lagom_flags import LAGOM_FLAGS, LAGOM_METHODS, add_lagom_args  # noqa: F401 (public here too)
from lagom_megatron.preflight.overlap import SHARDING_STRATEGIES
from lagom_megatron.training.parity_flags import add_megatron_lm_args

TOKENIZER_TYPES = ("ByteLevel", "NullTokenizer")

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")

DEFAULT_SPLIT = "969,30,1"

ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
"""Megatron-Core's ``transformer.enums.AttnBackend`` names (megatron-core 0.16.1 ``enums.py:60-67``; same in 0.18.2)."""

LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size")
"""Flags that name the layout: given, a preset's world size need not be the job's."""

MEGATRON_LM_REFUSED: dict[str, str] = {
    "--overlap-p2p-communication": "Megatron-LM has no such flag: pipeline send/recv overlap is on by "
    "default (interleaved schedule); --no-overlap-p2p-communication turns it off",
}


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the Megatron-LM flags this entry point supports (argument groups); returns the parser."""
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP hidden size; default 4 x hidden size, or int(8 x hidden / 3 / 64) x 64 with --swiglu "
        "(Megatron-LM's value).",
    )
    g.add_argument(
        "--kv-channels", type=int, default=None, help="Projection size per attention head; default hidden size / heads."
    )
    g.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention with --num-query-groups groups.",
    )
    g.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="Query groups of grouped-query attention (implies --group-query-attention).",
    )
    g.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Maximum sequence length of the position embeddings; default --seq-length.",
    )
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--swiglu", action="store_true", help="Gated SiLU MLP instead of GeLU.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--num-experts", type=int, default=None, help="Mixture-of-experts experts per layer.")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"), default="allgather")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="Grouped GEMM for the experts (GPU).")
    g.add_argument(
        "--disable-bias-linear",
        dest="add_bias_linear",
        action="store_false",
        help="No bias in the linear layers (Llama, Mixtral).",
    )
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (theta).")
    g.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default=None,
        help="Layer implementation; default: transformer_engine when it is installed and a GPU is present, else local.",
    )
    g.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        default=None,
        help="Initialise weights on the CPU (always on without a GPU).",
    )
    g.add_argument(
        "--init-method-std", type=float, default=0.02, help="Standard deviation of the normal weight initialisation."
    )
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="Megatron-Core's AttnBackend: which attention kernel Transformer Engine's layers use "
        "(local: the plain torch attention, only with --transformer-impl local).",
    )
    g.add_argument(
        "--use-flash-attn",
        action="store_true",
        help="Accepted as Megatron-LM accepts it: no effect on Megatron-Core's GPT model; "
        "use --attention-backend flash.",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=("full", "selective"),
        default=None,
        help="Activation recomputation: full layers or selected parts (core attention).",
    )
    g.add_argument(
        "--recompute-method",
        choices=("uniform", "block"),
        default=None,
        help="With --recompute-granularity full: how the recomputed layers are chosen.",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="With --recompute-granularity full: layers per recomputed unit (uniform) or "
        "recomputed layers per pipeline stage (block).",
    )

    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="Layers per virtual pipeline stage (interleaved 1F1B schedule).",
    )
    g.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="Virtual pipeline stages (model chunks) per pipeline rank; the alternative to "
        "--num-layers-per-virtual-pipeline-stage.",
    )
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Overlap the data-parallel gradient reduce with the backward pass.",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="Overlap the distributed optimizer's parameter all-gather with the forward pass.",
    )
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="Wrap the model in Megatron-Core's Megatron-FSDP (GPU); what it shards is "
        "--data-parallel-sharding-strategy's choice (optim_grads_params for ZeRO-3).",
    )
    # arguments.py:2307-2309 @core_v0.16.1 (:2722-2724 @core_v0.17.1); :2805-2807 @core_v0.18.2 defaults to
    # optim_grads_params. Only Megatron-FSDP reads it: no_shard with --use-megatron-fsdp shards nothing.
    g.add_argument(
        "--data-parallel-sharding-strategy",
        choices=SHARDING_STRATEGIES,
        default="no_shard",
        help="What Megatron-FSDP shards over the data-parallel group: no_shard (nothing: DDP), optim "
        "(optimizer state, ZeRO-1), optim_grads (and gradients, ZeRO-2), optim_grads_params (and "
        "parameters, ZeRO-3). Default no_shard, as in Megatron-LM core_v0.16/0.17 (core_v0.18 "
        "defaults to optim_grads_params).",
    )
    g.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="Shard with torch's FSDP2 (fully_shard) through Megatron-Core's wrapper (GPU).",
    )
    g.add_argument(
        "--ddp-bucket-size", type=int, default=None, help="Parameters per DDP bucket; default: Megatron-Core's."
    )
    g.add_argument(
        "--no-overlap-p2p-communication",
        dest="overlap_p2p_comm",
        action="store_false",
        help="Do not overlap pipeline send/recv with compute; overlap is on by default and only the "
        "interleaved schedule uses it.",
    )
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Reduce gradients across data-parallel ranks in fp32 (on by default with --bf16).",
    )
    g.add_argument(
        "--no-gradient-accumulation-fusion",
        dest="gradient_accumulation_fusion",
        action="store_false",
        help="Do not fuse weight-gradient accumulation into the GEMM (fused by default on a GPU; "
        "always off on CPU, where the fused kernel does not exist).",
    )
    g.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="Transformer Engine userbuffers overlap of tensor-parallel communication.",
    )
    g.add_argument(
        "--nccl-communicator-config-path",
        default=None,
        help="YAML of per-process-group NCCL options (Megatron-Core's format).",
    )
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    # arguments.py:2275 @core_v0.16.1; torch.distributed.launch passes --local-rank=N or (torch < 2) --local_rank N
    g.add_argument(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        default=int(os.getenv("LOCAL_RANK", "0")),
        help="Local rank passed by a distributed launcher.",
    )

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per iteration; default micro-batch size x data-parallel size.",
    )
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Default: --train-iters.")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument(
        "--lr-wsd-decay-style",
        choices=("exponential", "linear", "cosine", "minus_sqrt"),
        default="exponential",
        help="Decay of the WSD schedule's last phase.",
    )
    g.add_argument(
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="Iterations of the WSD schedule's decay phase (needed by --lr-decay-style WSD).",
    )
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--log-interval", type=int, default=100)

    g = parser.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="Megatron's MockGPTDataset.")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Indexed dataset prefixes (PREFIX.bin/.idx), optionally weighted: W1 P1 W2 P2.",
    )
    g.add_argument(
        "--split",
        default=None,
        help="Train, validation, test weights of the documents; default 969,30,1 as in Megatron-LM.",
    )
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="Tokenizer vocabulary before padding (NullTokenizer), or the padded size.",
    )
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The full parser of ``pretrain_gpt.py``: ``--preset``, Megatron-LM's flags, lagom's flags."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Train a GPT with Megatron-Core (Megatron-LM's flags), optionally tuned by lagom.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--preset", default=None, help="Preset name under configs/presets/ or a YAML path; explicit flags override it."
    )
    add_megatron_args(parser)
    add_megatron_lm_args(parser)
    add_lagom_args(parser)
    for flag, hint in MEGATRON_LM_REFUSED.items():
        parser.add_argument(flag, action=_Refused, hint=hint, help=argparse.SUPPRESS)
    return parser


class _Refused(argparse.Action):
    """A flag of :data:`MEGATRON_LM_REFUSED`: parsing it is an error with the hint."""

    def __init__(self, option_strings, dest, hint: str = "", **kwargs):
        kwargs["nargs"] = "?"
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not accepted: {self.hint}")


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default ``--ffn-hidden-size`` (core_v0.16.1 ``arguments.py:802-811``; same in core_v0.18.2)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


def apply_megatron_lm_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fills in ``validate_args``' derived values (--bf16: core_v0.16.1 ``arguments.py:711-724``); ValueError if bad."""
    from lagom_megatron.preflight.values import megatron_flag_problems

    if args.split is None:  # Megatron-LM core_v0.16.1 arguments.py:468-472 (with --data-path)
        args.split = DEFAULT_SPLIT
    if args.ffn_hidden_size is None and args.hidden_size is not None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    problems = megatron_flag_problems(vars(args))
    if problems:
        raise ValueError(problems[0].what)
    return args


class UsageError(ValueError):
    """argparse's error (an unknown flag, a bad value) when ``parse_args`` does not exit."""


def _raise_usage_error(message: str) -> None:
    raise UsageError(message)


def parse_args(argv: Sequence[str] | None = None, *, exit_on_error: bool = True) -> argparse.Namespace:
    """Parses with ``--preset``'s values as defaults; ValueError (UsageError instead of exit 2), FileNotFoundError."""
    parser = build_parser()
    if not exit_on_error:
        parser.error = _raise_usage_error  # type: ignore[method-assign]
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", default=None)
    known, _ = pre.parse_known_args(argv)
    preset_name, preset_world_size = None, None
    if known.preset:
        from lagom_megatron.config.presets import load_preset

        preset = load_preset(known.preset)
        preset_name = preset.name
        if "world_size" in preset.model_fields_set:  # a preset that names no world size names no layout
            preset_world_size = preset.world_size
        defaults = preset.to_args()
        dests = {a.dest for a in parser._actions}
        missing = sorted(k for k in defaults if k not in dests)
        if missing:  # a bug of this module, not of the preset
            raise ValueError(f"preset {preset_name!r}: keys without a command-line flag: {', '.join(missing)}")
        parser.set_defaults(**defaults)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's line with the closest known flag named
        import difflib

        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        words = []
        for word in unknown:
            close = difflib.get_close_matches(word.partition("=")[0], flags, n=1) if word.startswith("--") else []
            words.append(f"{word} (did you mean {close[0]}?)" if close else word)
        parser.error(f"unrecognized arguments: {' '.join(words)}")  # exits 2 (or raises ValueError, above)
    args.preset_name = preset_name
    args.preset_world_size = preset_world_size
    words = list(sys.argv[1:] if argv is None else argv)
    args.layout_flags_given = tuple(f for f in LAYOUT_FLAGS if any(w == f or w.startswith(f + "=") for w in words))
    return args
