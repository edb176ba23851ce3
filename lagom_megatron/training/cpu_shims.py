"""Shims that let Megatron-Core 0.16.1 train a GPTModel on CPU with gloo (checked with torch 2.13.0): process-global
patches of ``torch.cuda`` / ``torch.Tensor``, to apply before the model, DDP wrapper or optimizer is built."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch

_ORIGINALS: list[tuple[Any, str, Any]] = []
"""(owner, attribute, original own value or _MISSING) in installation order; empty when not applied."""

_DEVICE_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = torch.zeros([], device="cuda")
    "megatron.core.transformer.utils",  # get_default_causal_mask: torch.ones(..., device="cuda")
    "megatron.core.optimizer.optimizer",  # _scale / _dummy_overflow_buf: torch.tensor(..., device="cuda")
    "megatron.core.optimizer.distrib_optimizer",  # grad-norm and overflow buffers on "cuda"
    "megatron.core.optimizer.clip_grads",  # total_norm / dummy_overflow_buf on "cuda"
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors on "cuda"
    "megatron.core.utils",  # local_multi_tensor_l2_norm: torch.tensor(device="cuda")
)
"""Modules that pass ``device="cuda"`` literals to tensor factories; they get a torch proxy."""

_CUDA_TYPE_CALLERS = frozenset(
    {
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.clip_grads",
    }
)
"""Modules whose ``tensor.type()`` calls get the CUDA type name of a CPU tensor."""


def _cpu_device(device: Any) -> Any:
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda:"):
        return "cpu"
    return device


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by one Megatron module (:func:`make_cpu_torch`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def make_cpu_torch() -> _CpuTorch:
    """A stand-in for ``torch`` whose tensor factories put a ``"cuda"`` / ``cuda:N`` device on the CPU."""
    proxy = _CpuTorch("lagom_cpu_torch")
    for name in ("zeros", "empty", "ones", "tensor", "full", "arange", "rand", "randn", "randint"):
        factory = getattr(torch, name)

        def cpu_factory(*args, _factory=factory, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return _factory(*args, **kwargs)

        setattr(proxy, name, cpu_factory)
    return proxy


_MISSING = object()


FORWARD_P2P_TAG = 1
"""gloo tag of activations (send_next -> recv_prev)."""
BACKWARD_P2P_TAG = 2
"""gloo tag of gradients (send_prev -> recv_next)."""


def _tagged_p2p_ops(*, as_dict: bool):
    """``p2p_communication._batched_p2p_ops`` / ``_p2p_ops`` (``as_dict``) with one tag per direction."""
    import torch.distributed as dist

    def p2p_ops(
        *,
        tensor_send_prev,
        tensor_recv_prev,
        tensor_send_next,
        tensor_recv_next,
        group,
        prev_pipeline_rank,
        next_pipeline_rank,
    ):
        reqs = {}
        if tensor_send_next is not None:
            reqs["send_next"] = dist.isend(tensor_send_next, next_pipeline_rank, group=group, tag=FORWARD_P2P_TAG)
        if tensor_recv_prev is not None:
            reqs["recv_prev"] = dist.irecv(tensor_recv_prev, prev_pipeline_rank, group=group, tag=FORWARD_P2P_TAG)
        if tensor_send_prev is not None:
            reqs["send_prev"] = dist.isend(tensor_send_prev, prev_pipeline_rank, group=group, tag=BACKWARD_P2P_TAG)
        if tensor_recv_next is not None:
            reqs["recv_next"] = dist.irecv(tensor_recv_next, next_pipeline_rank, group=group, tag=BACKWARD_P2P_TAG)
        return reqs if as_dict else list(reqs.values())

    return p2p_ops


def set_recorded(originals: list, owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, recording the owner's own entry (not an inherited one) for :func:`restore`."""
    originals.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def restore(originals: list) -> None:
    """Undoes the :func:`set_recorded` calls of ``originals``, last first, and empties it."""
    while originals:
        owner, name, value = originals.pop()
        if value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)


def _set(owner: Any, name: str, value: Any) -> None:
    set_recorded(_ORIGINALS, owner, name, value)


