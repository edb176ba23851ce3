"""Megatron-LM command lines <-> argparse destinations without its parser (flags of core_v0.16 ``arguments.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lagom_megatron.preflight.types import flag

STORE_FALSE_FLAGS: dict[str, str] = {
    "add_bias_linear": "--disable-bias-linear",
    "overlap_p2p_comm": "--no-overlap-p2p-communication",
    "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion",
    "masked_softmax_fusion": "--no-masked-softmax-fusion",
    "bias_gelu_fusion": "--no-bias-gelu-fusion",
    "bias_swiglu_fusion": "--no-bias-swiglu-fusion",
    "bias_dropout_fusion": "--no-bias-dropout-fusion",
    "apply_rope_fusion": "--no-rope-fusion",
    "mmap_bin_files": "--no-mmap-bin-files",
    "create_attention_mask_in_dataloader": "--no-create-attention-mask-in-dataloader",
    "add_position_embedding": "--no-position-embedding",
}
"""Destinations whose Megatron-LM flag stores False (default True there)."""


def args_to_argv(args: dict[str, Any]) -> list[str]:
    """Argparse destinations as Megatron-LM flags, in order; ``num_query_groups`` adds ``--group-query-attention``."""
    argv: list[str] = []
    for dest, value in args.items():
        if value is None:
            continue
        if dest in STORE_FALSE_FLAGS:
            if value is False:
                argv.append(STORE_FALSE_FLAGS[dest])
            continue
        if value is True:
            argv.append(flag(dest))
        elif value is False:
            continue
        elif isinstance(value, (list, tuple)):
            argv.append(flag(dest))
            argv.extend(str(v) for v in value)
        else:
            argv.extend([flag(dest), _fmt(value)])
        if dest == "num_query_groups":
            argv.append("--group-query-attention")
    return argv


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


MEGATRON_LM_EVAL_ITERS_WITHOUT_EVAL = 1


def preset_to_argv(preset: Any) -> list[str]:
    """A preset as a ``pretrain_gpt.py`` line; an eval interval (divided by: ``training.py:3307`` @core_v0.16.1, :3547
    @core_v0.17.1, :4136 @core_v0.18.2); FSDP: ``--ckpt-format fsdp_dtensor`` (``arguments.py:690`` @core_v0.16.1),
    ``--use-distributed-optimizer`` (``docs/discussions/megatron-fsdp-user-guide/megatron-fsdp-user-guide.md:27-37``
    @core_v0.16.1; forced at ``arguments.py:1113-1119`` @core_v0.18.2) and the sharding strategy."""
    args = preset.to_args()
    if args.get("max_position_embeddings") is None:
        args["max_position_embeddings"] = args.get("seq_length")
    if args.get("eval_interval") is None:
        args["eval_interval"] = args.get("train_iters")
        args.setdefault("eval_iters", MEGATRON_LM_EVAL_ITERS_WITHOUT_EVAL)
    if args.get("use_megatron_fsdp"):
        args.setdefault("ckpt_format", "fsdp_dtensor")
        args["use_distributed_optimizer"] = True
        args["data_parallel_sharding_strategy"] = preset.overlap.data_parallel_sharding_strategy
    return args_to_argv(args)


def megatron_lm_line(preset: Any, extra: Sequence[str]) -> list[str]:
    """The flags a Megatron-LM checkout's ``pretrain_gpt.py`` runs a preset with (the SLURM launch's and the
    doctor's one line): ``preset_to_argv``, then ``extra`` (a ``--preset`` in it dropped), which overrides it."""
    rest, skip = [], False
    for word in extra:
        if skip:
            skip = False
        elif word == "--preset":
            skip = True
        elif not word.startswith("--preset="):
            rest.append(word)
    return [*preset_to_argv(preset), *rest]


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def argv_to_args(argv: Sequence[str]) -> dict[str, Any]:
    """A ``pretrain_gpt.py`` line as destinations over ``--preset``'s (``_preset``: the Preset); ValueError: bad one."""
    pairs: list[tuple[str, list[str]]] = []
    current: tuple[str, list[str]] | None = None
    for word in argv:
        if word.startswith("--") and len(word) > 2 and not _is_number(word):
            name, eq, val = word[2:].partition("=")
            current = (name, [val] if eq else [])
            pairs.append(current)
        elif current is not None:
            current[1].append(word)
    out: dict[str, Any] = {}
    for name, values in pairs:
        if name == "preset":
            if not values:
                raise ValueError("--preset needs a preset name or a path to a preset file")
            from lagom_megatron.config.presets import load_preset

            preset = load_preset(values[0])
            out = {**preset.to_args(), **out, "_preset": preset}
    for name, values in pairs:
        if name == "preset":
            continue
        dest = name.replace("-", "_")
        store_false = {v[2:].replace("-", "_"): k for k, v in STORE_FALSE_FLAGS.items()}
        if dest in store_false and not values:
            out[store_false[dest]] = False
        elif not values:
            out[dest] = True
        elif len(values) == 1:
            out[dest] = _parse_value(values[0])
        else:
            out[dest] = [_parse_value(v) for v in values]
    return out


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
