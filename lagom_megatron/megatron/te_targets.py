"""Where Transformer Engine, torch FSDP2 and Megatron-FSDP issue the collectives lagom hooks (names only; no patching).

``patches.install`` replaces the names these functions return. They are looked up where the
calling code looks them up at run time, checked against Transformer Engine v2.18 (git tag
``v2.18``; the module and autograd-function names exist in 1.x/2.x releases, the quantized gathers
since the versions ``QUANTIZED_GATHERS`` gives) and torch 2.6-2.14:

Transformer Engine (``transformer_engine.pytorch``):

* module classes ``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` (``module/linear.py``,
  ``module/layernorm_linear.py``, ``module/layernorm_mlp.py``): megatron-core's TE layers
  subclass them (mc0.16.1 ``extensions/transformer_engine.py``: ``TELinear(te.pytorch.Linear)``,
  ``TELayerNormColumnParallelLinear(te.pytorch.LayerNormLinear)``) and call ``super().forward``;
* their autograd functions ``_Linear``, ``_LayerNormLinear``, ``_LayerNormMLP``, whose
  ``backward`` issues the sequence-parallel all-gather of the input and the reduce-scatter of
  dgrad with ``async_op=True`` (v2.18 ``linear.py:947-951,1064-1068``,
  ``layernorm_linear.py:764-768,881-885``, ``layernorm_mlp.py:1189-1193,1587-1591``) through
  ``distributed.gather_along_first_dim`` / ``reduce_scatter_along_first_dim``, which call
  ``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor`` through the
  ``torch.distributed`` module (``distributed.py:1784-1789,948-950``), and the dgrad all-reduce
  without sequence parallelism through ``torch.distributed.all_reduce`` (``distributed.py:2025``);
* ``distributed._all_gather_mxfp8`` / ``_all_gather_nvfp4`` / ``_start_all_gather_fp8_blockwise``
  (``distributed.py:1509,1324,1076``; ``_all_gather_fp8_blockwise`` in v2.3-v2.11): the gather of
  a quantized input, several synchronous ``all_gather_into_tensor`` calls in one
  ``_coalescing_manager`` (``router_coalesced``), which ``gather_along_first_dim`` looks up as
  module globals (``distributed.py:1709-1749``);
* ``DotProductAttention`` (``attention/dot_product_attention/dot_product_attention.py``): reads
  ``self.cp_group`` at forward;
* the context-parallel module ``attention/dot_product_attention/context_parallel.py``:
  ``flash_attn_p2p_communicate`` (one ring step, ``:96-135``), looked up as a module global by
  ``AttnFuncWithCPAndKVP2P`` (``:1707,2469,2493``), and the autograd functions
  ``AttnFuncWithCPAndKVP2P``, ``AttnFuncWithCPAndQKVOA2A``, ``AttnFuncWithCPAndKVAllGather``.

Userbuffers (``--tp-comm-overlap``, TE ``module/base.py`` ``initialize_ub``) move the TP
collectives of TE layers into TE's own GEMM-fused kernels over CUDA IPC / multicast: not NCCL,
so nothing here reaches them (``userbuffers_note``).

torch FSDP2: ``FSDPParamGroup.unshard`` (issues the parameter all-gather of one FSDP unit) and
``FSDPParamGroup.post_backward`` (its gradient reduce-scatter, and the all-reduce under HSDP),
in ``torch.distributed.fsdp._fully_shard._fsdp_param_group`` (torch >= 2.6) or
``torch.distributed._composable.fsdp._fsdp_param_group`` (torch 2.4-2.5); megatron-core 0.16.1
wraps every ``TransformerLayer``, embedding and column-parallel output layer with ``fully_shard``
(``distributed/torch_fully_sharded_data_parallel.py:120-146``).

Megatron-FSDP (``--use-megatron-fsdp``): ``AllGatherPipeline`` / ``GradReducePipeline`` and the
module's ``_coalescing_manager`` in ``megatron_fsdp/param_and_grad_buffer.py``
(``find_megatron_fsdp``; ``router_fsdp`` cites the lines).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

log = logging.getLogger("lagom.patches")

@dataclass
class TeTargets:
    """The Transformer Engine names to hook (any may be missing: an older or partial install).

    Attributes:
        modules: module classes whose ``forward`` gets the module's named scope.
        functions: autograd ``Function`` classes whose backward runs in their forward's scope.
        attention: ``DotProductAttention`` (its ``cp_group`` is routed), or None.
        context_parallel: the module holding ``flash_attn_p2p_communicate``, or None.
    """

    modules: list[type] = field(default_factory=list)
    functions: list[type] = field(default_factory=list)
    attention: type | None = None
    context_parallel: ModuleType | None = None
    distributed: ModuleType | None = None
    """``transformer_engine.pytorch.distributed``, holding ``quantized_gathers``."""
    quantized_gathers: list[str] = field(default_factory=list)
    """The names of ``QUANTIZED_GATHERS`` this TE has."""


QUANTIZED_GATHERS = ("_all_gather_mxfp8", "_all_gather_nvfp4", "_start_all_gather_fp8_blockwise",
                     "_all_gather_fp8_blockwise")
"""TE ``pytorch/distributed.py`` helpers that gather a quantized tensor in one coalesced call,
each ``(inp, process_group, *, async_op, quantizer, out_shape) -> (out, handle)``: MXFP8 (v2.0+,
v2.18 ``:1509``), NVFP4 (v2.8+, v2.18 ``:1324``), FP8 block scaling (v2.12+
``_start_all_gather_fp8_blockwise``, v2.18 ``:1076``; v2.3-v2.11 ``_all_gather_fp8_blockwise``,
v2.11 ``:1066``, synchronous only before v2.5)."""


_TE_MODULES = (("module.linear", "Linear", "_Linear"), ("module.layernorm_linear", "LayerNormLinear", "_LayerNormLinear"),
               ("module.layernorm_mlp", "LayerNormMLP", "_LayerNormMLP"))
_CP_MODULES = ("attention.dot_product_attention.context_parallel", "attention")
_CP_FUNCTIONS = ("AttnFuncWithCPAndKVP2P", "AttnFuncWithCPAndQKVOA2A", "AttnFuncWithCPAndKVAllGather")
_DPA_MODULES = ("attention.dot_product_attention.dot_product_attention", "attention")


def _import(name: str) -> ModuleType | None:
    """``importlib.import_module(name)``; None when it is missing or fails to import (logged: TE
    installed on a host where its CUDA libraries do not load raises other errors than ImportError)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: not hooked, training goes on
        log.warning("lagom: %s is installed but does not import (%s: %s); its collectives are not hooked",
                    name, type(exc).__name__, exc)
        return None