def is_applied() -> bool:
    """True while the shims are installed."""
    return bool(_ORIGINALS)


def apply(force: bool = False) -> bool:
    """Installs the CPU shims without CUDA (``force``: anyway, tests only); True if installed after the call."""
    if _ORIGINALS:
        return True
    if torch.cuda.is_available() and not force:
        return False
    import megatron.core.tensor_parallel.random as mc_random
    from megatron.core.transformer import torch_norm

    # model_parallel_cuda_manual_seed -> CudaRNGStatesTracker.add() calls torch.cuda.get_rng_state()
    # and torch.cuda.manual_seed(); fork() (dropout inside tensor-parallel regions) calls
    # _get_cuda_rng_state/_set_cuda_rng_state. Keep those RNG states in the CPU generator.
    _set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _set(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    _set(mc_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(mc_random, "_set_cuda_rng_state", lambda new_state, *a, **k: torch.set_rng_state(new_state))

    # _ParamAndGradBuffer (DDP), p2p_communication recv buffers, tensor_parallel mappings/layers and
    # GPTModel allocate with device=torch.cuda.current_device(); "cpu" is a valid device there.
    _set(torch.cuda, "current_device", lambda: "cpu")

    # P2PCommunicator._communicate calls torch.cuda.synchronize() after batch_isend_irecv when
    # batch_p2p_sync is on (the default); gloo's wait() already synchronises.
    _set(torch.cuda, "synchronize", lambda *a, **k: None)

    # LanguageModule.setup_embeddings_and_output_layer moves the tied output weight with
    # weight.data.cuda() when PP > 1; on CPU the tensor stays where it is.
    _set(torch.Tensor, "cuda", lambda self, *a, **k: self)

    # DistributedOptimizer._build_model_and_main_param_groups and
    # Float16OptimizerWithFloat16Params.__init__ accept only params whose param.type() is
    # 'torch.cuda.{Float,Half,BFloat16}Tensor', and clip_grad_by_total_norm_fp32 asserts
    # grad.type() == 'torch.cuda.FloatTensor'. Answer with the CUDA name for calls made from those
    # modules only; everyone else sees the true type.
    original_type = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        result = original_type(self, *args, **kwargs)
        if (
            not args
            and not kwargs
            and isinstance(result, str)
            and result.startswith("torch.")
            and ".cuda." not in result
            and sys._getframe(1).f_globals.get("__name__") in _CUDA_TYPE_CALLERS
        ):
            return "torch.cuda." + result[len("torch.") :]
        return result

    _set(torch.Tensor, "type", tensor_type)

    # WrappedTorchNorm.__new__ (the local layer spec's LayerNorm) asserts not
    # config.sequence_parallel. Build it with SP off and mark its parameters sequence_parallel=True,
    # which makes finalize_model_grads all-reduce their gradients over the TP group, as TE does.
    original_new = torch_norm.WrappedTorchNorm.__dict__["__new__"].__func__

    def norm_new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            module = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in module.parameters():
            param.sequence_parallel = sequence_parallel
        return module

    _set(torch_norm.WrappedTorchNorm, "__new__", staticmethod(norm_new))

    # P2PCommunicator._communicate posts untagged p2p; with PP = 2 previous and next stage are one rank,
    # gloo matches untagged messages in posting order, and the interleaved schedule posts in different
    # orders on the two ranks: a gradient can land in an activation buffer. One tag per direction.
    from megatron.core.pipeline_parallel import p2p_communication

    _set(p2p_communication, "_batched_p2p_ops", _tagged_p2p_ops(as_dict=False))
    _set(p2p_communication, "_p2p_ops", _tagged_p2p_ops(as_dict=True))

    # device="cuda" literals in the modules listed in _DEVICE_LITERAL_MODULES.
    proxy = make_cpu_torch()
    for module_name in _DEVICE_LITERAL_MODULES:
        _set(importlib.import_module(module_name), "torch", proxy)
    return True


def remove() -> None:
    """Restores every original patched by :func:`apply` (no-op when not applied)."""
    restore(_ORIGINALS)
