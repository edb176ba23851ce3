"""Process-global ``torch.cuda`` / ``torch.Tensor`` patches: Megatron-Core 0.16.1 to 0.20 (main) on CPU with gloo."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch

_ORIGINALS: list[tuple[Any, str, Any]] = []
"""(owner, attribute, original own value or _MISSING) in installation order."""

_DEVICE_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = torch.zeros([], device="cuda")
    "megatron.core.transformer.utils",  # get_default_causal_mask: torch.ones(..., device="cuda")
    "megatron.core.optimizer.optimizer",  # _scale / _dummy_overflow_buf: torch.tensor(..., device="cuda")
    "megatron.core.optimizer.distrib_optimizer",  # grad-norm and overflow buffers on "cuda"
    "megatron.core.optimizer.clip_grads",  # total_norm / dummy_overflow_buf on "cuda"
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors on "cuda"
    "megatron.core.utils",  # local_multi_tensor_l2_norm: torch.tensor(device="cuda")
)

_STREAM_MODULES = ("megatron.core.distributed.param_and_grad_buffer",)
"""Modules that ask ``torch.cuda`` for the current stream without a CUDA check: ``start_grad_sync`` waits on
``current_stream()`` for CUDA-graph events (``param_and_grad_buffer.py:632,638`` @core_v0.19.0, ``:638,644`` @main)."""

_CUDA_TYPE_CALLERS = frozenset(
    {
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.clip_grads",
    }
)


def _cpu_device(device: Any) -> Any:
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda:"):
        return "cpu"
    return device


class NoStream:
    """A CUDA stream on CPU (``torch.cuda.Stream`` / ``current_stream()``): gloo's work is synchronous, so waits
    on other streams and events are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuCuda(types.ModuleType):
    """``torch.cuda`` for the shimmed modules: ``current_stream()`` is a :class:`NoStream`, the rest torch.cuda's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_stream(device: Any = None) -> NoStream:
        return NoStream()


class _CpuTorch(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def make_cpu_torch(cuda: type[CpuCuda] = CpuCuda) -> _CpuTorch:
    """``torch`` whose tensor factories put a ``"cuda"`` / ``cuda:N`` device on the CPU, with ``cuda`` a ``cuda``."""
    proxy = _CpuTorch("lagom_cpu_torch")
    proxy.cuda = cuda("lagom_cpu_torch.cuda")
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
BACKWARD_P2P_TAG = 2


def _tagged_p2p_ops(*, as_dict: bool):
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
    """Undoes the :func:`set_recorded` calls of ``originals``, last first."""
    while originals:
        owner, name, value = originals.pop()
        if value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)


def _set(owner: Any, name: str, value: Any) -> None:
    set_recorded(_ORIGINALS, owner, name, value)


def is_applied() -> bool:
    return bool(_ORIGINALS)


def apply(force: bool = False) -> bool:
    """Installs the shims without CUDA (``force``: anyway), before model, DDP or optimizer; True if installed."""
    if _ORIGINALS:
        return True
    if torch.cuda.is_available() and not force:
        return False
    import megatron.core.tensor_parallel.random as mc_random
    from megatron.core.transformer import torch_norm

    # CudaRNGStatesTracker.add() and fork() (TP-region dropout) use the CUDA RNG: keep it in the CPU generator
    _set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _set(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    _set(mc_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _set(mc_random, "_set_cuda_rng_state", lambda new_state, *a, **k: torch.set_rng_state(new_state))

    # DDP buffers, p2p recv buffers, TP layers and GPTModel allocate on device=torch.cuda.current_device()
    _set(torch.cuda, "current_device", lambda: "cpu")

    # P2PCommunicator synchronizes after batch_isend_irecv (batch_p2p_sync); gloo's wait() already does
    _set(torch.cuda, "synchronize", lambda *a, **k: None)

    # LanguageModule.setup_embeddings_and_output_layer: weight.data.cuda() of the tied output weight (PP > 1)
    _set(torch.Tensor, "cuda", lambda self, *a, **k: self)

    # the (distributed) optimizers accept only 'torch.cuda.*Tensor' params and clip_grad_by_total_norm_fp32
    # asserts 'torch.cuda.FloatTensor' grads: the CUDA name for calls from _CUDA_TYPE_CALLERS only
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

    # WrappedTorchNorm asserts no sequence_parallel: built with SP off, its params marked sequence_parallel so
    # finalize_model_grads all-reduces their grads over TP, as with TE
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

    # with PP = 2 the previous and next stage are one rank and gloo matches untagged p2p in posting order,
    # which the interleaved schedule differs in across ranks: a gradient could land in an activation buffer
    from megatron.core.pipeline_parallel import p2p_communication

    _set(p2p_communication, "_batched_p2p_ops", _tagged_p2p_ops(as_dict=False))
    _set(p2p_communication, "_p2p_ops", _tagged_p2p_ops(as_dict=True))

    proxy = make_cpu_torch()
    for module_name in _DEVICE_LITERAL_MODULES + _STREAM_MODULES:
        _set(importlib.import_module(module_name), "torch", proxy)
    return True


def remove() -> None:
    """Undoes :func:`apply` (no-op when not applied)."""
    restore(_ORIGINALS)
