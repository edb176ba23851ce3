"""Where TE, FSDP2 and Megatron-FSDP issue the collectives lagom hooks (names only; TE v2.18, torch 2.6-2.14). TE's
``_Linear`` / ``_LayerNormLinear`` / ``_LayerNormMLP`` backward: async SP collectives (``linear.py:947-951,1064-1068``,
``layernorm_linear.py:764-768,881-885``, ``layernorm_mlp.py:1189-1193,1587-1591``) via ``torch.distributed``
(``distributed.py:1784-1789,948-950``; all-reduce ``:2025``); quantized gathers: globals (``:1709-1749``); TE's
``flash_attn_p2p_communicate`` (``context_parallel.py:96-135``) is looked up at ``:1707,2469,2493``. mc0.16.1
``extensions/transformer_engine.py`` wraps them; FSDP2: ``distributed/torch_fully_sharded_data_parallel.py:120-146``."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

log = logging.getLogger("lagom.patches")


@dataclass
class TeTargets:
    """The Transformer Engine names to hook (any may be missing: an older or partial install)."""

    modules: list[type] = field(default_factory=list)
    functions: list[type] = field(default_factory=list)
    attention: type | None = None
    context_parallel: ModuleType | None = None
    distributed: ModuleType | None = None
    quantized_gathers: list[str] = field(default_factory=list)


QUANTIZED_GATHERS = (
    "_all_gather_mxfp8",
    "_all_gather_nvfp4",
    "_start_all_gather_fp8_blockwise",
    "_all_gather_fp8_blockwise",
)
"""TE ``pytorch/distributed.py`` quantized gathers: MXFP8 (v2.0+, v2.18 ``:1509``), NVFP4 (v2.8+, ``:1324``), FP8
blocks (v2.12+, ``:1076``; v2.3-v2.11 ``_all_gather_fp8_blockwise``, v2.11 ``:1066``, synchronous before v2.5)."""


_TE_MODULES = (
    ("module.linear", "Linear", "_Linear"),
    ("module.layernorm_linear", "LayerNormLinear", "_LayerNormLinear"),
    ("module.layernorm_mlp", "LayerNormMLP", "_LayerNormMLP"),
)
_CP_MODULES = ("attention.dot_product_attention.context_parallel", "attention")
_CP_FUNCTIONS = ("AttnFuncWithCPAndKVP2P", "AttnFuncWithCPAndQKVOA2A", "AttnFuncWithCPAndKVAllGather")
_DPA_MODULES = ("attention.dot_product_attention.dot_product_attention", "attention")


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: not hooked, training goes on
        log.warning(
            "lagom: %s is installed but does not import (%s: %s); its collectives are not hooked",
            name,
            type(exc).__name__,
            exc,
        )
        return None


def _module(base: str, name: str) -> ModuleType | None:
    return _import(f"{base}.{name}")


def find_te_targets(base: str = "transformer_engine.pytorch") -> TeTargets | None:
    """The ``TeTargets`` of the TE laid out as ``base``; None when it is not installed or does not import (logged)."""
    if _import(base) is None:
        return None
    targets = TeTargets()
    for mod_name, cls_name, fn_name in _TE_MODULES:
        mod = _module(base, mod_name)
        if mod is None:
            continue
        if isinstance(getattr(mod, cls_name, None), type):
            targets.modules.append(getattr(mod, cls_name))
        if isinstance(getattr(mod, fn_name, None), type):
            targets.functions.append(getattr(mod, fn_name))
    dist_mod = _module(base, "distributed")
    if dist_mod is not None:
        targets.distributed = dist_mod
        targets.quantized_gathers = [n for n in QUANTIZED_GATHERS if callable(getattr(dist_mod, n, None))]
    for mod_name in _DPA_MODULES:
        mod = _module(base, mod_name)
        if mod is not None and isinstance(getattr(mod, "DotProductAttention", None), type):
            targets.attention = mod.DotProductAttention
            break
    for mod_name in _CP_MODULES:
        mod = _module(base, mod_name)
        if mod is not None and callable(getattr(mod, "flash_attn_p2p_communicate", None)):
            targets.context_parallel = mod
            targets.functions.extend(getattr(mod, n) for n in _CP_FUNCTIONS if isinstance(getattr(mod, n, None), type))
            break
    return targets


def find_fsdp2_param_group() -> type | None:
    """torch FSDP2's ``FSDPParamGroup`` class, or None on a torch without FSDP2."""
    for path in (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",  # torch >= 2.6, then 2.4-2.5
        "torch.distributed._composable.fsdp._fsdp_param_group",
    ):
        try:
            cls = getattr(importlib.import_module(path), "FSDPParamGroup", None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    return None


MEGATRON_FSDP_MODULES = (
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
    "megatron_fsdp.param_and_grad_buffer",
)
"""Megatron-FSDP in megatron-core 0.16.1 to main (``distributed/fsdp/mcore_fsdp_adapter.py:48`` @core_v0.18.2, ``:49``
@core_v0.19.0, ``:47`` @main) and megatron-fsdp."""


def find_megatron_fsdp() -> list[ModuleType]:
    """Each importable Megatron-FSDP ``param_and_grad_buffer`` module with the names ``router_fsdp`` hooks."""
    found = []
    for path in MEGATRON_FSDP_MODULES:
        mod = _import(path)
        if mod is None or any(m is mod for m in found):
            continue
        ag, rs = getattr(mod, "AllGatherPipeline", None), getattr(mod, "GradReducePipeline", None)
        if (
            callable(getattr(mod, "_coalescing_manager", None))
            and all(hasattr(ag, n) for n in ("all_gather_params", "async_bucket_gather", "get_fsdp_buffer"))
            and all(hasattr(rs, n) for n in ("_bucket_group_gradient_reduce", "get_fsdp_buffer"))
        ):
            found.append(mod)
    return found


def userbuffers_note(model_configs: Any) -> str | None:
    """A warning when a model config has ``tp_comm_overlap``: TE userbuffers are not NCCL, and their SMs
    (``num_sm`` 16 / 1, TE v2.18 ``module/base.py:360,379``) are not in the cost model; else None."""
    if not any(getattr(cfg, "tp_comm_overlap", False) for cfg in model_configs or ()):
        return None
    return (
        "lagom: WARNING: --tp-comm-overlap: Transformer Engine userbuffers carry the tensor-parallel "
        "collectives of TE layers outside NCCL; lagom does not hook or tune them, and the SMs their "
        "kernels hold are not in its cost model (predictions for sites overlapping them are optimistic)"
    )
