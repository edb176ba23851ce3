"""Megatron-LM command lines <-> argparse destinations, without Megatron-LM's parser.

Two directions, both used by the launch tooling:

* ``preset_to_argv(preset)``: the flags of a preset as a Megatron-LM ``pretrain_gpt.py`` command
  line (for a patched Megatron-LM checkout, which has no ``--preset``).
* ``argv_to_args(argv)``: a ``pretrain_gpt.py`` command line (ours or Megatron-LM's) as a dict of
  argparse destinations, for ``lagom doctor -- <args>``. It is tolerant: every ``--flag`` becomes
  a destination (``--tensor-model-parallel-size 4`` -> ``tensor_model_parallel_size=4``), a bare
  flag becomes True, and the few Megatron-LM flags that store False are mapped explicitly. A
  ``--preset NAME`` in the line is applied first, as ``pretrain_gpt.py`` does.

Flag names are Megatron-LM's (``megatron/training/arguments.py``); each flag emitted by
``preset_to_argv`` for the GPU presets was checked against the core_v0.16 parser.
"""

from __future__ import annotations

from typing import Any, Sequence

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

NOT_MEGATRON_ARGS: frozenset[str] = frozenset()
"""Preset destinations with no Megatron-LM flag (none at present; kept for additive schema fields)."""


def flag(dest: str) -> str:
    """``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + dest.replace("_", "-")


def args_to_argv(args: dict[str, Any]) -> list[str]:
    """Turns argparse destinations into Megatron-LM flags.

    True -> the bare flag; False -> nothing, or the store-false flag of ``STORE_FALSE_FLAGS``;
    None -> nothing; a list -> the flag followed by its items; anything else -> flag and ``str``.
    ``num_query_groups`` also emits ``--group-query-attention``, which Megatron-LM requires.

    Args:
        args: destination -> value, e.g. ``Preset.to_args()``.

    Returns:
        The argv list, in the order of ``args``.
    """
    argv: list[str] = []
    for dest, value in args.items():
        if dest in NOT_MEGATRON_ARGS or value is None:
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
"""``--eval-iters`` given with the ``--eval-interval`` a preset without one gets on a Megatron-LM line."""


def preset_to_argv(preset: Any) -> list[str]:
    """A preset as a Megatron-LM ``pretrain_gpt.py`` command line (``Preset.to_args`` flattened).

    The preset's own ``max_position_embeddings`` defaults to its sequence length when unset
    (Megatron-LM requires it for learned and rotary positions alike). Megatron-LM cannot start
    without ``--eval-interval`` (``train_iters // eval_interval`` in core_v0.16.1
    ``megatron/training/training.py:3307``, :3547 in core_v0.17.1, :4136 in core_v0.18.2), so a
    preset without one gets ``--eval-interval <train_iters> --eval-iters 1``: one evaluation
    iteration, at the end. With ``use_megatron_fsdp`` the line gets ``--ckpt-format fsdp_dtensor``,
    the only format Megatron-LM accepts with it (core_v0.16.1 ``megatron/training/arguments.py:690``),
    and ``--use-distributed-optimizer``: Megatron-FSDP's user guide lists it among the required flags
    (core_v0.16.1 ``docs/discussions/megatron-fsdp-user-guide/megatron-fsdp-user-guide.md:27-37``) and
    core_v0.18.2 turns it on itself (``arguments.py:1113-1119``), so the line runs the same optimizer on
    every release. The preset's ``data_parallel_sharding_strategy`` is always written out with
    ``use_megatron_fsdp``: Megatron-LM's default differs by release (no_shard in core_v0.16/0.17,
    optim_grads_params in core_v0.18).
    """
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
    """Parses a ``pretrain_gpt.py`` command line into argparse destinations.

    A ``--preset NAME`` (anywhere) is loaded first and the explicit flags override it, as our
    ``pretrain_gpt.py`` does. ``--flag=value`` and ``--flag value ...`` are both accepted; several
    values after one flag become a list; positional words before the first flag (the script path)
    are skipped.

    Returns:
        destination -> value (int / float / bool / str / list), with ``world_size`` left to the
        caller. When a preset was given, ``_preset`` holds the loaded ``Preset``.

    Raises:
        ValueError: ``--preset`` without a name, or an unknown preset (from ``load_preset``).
    """
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
