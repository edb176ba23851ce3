"""Pre-flight rules for value domains the libraries check only after the process groups exist: ``torch/optim/adam.py``,
``np.random.seed`` (0..2**32 - 1), megatron-core ``blended_megatron_dataset_config.py:155-172`` (``--split``)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from lagom_megatron.preflight.types import Finding, RunShape, flag

SIZES = (
    "ffn_hidden_size",
    "kv_channels",
    "max_position_embeddings",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "distributed_timeout_minutes",
)
SEED_MAX = 2**32 - 1


SPLIT = re.compile(r"\s*(\d+\.?\d*|\.\d+)(\s*[,/]\s*(\d+\.?\d*|\.\d+)){0,2}\s*")
"""A ``--split`` as Megatron-LM documents it (megatron-core's parser silently drops anything else)."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rule_values(s: RunShape) -> list[Finding]:
    """One error per flag outside its domain."""
    out = []

    def bad(dest: str, value: object, allowed: str, why: str) -> None:
        out.append(
            Finding(
                "error",
                "values",
                f"{flag(dest)} {value!r} is out of range; allowed: {allowed}",
                why,
                f"give {flag(dest)} a value in {allowed}",
            )
        )

    adam = "torch.optim.Adam refuses it when megatron-core builds the optimizer (torch/optim/adam.py)"
    for dest, allowed, ok in (
        ("lr", ">= 0", lambda v: v >= 0),
        ("min_lr", ">= 0", lambda v: v >= 0),
        ("adam_eps", ">= 0", lambda v: v >= 0),
        ("weight_decay", ">= 0", lambda v: v >= 0),
        ("adam_beta1", "[0, 1)", lambda v: 0 <= v < 1),
        ("adam_beta2", "[0, 1)", lambda v: 0 <= v < 1),
        ("clip_grad", ">= 0", lambda v: v >= 0),
    ):
        value = s.args.get(dest)
        if _number(value) and not ok(value):
            bad(
                dest,
                value,
                allowed,
                adam
                if dest != "clip_grad"
                else "gradient clipping scales by max_norm / norm; a negative bound flips the gradients",
            )
    seed = s.args.get("seed")
    if _number(seed) and not (isinstance(seed, int) and 0 <= seed <= SEED_MAX):
        bad("seed", seed, f"0..{SEED_MAX}", "numpy's np.random.seed refuses anything else when the loop seeds it")
    for dest in SIZES:
        value = s.args.get(dest)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            bad(dest, value, "an integer >= 1", "a size of zero or less breaks the model or the process groups")
    split = s.args.get("split")
    if isinstance(split, str):
        parts = [float(x) for x in re.findall(r"[.0-9]+", split) if x != "."]
        if not SPLIT.fullmatch(split) or not parts or len(parts) > 3 or sum(parts) <= 0 or parts[0] <= 0:
            bad(
                "split",
                split,
                "up to three weights >= 0 separated by commas, e.g. 969,30,1, with a training weight > 0",
                "megatron-core's parse_and_normalize_split takes every run of digits and dots as a "
                "weight (so 90,abc5,5 would train as 90,5,5), asserts three parts >= 0 and divides by their sum "
                "(blended_megatron_dataset_config.py:155-172)",
            )
    return out


NVTE_ATTN = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
ATTN_ENV = {"local": "000", "flash": "100", "fused": "010", "unfused": "001", "auto": "111"}
"""What megatron-core 0.16.1 sets :data:`NVTE_ATTN` to per ``--attention-backend`` (and asserts when already set;
``models/common/language_module/language_module.py:98-127``)."""


def _layers_per_chunk(args: Mapping[str, Any]) -> int | None:
    layers, pp = args.get("num_layers"), args.get("pipeline_model_parallel_size") or 1
    if (
        args.get("decoder_first_pipeline_num_layers")
        or args.get("decoder_last_pipeline_num_layers")
        or not isinstance(layers, int)
        or not isinstance(pp, int)
        or layers < 1
        or pp < 1
        or layers % pp
    ):
        return None
    per_stage = layers // pp
    per_vstage = args.get("num_layers_per_virtual_pipeline_stage")
    vstages = args.get("num_virtual_stages_per_pipeline_rank")
    if isinstance(per_vstage, int) and per_vstage >= 1:
        return per_vstage
    if isinstance(vstages, int) and vstages >= 1:
        return per_stage // vstages if per_stage % vstages == 0 else None
    return per_stage


def megatron_flag_problems(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> list[Finding]:
    """Megatron-LM's ``validate_args`` and megatron-core's ``__post_init__`` checks of the parity flags; ``environ``
    None skips ``NVTE_*_ATTN``. Megatron-LM core_v0.16.1 ``arguments.py:321-322, 614, 716-718, 884-893, 899-902``;
    megatron-core 0.16.1 ``transformer_config.py:300-311, 1166-1191``, ``transformer_block.py:460-470, 532-542``,
    ``optimizer_param_scheduler.py:160-161, 259-265``."""
    out: list[Finding] = []

    def bad(rule: str, what: str, why: str, fix: str) -> None:
        out.append(Finding("error", rule, what, why, fix))

    std = args.get("init_method_std")
    if _number(std) and not (math.isfinite(std) and std >= 0):
        bad(
            "init-method-std",
            f"--init-method-std {std!r} is out of range; allowed: a finite number >= 0",
            "megatron-core draws the weights with torch.nn.init.normal_(std=...), which refuses a negative or NaN "
            "std on every rank while the model is built (transformer_config.py:300-311)",
            "give --init-method-std >= 0 (Megatron-LM's default is 0.02)",
        )
    gran, method, n = args.get("recompute_granularity"), args.get("recompute_method"), args.get("recompute_num_layers")
    if gran is None and args.get("recompute_activations"):
        gran = "selective"  # arguments.py:430-431
    recompute = (
        "activation recomputation is checked by megatron-core's TransformerConfig.__post_init__ on every "
        "rank (transformer_config.py:1154-1185; arguments.py:899-902)"
    )
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        bad(
            "recompute",
            f"--recompute-num-layers {n!r} is out of range; allowed: an integer >= 1",
            recompute,
            "give --recompute-num-layers >= 1 (layers per recomputed unit, or per pipeline stage with block)",
        )
    elif gran == "selective" and (method is not None or n is not None):
        bad(
            "recompute",
            "--recompute-granularity selective takes no --recompute-method nor --recompute-num-layers; "
            f"got {method} and {n}",
            recompute,
            "drop --recompute-method and --recompute-num-layers",
        )
    elif gran == "full" and (method is None or n is None):
        bad(
            "recompute",
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            f"--recompute-num-layers >= 1; got {method} and {n}",
            recompute,
            "add both flags",
        )
    elif gran is None and (method is not None or n is not None):
        bad(
            "recompute",
            f"--recompute-method and --recompute-num-layers need --recompute-granularity full; got {method} and {n}",
            "megatron-core ignores them without a granularity (the run would not recompute)",
            "add --recompute-granularity full, or drop them",
        )
    per_chunk = _layers_per_chunk(args)
    if gran == "full" and method == "uniform" and isinstance(n, int) and n >= 1 and per_chunk and per_chunk % n:
        bad(
            "recompute",
            f"--recompute-num-layers {n} does not divide the {per_chunk} layers of each model chunk "
            "(--num-layers / --pipeline-model-parallel-size / virtual stages); allowed with --recompute-method "
            f"uniform: a divisor of {per_chunk}",
            "uniform recomputation checkpoints layers [i, i + n) for i = 0, n, "
            "2n, ... and indexes past the chunk's last layer: an IndexError in the first forward on every rank "
            "(transformer_block.py:460-470, 532-542)",
            "use a divisor, or --recompute-method block",
        )
    if args.get("distribute_saved_activations"):
        tp = args.get("tensor_model_parallel_size") or 1
        if tp <= 1 or gran != "full" or method is None or args.get("sequence_parallel"):
            bad(
                "recompute",
                f"--distribute-saved-activations needs --tensor-model-parallel-size > 1 (got {tp}), "
                f"--recompute-granularity full (got {gran}), a --recompute-method (got {method}) and no "
                "--sequence-parallel",
                "arguments.py:884-893; transformer_config.py:1187-1191",
                "drop --distribute-saved-activations or meet all four",
            )
    backend = args.get("attention_backend")
    backend = getattr(backend, "name", backend)  # a Megatron-LM namespace holds the AttnBackend enum
    if backend == "local" and args.get("transformer_impl") != "local":
        bad(
            "attention-backend",
            "--attention-backend local needs --transformer-impl local; got "
            f"--transformer-impl {args.get('transformer_impl')}",
            "Megatron-LM asserts the local layer spec with it (arguments.py:321-322); Transformer Engine's "
            "layers would get all three NVTE_*_ATTN set to 0",
            "add --transformer-impl local, or pick another backend",
        )
    if environ is not None and backend in ATTN_ENV:
        for name, want in zip(NVTE_ATTN, ATTN_ENV[backend]):
            have = environ.get(name)
            if have is not None and have != want:
                bad(
                    "attention-backend",
                    f"{name}={have} contradicts --attention-backend {backend}; allowed: {name} unset or {want}",
                    "megatron-core's LanguageModule asserts it while the model is built "
                    "on every rank (language_module.py:98-127)",
                    f"unset {', '.join(NVTE_ATTN)} and choose the kernel with --attention-backend",
                )
    if args.get("lr_decay_style") == "WSD":
        wsd = args.get("lr_wsd_decay_iters")
        decay = args.get("lr_decay_iters") or args.get("train_iters")
        if not isinstance(wsd, int) or wsd < 1:
            bad(
                "lr-schedule",
                f"--lr-decay-style WSD needs --lr-wsd-decay-iters >= 1 (the iterations of the decay phase); got {wsd}",
                "megatron-core's OptimizerParamScheduler asserts it (optimizer_param_scheduler.py:160-161)",
                "add --lr-wsd-decay-iters N",
            )
        elif isinstance(decay, int) and wsd > decay:
            bad(
                "lr-schedule",
                f"--lr-wsd-decay-iters {wsd} is out of range; allowed: 1..{decay} (--lr-decay-iters, "
                "default --train-iters)",
                "the WSD decay phase starts at lr-decay-iters - lr-wsd-decay-iters "
                "(optimizer_param_scheduler.py:259-265): before step 0, so the run starts part-way down the decay",
                f"give --lr-wsd-decay-iters <= {decay}",
            )
    if (
        args.get("bf16")
        and args.get("accumulate_allreduce_grads_in_fp32")
        and str(args.get("main_grads_dtype") or "fp32").rsplit(".", 1)[-1] not in ("fp32", "float32")
    ):
        bad(
            "grad-reduce",
            f"--accumulate-allreduce-grads-in-fp32 with --bf16 needs --main-grads-dtype fp32; got "
            f"{args.get('main_grads_dtype')}",
            "Megatron-LM asserts it (arguments.py:716-718)",
            "use --main-grads-dtype fp32 or drop --accumulate-allreduce-grads-in-fp32",
        )
    if args.get("use_torch_fsdp2") and args.get("gradient_accumulation_fusion", True):
        bad(
            "grad-reduce",
            "--use-torch-fsdp2 needs --no-gradient-accumulation-fusion",
            "Megatron-LM asserts it (arguments.py:614)",
            "add --no-gradient-accumulation-fusion",
        )
    budget = args.get("lagom_pool_budget_mib")
    if budget is not None and not (_number(budget) and math.isfinite(budget) and budget > 0):
        bad(
            "pool-budget",
            f"--lagom-pool-budget-mib {budget!r} is out of range; allowed: a finite number > 0 (MiB per rank)",
            "lagom converts it to bytes with int(mib * 2**20) on every rank (inf and NaN raise) "
            "and a budget of 0 keeps every site on NCCL's defaults",
            "give a budget in MiB, e.g. 512 (the default)",
        )
    return out


def rule_megatron_flags(s: RunShape) -> list[Finding]:
    return megatron_flag_problems(s.args, s.environ)


def rule_versions(s: RunShape) -> list[Finding]:
    """Local runs: torch and megatron-core inside the tested ranges unless allowed (a warning for a Megatron-LM line
    without ``--lagom``, which Megatron-LM's loop runs as it would without lagom); imports neither."""
    from lagom_megatron.megatron.hooks.versions import ALLOW_UNTESTED_ENV, untested_versions

    if (
        not s.local
        or s.get("lagom_allow_untested_versions", False)
        or s.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0")
    ):
        return []
    if s.megatron_lm and not s.lagom:
        level, why = "warning", "without --lagom Megatron-LM's loop runs with a warning (with --lagom it refuses: "
    else:
        level, why = "error", "training refuses to start ("
    return [
        Finding(
            level,
            "versions",
            p,
            f"lagom hooks private names that move between releases; {why}docs/training.md, Tested versions)",
            f"install a tested version, or pass --lagom-allow-untested-versions ({ALLOW_UNTESTED_ENV}=1)",
        )
        for p in untested_versions()
    ]
