"""What a Megatron-LM release (lines of core_v0.16.1 / 0.17.1 / 0.18.2 / 0.19.0 and main d98e8a6, whose
``package_info`` says 0.20.0: ``*_LINE``, ``PACKAGES``) fails on by its first iteration, for ``lagom doctor
--megatron-lm``; missing APEX or packages: errors locally, else warnings. A newer release gets the newest rules."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lagom_megatron.preflight.overlap import no_shard_finding
from lagom_megatron.preflight.types import Finding

RELEASES = ("core_v0.16", "core_v0.17", "core_v0.18", "core_v0.19", "core_v0.20")
"""Oldest first; ``core_v0.20`` stands for main (no core_v0.20 tag yet)."""

EVAL_INTERVAL_LINE = {
    "core_v0.16": "megatron/training/training.py:3307",
    "core_v0.17": "megatron/training/training.py:3547",
    "core_v0.18": "megatron/training/training.py:4136",
    "core_v0.19": "megatron/training/training.py:4481",
    "core_v0.20": "megatron/training/training.py:5436",
}
PERSIST_LAYER_NORM_LINE = {
    "core_v0.16": "megatron/core/transformer/torch_norm.py:30",
    "core_v0.17": "megatron/core/transformer/torch_norm.py:48",
    "core_v0.18": "megatron/core/transformer/torch_norm.py:48",
    "core_v0.19": "megatron/core/transformer/torch_norm.py:48",
    "core_v0.20": "megatron/core/transformer/torch_norm.py:50",
}
MASKED_SOFTMAX_LINE = dict.fromkeys(RELEASES, "megatron/core/fusions/fused_softmax.py:357")
FSDP_CKPT_LINE = {
    "core_v0.16": "megatron/training/arguments.py:690",
    "core_v0.17": "megatron/training/arguments.py:971",
    "core_v0.18": "megatron/training/arguments.py:1142",
    "core_v0.19": "megatron/training/arguments.py:1146",
    "core_v0.20": "megatron/training/arguments.py:1169",
}
SHARDING_DEFAULT = {
    "core_v0.16": ("no_shard", "megatron/training/arguments.py:2307"),
    "core_v0.17": ("no_shard", "megatron/training/arguments.py:2722"),
    "core_v0.18": ("optim_grads_params", "megatron/training/arguments.py:2805"),
    "core_v0.19": ("optim_grads_params", "megatron/training/arguments.py:3023"),
    "core_v0.20": ("optim_grads_params", "megatron/training/arguments.py:3190"),
}
"""Release -> (``--data-parallel-sharding-strategy``'s default, the parser line)."""
WEIGHT_HASH_LINE = {
    "core_v0.16": "megatron/training/arguments.py:684",
    "core_v0.17": "megatron/training/arguments.py:965",
    "core_v0.18": "megatron/training/arguments.py:1136",
    "core_v0.19": "megatron/training/arguments.py:1140",
    "core_v0.20": "megatron/training/arguments.py:1163",
}
DTENSOR_WITHOUT_FSDP_LINE = {
    "core_v0.16": "megatron/training/arguments.py:1050",
    "core_v0.17": "megatron/training/arguments.py:1341",
    "core_v0.18": "megatron/training/arguments.py:1507",
    "core_v0.19": "megatron/training/arguments.py:1621",
    "core_v0.20": "megatron/training/arguments.py:1676",
}
META_DEVICE_NO_SHARD_LINE = {
    "core_v0.18": "megatron/training/arguments.py:1151",
    "core_v0.19": "megatron/training/arguments.py:1160",
    "core_v0.20": "megatron/training/arguments.py:1183",
}
DISTOPT_FORCED_LINE = "core_v0.18.2 megatron/training/arguments.py:1113-1119"
"""From core_v0.18 Megatron-LM turns --use-distributed-optimizer on for Megatron-FSDP (main: for its version 1)."""
FSDP_V2_DISTOPT_LINE = {"core_v0.20": "megatron/training/arguments.py:1124-1126"}
PACKAGES: dict[str, dict[str, str]] = {
    "core_v0.16": {
        "six": "megatron/training/tokenizer/bert_tokenization.py:25",
        "regex": "megatron/training/tokenizer/gpt2_tokenization.py:25",
        "pybind11": "megatron/core/datasets/Makefile (the dataset helper's build)",
        "triton": "megatron/core/transformer/custom_layers/batch_invariant_kernels.py:15",
    },
    "core_v0.17": {"pybind11": "megatron/core/datasets/Makefile (the dataset helper's build)"},
    "core_v0.18": {
        "pybind11": "megatron/core/datasets/Makefile (the dataset helper's build)",
        "triton": "megatron/core/transformer/moe/paged_stash.py:8",
    },
    "core_v0.19": {
        "pybind11": "megatron/core/datasets/Makefile (the dataset helper's build)",
        "triton": "megatron/core/transformer/moe/ops/paged_stash.py:4",
    },
    "core_v0.20": {
        "pybind11": "megatron/core/datasets/Makefile (the dataset helper's build)",
        "triton": "megatron/core/transformer/moe/ops/paged_stash.py:4",
    },
}
"""Release -> {package: where Megatron-LM imports or needs it}."""


def _known() -> str:
    return ", ".join(r + ".x" for r in RELEASES) + " (core_v0.20: main), or newer"


def _numbers(release: str) -> tuple[int, int] | None:
    """(major, minor) of ``core_v0.19.1`` / ``0.19.1`` / ``core_v0.20.0rc1``; None when it names no release."""
    parts = release.strip().removeprefix("core_v").removeprefix("v").split(".")
    try:
        return int(parts[0]), int(parts[1].split("rc")[0])
    except (IndexError, ValueError):
        return None


_OLDEST, _NEWEST = _numbers(RELEASES[0]), _numbers(RELEASES[-1])


def release_key(release: str) -> str:
    """``core_v0.16.1`` / ``0.16.1`` / ``core_v0.16`` -> ``core_v0.16``; newer than RELEASES -> the newest's rules;
    ValueError naming ``release`` and the releases known when it is none of them."""
    numbers = _numbers(release)
    if numbers is None or numbers < _OLDEST:
        raise ValueError(f"{release!r} is not one of the Megatron-LM releases the doctor knows ({_known()})")
    return RELEASES[-1] if numbers > _NEWEST else f"core_v{numbers[0]}.{numbers[1]}"


def choose_release(given: str | None, installed: str | None) -> tuple[str | None, list[Finding]]:
    """The release whose traps check the line (None: no traps) and a warning when it is not a known one: ``given``
    is ``--megatron-lm-release`` (ValueError naming the flag for a value not a release), else the importable
    megatron-core's version; a newer release is checked with the newest rules, an older or unreadable one with none."""
    if given is not None:
        try:
            release_key(given)
        except ValueError as exc:
            raise ValueError(f"--megatron-lm-release {exc}") from None
        release = given
    else:
        release = f"core_v{installed}" if installed is not None else "core_v0.16.1"
        try:
            release_key(release)
        except ValueError:
            return None, [
                Finding(
                    "warning",
                    "megatron-lm",
                    f"Megatron-LM {release} (the importable megatron-core) is none of the releases the doctor knows "
                    f"({_known()})",
                    "its traps are unknown: only the layout and environment rules ran",
                    "pass --megatron-lm-release TAG to check the line with that release's traps",
                )
            ]
    if _numbers(release) > _NEWEST:
        return release, [
            Finding(
                "warning",
                "megatron-lm",
                f"Megatron-LM {release} is newer than the releases the doctor knows ({_known()})",
                f"its traps are checked with {RELEASES[-1]}'s (main's) rules and lines, which it may have changed",
                "update lagom-megatron, or check that release's own failures yourself",
            )
        ]
    return release, []


CHECKOUT = "megatron.training"
"""Importable from a Megatron-LM checkout, not from site-packages: megatron-core wheels ship ``megatron.training``
from 0.19 on, but they build no dataset helper at start (the wheel has no ``megatron/core/datasets/Makefile`` for
``compile_helpers``, ``megatron/training/initialize.py:173-178`` @core_v0.19.0), so a wheel's packages say nothing
about the checkout a Megatron-LM user runs."""


def _installed(module: str) -> bool:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if module == CHECKOUT:
        from lagom_megatron.megatron.hooks.versions import is_checkout

        return is_checkout(Path(next(iter(spec.submodule_search_locations or ()), spec.origin or "")))
    return True


def megatron_lm_traps(
    args: Mapping[str, Any],
    release: str,
    *,
    local: bool,
    installed: Callable[[str], bool] = _installed,
    on_gpu: bool = True,
) -> list[Finding]:
    """Failures of ``release`` that ``args`` meets, errors first (``on_gpu`` False: no triton); ValueError: unknown."""
    key = release_key(release)
    out: list[Finding] = []
    get = args.get
    level = "error" if local else "warning"
    where = "this Python" if local else "this Python (the cluster's may differ)"
    if get("eval_interval") is None and not get("skip_train") and not get("full_validation"):
        out.append(
            Finding(
                "error",
                "megatron-lm",
                f"no --eval-interval: Megatron-LM {release} computes train_iters // eval_interval",
                f"{EVAL_INTERVAL_LINE[key]} raises TypeError before the first iteration",
                "add --eval-interval N (and --eval-iters M), or --skip-train",
            )
        )
    local_layers = get("transformer_impl", "transformer_engine") == "local"
    # the local spec uses APEX's FusedLayerNorm when "import apex" works, else torch's
    # (megatron/core/models/gpt/gpt_layer_specs.py:58-72 in core_v0.16.1)
    if local_layers and not get("no_persist_layer_norm") and not installed("apex"):
        out.append(
            Finding(
                level,
                "megatron-lm",
                f"persistent layer norm (the default) with --transformer-impl local and no APEX in {where}",
                f"Megatron-LM {release} builds torch's LayerNorm, which asserts not persist_layer_norm "
                f"({PERSIST_LAYER_NORM_LINE[key]})",
                "add --no-persist-layer-norm, or install APEX",
            )
        )
    half = get("bf16") or get("fp16")
    seq = get("seq_length") or 0
    heads = (get("num_attention_heads") or 0) // max(int(get("tensor_model_parallel_size") or 1), 1)
    fused_shape = 16 < seq <= 4096 and seq % 4 == 0 and ((get("micro_batch_size") or 1) * heads) % 4 == 0
    if (
        local_layers
        and half
        and get("masked_softmax_fusion", True)
        and fused_shape
        and not installed("scaled_masked_softmax_cuda")
    ):
        out.append(
            Finding(
                level,
                "megatron-lm",
                f"masked-softmax fusion (the default) with --{'bf16' if get('bf16') else 'fp16'}, "
                f"--transformer-impl local and no APEX scaled_masked_softmax_cuda in {where}",
                f"Megatron-LM {release} imports it for these shapes ({MASKED_SOFTMAX_LINE[key]})",
                "add --no-masked-softmax-fusion, or install APEX with its CUDA extensions",
            )
        )
    if get("use_megatron_fsdp") and get("ckpt_format", "torch_dist") != "fsdp_dtensor":
        out.append(
            Finding(
                "error",
                "megatron-lm",
                f"--use-megatron-fsdp with --ckpt-format {get('ckpt_format', 'torch_dist')}",
                f"Megatron-LM {release} asserts ckpt_format == 'fsdp_dtensor' ({FSDP_CKPT_LINE[key]})",
                "add --ckpt-format fsdp_dtensor",
            )
        )
    out += _fsdp_traps(args, release, key)
    checkout_here = installed(CHECKOUT)
    missing = [
        (p, site)
        for p, site in PACKAGES[key].items()
        if checkout_here and not installed(p) and (on_gpu or p != "triton")
    ]
    for package, site in missing:
        out.append(
            Finding(
                level,
                "megatron-lm",
                f"Python package {package} is missing in {where}",
                f"Megatron-LM {release} needs it: {site}",
                "pip install 'lagom-megatron[megatron-lm]'"
                if package != "triton"
                else "pip install triton (CUDA torch wheels bring it), or on CPU start with "
                "python -m lagom_megatron.launch.megatron_lm_cpu",
            )
        )
    return out


def _fsdp_traps(args: Mapping[str, Any], release: str, key: str) -> list[Finding]:
    get = args.get
    out: list[Finding] = []
    if get("ckpt_format") == "fsdp_dtensor" and not get("use_megatron_fsdp"):
        out.append(
            Finding(
                "error",
                "megatron-lm",
                "--ckpt-format fsdp_dtensor without --use-megatron-fsdp",
                f"Megatron-LM {release} asserts use_megatron_fsdp for it ({DTENSOR_WITHOUT_FSDP_LINE[key]})",
                "add --use-megatron-fsdp or use --ckpt-format torch_dist",
            )
        )
    if not get("use_megatron_fsdp"):
        return out
    default, default_line = SHARDING_DEFAULT[key]
    strategy = get("data_parallel_sharding_strategy") or default
    if get("data_parallel_sharding_strategy") is None and strategy == "no_shard":
        out.append(no_shard_finding(f" (Megatron-LM {release}'s default, {default_line})"))
    if strategy == "optim_grads_params" and get("check_weight_hash_across_dp_replicas_interval") is not None:
        out.append(
            Finding(
                "error",
                "megatron-lm",
                "--check-weight-hash-across-dp-replicas-interval with --use-megatron-fsdp "
                "and --data-parallel-sharding-strategy optim_grads_params",
                f"Megatron-LM {release} asserts it is unset with optim_grads_params ({WEIGHT_HASH_LINE[key]}): "
                "each rank holds a different shard of the weights",
                "drop --check-weight-hash-across-dp-replicas-interval",
            )
        )
    if key in META_DEVICE_NO_SHARD_LINE and strategy == "no_shard" and get("init_model_with_meta_device"):
        out.append(
            Finding(
                "error",
                "megatron-lm",
                "--init-model-with-meta-device with --use-megatron-fsdp and no_shard",
                f"Megatron-LM {release} raises ValueError for it ({META_DEVICE_NO_SHARD_LINE[key]})",
                "drop --init-model-with-meta-device or shard (--data-parallel-sharding-strategy optim_grads_params)",
            )
        )
    if get("megatron_fsdp_version") == 2 and key in FSDP_V2_DISTOPT_LINE and get("use_distributed_optimizer"):
        out.append(
            Finding(
                "error",
                "megatron-lm",
                "--megatron-fsdp-version 2 with --use-distributed-optimizer",
                f"Megatron-LM {release} asserts Megatron-FSDP v2 runs without it ({FSDP_V2_DISTOPT_LINE[key]})",
                "drop --use-distributed-optimizer (Megatron-FSDP v2 shards the optimizer state itself)",
            )
        )
    if RELEASES.index(key) < RELEASES.index("core_v0.18") and not get("use_distributed_optimizer"):
        out.append(
            Finding(
                "warning",
                "megatron-lm",
                "--use-megatron-fsdp without --use-distributed-optimizer",
                f"Megatron-LM {release} then builds a non-distributed optimizer over Megatron-FSDP's parameters; "
                "Megatron-FSDP's user guide lists --use-distributed-optimizer among the required flags "
                "(docs/discussions/megatron-fsdp-user-guide/megatron-fsdp-user-guide.md) and "
                f"{DISTOPT_FORCED_LINE} turns it on itself",
                "add --use-distributed-optimizer",
            )
        )
    return out
