"""Stand-in of TE v2.18 ``pytorch/distributed.py``: the collectives TE layers issue.

``gather_along_first_dim`` dispatches as TE's does (``:1640-1790``): a plain tensor is gathered
with one ``all_gather_into_tensor`` (``async_op`` passed through); an MXFP8, NVFP4 or FP8
block-scaling quantizer sends it to ``_all_gather_mxfp8`` / ``_all_gather_nvfp4`` /
``_start_all_gather_fp8_blockwise`` (``:1709-1749``), which quantize the input and gather its
data and scale-inverses as synchronous ``all_gather_into_tensor`` calls on ``process_group``
inside one ``torch.distributed._coalescing_manager(group=process_group, device=...,
async_ops=async_op)``, in TE's order, and return the manager as the handle (MXFP8), or a wrapper
whose ``wait()`` first waits it and then fixes the interleaved column-wise layout (``_AsyncHandle``
for block scaling, ``_NVFP4AllGatherAsyncHandle``). One deviation: TE passes the input's device
as ``device``; gloo does not implement ``startCoalescing`` (torch 2.13), so on CPU the stand-in
passes ``device=None``, which takes torch's same fast path (one ``all_gather_single_coalesced``
at the manager's exit) without NCCL's ``ncclGroupStart/End`` bracket.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .quantized import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensorStorage,
    MXFP8Quantizer,
    MXFP8TensorStorage,
    NVFP4Quantizer,
    NVFP4TensorStorage,
)


def _device(device):
    return None if device.type == "cpu" else device


@dataclass
class _AsyncHandle:
    """TE ``distributed.py:955-979``: waits the manager, then post-processes once."""

    async_handle: Any
    post_process_function: Callable | None = None
    post_process_function_args: tuple = ()
    _synchronized: bool = False

    def wait(self):
        if self._synchronized:
            return
        self.async_handle.wait()
        if self.post_process_function is not None:
            self.post_process_function(*self.post_process_function_args)
        self._synchronized = True


def _swap_first_dims(view_in, view_out):
    """TE ``tex.swap_first_dims``: ``out[j, i] = in[i, j]``."""
    view_out.copy_(view_in.transpose(0, 1))


def _finish_all_gather_fp8_blockwise(out, world_size, interleaved_rowwise_scale_inv, interleaved_columnwise_data):
    """TE ``distributed.py:1226-1248``."""
    if interleaved_rowwise_scale_inv is not None:
        dim0 = out._rowwise_scale_inv.size(0)
        _swap_first_dims(
            interleaved_rowwise_scale_inv.view(world_size, dim0, -1), out._rowwise_scale_inv.view(dim0, world_size, -1)
        )
    if interleaved_columnwise_data is not None:
        dim0 = out._columnwise_data.size(0)
        _swap_first_dims(
            interleaved_columnwise_data.view(world_size, dim0, -1), out._columnwise_data.view(dim0, world_size, -1)
        )
    return out


def _start_all_gather_fp8_blockwise(inp, process_group, *, async_op=False, quantizer=None, out_shape=None):
    """TE ``distributed.py:1076-1223`` (the 1x128 path; the high-precision fallback at ``:1127-1134``)."""
    world_size = torch.distributed.get_world_size(process_group)
    if not quantizer.is_quantizable(inp) or quantizer.block_scaling_dim != 1:
        out = torch.empty(out_shape, dtype=inp.dtype, device=inp.device)
        torch.distributed.all_gather_into_tensor(out, inp, group=process_group, async_op=False)
        return quantizer(out), None
    device = inp.device
    inp = quantizer(inp)
    out = quantizer.make_empty(out_shape, dtype=inp._dtype, device=device)
    interleaved_rowwise_scale_inv = interleaved_columnwise_data = None
    with torch.distributed._coalescing_manager(
        group=process_group, device=_device(device), async_ops=async_op
    ) as coalescing_manager:
        if quantizer.rowwise_usage:
            shape = list(inp._rowwise_scale_inv.size())
            shape[0] *= world_size
            interleaved_rowwise_scale_inv = torch.empty(shape, dtype=inp._rowwise_scale_inv.dtype, device=device)
            torch.distributed.all_gather_into_tensor(
                interleaved_rowwise_scale_inv, inp._rowwise_scale_inv, group=process_group
            )
            torch.distributed.all_gather_into_tensor(out._rowwise_data, inp._rowwise_data, group=process_group)
        if quantizer.columnwise_usage:
            shape = list(inp._columnwise_data.size())
            shape[0] *= world_size
            interleaved_columnwise_data = torch.empty(shape, dtype=inp._columnwise_data.dtype, device=device)
            torch.distributed.all_gather_into_tensor(
                out._columnwise_scale_inv, inp._columnwise_scale_inv, group=process_group
            )
            torch.distributed.all_gather_into_tensor(
                interleaved_columnwise_data, inp._columnwise_data, group=process_group
            )
    args = (out, world_size, interleaved_rowwise_scale_inv, interleaved_columnwise_data)
    if async_op:
        return out, _AsyncHandle(coalescing_manager, _finish_all_gather_fp8_blockwise, args)
    _finish_all_gather_fp8_blockwise(*args)
    return out, None


def _post_process_nvfp4_gather(
    out, columnwise_data_interleaved, columnwise_scale_inv_interleaved, world_size, handle=None
):
    """TE ``distributed.py:1279-1296``: the gathered transposed data and scales back in order."""
    k = out._columnwise_data.size(0)
    _swap_first_dims(columnwise_data_interleaved.view(world_size, k, -1), out._columnwise_data.view(k, world_size, -1))
    cols = columnwise_scale_inv_interleaved.size(1)
    out._columnwise_scale_inv[:k, : world_size * cols].copy_(
        columnwise_scale_inv_interleaved.view(world_size, k, cols).transpose(0, 1).reshape(k, -1)
    )


@dataclass
class _NVFP4AllGatherAsyncHandle:
    """TE ``distributed.py:1300-1321``."""

    output: Any
    columnwise_data_interleaved: Any
    columnwise_scale_inv_interleaved: Any
    world_size: int
    async_handle: Any
    _synchronized: bool = False

    def wait(self):
        if self._synchronized:
            return
        self.async_handle.wait()
        _post_process_nvfp4_gather(
            self.output, self.columnwise_data_interleaved, self.columnwise_scale_inv_interleaved, self.world_size
        )
        self._synchronized = True


def _quantize(inp, process_group, quantizer, out_shape):
    """What TE's MXFP8 and NVFP4 gathers do first: the input quantized, the output made empty."""
    device = inp.device
    q = quantizer(inp)
    return (
        torch.distributed.get_world_size(process_group),
        device,
        math.prod(inp.shape[:-1]),
        q,
        quantizer.make_empty(out_shape, dtype=q._dtype, device=device),
    )