def _module(base: str, name: str) -> ModuleType | None:
    return _import(f"{base}.{name}")


def find_te_targets(base: str = "transformer_engine.pytorch") -> TeTargets | None:
    """The ``TeTargets`` of the Transformer Engine importable as ``base``; None when it is not
    installed or does not import (a warning is logged for the latter).

    ``base`` is a package laid out as TE's ``transformer_engine.pytorch`` (tests pass a stand-in).
    """
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
    """torch FSDP2's ``FSDPParamGroup`` class (module docstring), or None on a torch without FSDP2."""
    for path in ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                 "torch.distributed._composable.fsdp._fsdp_param_group"):
        try:
            cls = getattr(importlib.import_module(path), "FSDPParamGroup", None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    return None


MEGATRON_FSDP_MODULES = ("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
                         "megatron_fsdp.param_and_grad_buffer")
"""Where Megatron-FSDP's pipelines live: the copy megatron-core imports (0.16.1-0.18.2 and
Megatron-LM's main, ``distributed/fsdp/mcore_fsdp_adapter.py:48``), and the ``megatron-fsdp``
package's."""


def find_megatron_fsdp() -> list[ModuleType]:
    """Each importable Megatron-FSDP ``param_and_grad_buffer`` module with ``AllGatherPipeline``
    (``all_gather_params``, ``async_bucket_gather``, ``get_fsdp_buffer``), ``GradReducePipeline``
    (``_bucket_group_gradient_reduce``, ``get_fsdp_buffer``) and its own ``_coalescing_manager``
    name (``router_fsdp``); empty when none is installed."""
    found = []
    for path in MEGATRON_FSDP_MODULES:
        mod = _import(path)
        if mod is None or any(m is mod for m in found):
            continue
        ag, rs = getattr(mod, "AllGatherPipeline", None), getattr(mod, "GradReducePipeline", None)
        if (callable(getattr(mod, "_coalescing_manager", None))
                and all(hasattr(ag, n) for n in ("all_gather_params", "async_bucket_gather", "get_fsdp_buffer"))
                and all(hasattr(rs, n) for n in ("_bucket_group_gradient_reduce", "get_fsdp_buffer"))):
            found.append(mod)
    return found


def userbuffers_note(model_configs: Any) -> str | None:
    """A warning when a model config has ``tp_comm_overlap`` (TE userbuffers), else None.

    Userbuffer kernels are not NCCL: lagom neither sees nor tunes them, and the SMs they hold
    (TE's per-buffer ``num_sm``: 16 for the pipeline and bulk methods, 1 for ring exchange; TE v2.18
    ``module/base.py:360,379``)
    are not subtracted from the compute and NCCL channels that the cost model plans for the other
    sites, so predictions for sites that overlap a userbuffer GEMM are optimistic.
    """
    if not any(getattr(cfg, "tp_comm_overlap", False) for cfg in model_configs or ()):
        return None
    return ("lagom: WARNING: --tp-comm-overlap: Transformer Engine userbuffers carry the tensor-parallel "
            "collectives of TE layers outside NCCL; lagom does not hook or tune them, and the SMs their "
            "kernels hold are not in its cost model (predictions for sites overlapping them are optimistic)")