def _all_gather_nvfp4(inp, process_group, *, async_op=False, quantizer, out_shape=None):
    """TE ``distributed.py:1324-1506``."""
    world_size, device, m, inp, out = _quantize(inp, process_group, quantizer, out_shape)
    with torch.distributed._coalescing_manager(
        group=process_group, device=_device(device), async_ops=async_op
    ) as gather_coalescing_manager:
        if quantizer.rowwise_usage:
            in_scale_inv, out_scale_inv = inp._rowwise_scale_inv, out._rowwise_scale_inv
            if in_scale_inv.size(0) != m:  # the scale-inverses' row padding is not gathered
                in_scale_inv, out_scale_inv = in_scale_inv[:m], out_scale_inv[: m * world_size]
            torch.distributed.all_gather_into_tensor(out_scale_inv, in_scale_inv, group=process_group)
            torch.distributed.all_gather_into_tensor(out._rowwise_data, inp._rowwise_data, group=process_group)
            out._amax_rowwise = inp._amax_rowwise
        if quantizer.columnwise_usage:
            k, half_m = inp._columnwise_data.shape
            in_scale_inv = inp._columnwise_scale_inv[:k, : half_m * 2 // 16].contiguous()
            out_scale_inv = torch.empty(
                [k * world_size, in_scale_inv.shape[1]], dtype=in_scale_inv.dtype, device=device
            )
            torch.distributed.all_gather_into_tensor(out_scale_inv, in_scale_inv, group=process_group)
            out_columnwise_data = torch.empty([k * world_size, half_m], dtype=inp._columnwise_data.dtype, device=device)
            torch.distributed.all_gather_into_tensor(out_columnwise_data, inp._columnwise_data, group=process_group)
            out._amax_columnwise = inp._amax_columnwise
    handle = gather_coalescing_manager if async_op else None
    if async_op and quantizer.columnwise_usage:
        handle = _NVFP4AllGatherAsyncHandle(out, out_columnwise_data, out_scale_inv, world_size, handle)
    elif quantizer.columnwise_usage:
        _post_process_nvfp4_gather(out, out_columnwise_data, out_scale_inv, world_size, handle)
    return out, handle


def _all_gather_mxfp8(inp, process_group, *, async_op=False, quantizer, out_shape=None):
    """TE ``distributed.py:1509-1637``."""
    world_size, device, m, inp, out = _quantize(inp, process_group, quantizer, out_shape)
    with torch.distributed._coalescing_manager(
        group=process_group, device=_device(device), async_ops=async_op
    ) as coalescing_manager:
        for usage, rows in (("rowwise", m), ("columnwise", m // 32)):
            if not getattr(quantizer, f"{usage}_usage"):
                continue
            in_scale_inv, out_scale_inv = getattr(inp, f"_{usage}_scale_inv"), getattr(out, f"_{usage}_scale_inv")
            if in_scale_inv.size(0) != rows:  # the scale-inverses' row padding is not gathered
                in_scale_inv, out_scale_inv = in_scale_inv[:rows], out_scale_inv[: rows * world_size]
            torch.distributed.all_gather_into_tensor(out_scale_inv, in_scale_inv, group=process_group)
            torch.distributed.all_gather_into_tensor(
                getattr(out, f"_{usage}_data"), getattr(inp, f"_{usage}_data"), group=process_group
            )
    return out, coalescing_manager if async_op else None


def gather_along_first_dim(inp, process_group, async_op=False, quantizer=None):
    """All-gather along dim 0 (TE ``distributed.py:1640-1790``): quantized gathers by the quantizer's
    type, else the plain-tensor path."""
    world_size = torch.distributed.get_world_size(process_group)
    if world_size == 1:
        return (quantizer(inp) if quantizer is not None else inp), None
    out_shape = list(inp.size())
    out_shape[0] *= world_size
    if isinstance(inp, Float8BlockwiseQTensorStorage) or isinstance(quantizer, Float8BlockQuantizer):
        return _start_all_gather_fp8_blockwise(
            inp, process_group, async_op=async_op, quantizer=quantizer, out_shape=out_shape
        )
    if isinstance(inp, MXFP8TensorStorage) or isinstance(quantizer, MXFP8Quantizer):
        return _all_gather_mxfp8(inp, process_group, async_op=async_op, quantizer=quantizer, out_shape=out_shape)
    if isinstance(inp, NVFP4TensorStorage) or isinstance(quantizer, NVFP4Quantizer):
        return _all_gather_nvfp4(inp, process_group, async_op=async_op, quantizer=quantizer, out_shape=out_shape)
    out = torch.empty(out_shape, dtype=inp.dtype, device=inp.device)
    handle = torch.distributed.all_gather_into_tensor(out, inp.contiguous(), group=process_group, async_op=async_op)
    return out, handle


def reduce_scatter_along_first_dim(inp, tp_group, async_op=False):
    """Reduce-scatter along dim 0 (TE ``distributed.py:928-951``)."""
    world_size = torch.distributed.get_world_size(tp_group)
    if world_size == 1:
        return inp, None
    out = torch.empty((inp.shape[0] // world_size,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    handle = torch.distributed.reduce_scatter_tensor(out, inp.contiguous(), group=tp_group, async_op=async_op)
    return out, handle


def allreduce(inp, tp_group=None, async_op=False):
    """All-reduce (TE ``distributed.py:2013-2027``)."""
    if torch.distributed.get_world_size(tp_group) == 1:
        return inp, None
    handle = torch.distributed.all_reduce(inp, group=tp_group, async_op=async_op)
    return inp, handle
