"""Stand-in of TE v2.18 ``pytorch/distributed.py``: the three collectives TE layers issue."""

import torch


def gather_along_first_dim(inp, process_group, async_op=False, quantizer=None):
    """All-gather along dim 0 (TE ``distributed.py:1640-1789``, the plain-tensor path)."""
    world_size = torch.distributed.get_world_size(process_group)
    if world_size == 1:
        return inp, None
    out = torch.empty((inp.shape[0] * world_size,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    handle = torch.distributed.all_gather_into_tensor(out, inp.contiguous(), group=process_group, async_op=async_op)
    return out, handle


def reduce_scatter_along_first_dim(inp, tp_group, async_op=False):
    """Reduce-scatter along dim 0 (TE ``distributed.py:928-953``)."""
    world_size = torch.distributed.get_world_size(tp_group)
    if world_size == 1:
        return inp, None
    out = torch.empty((inp.shape[0] // world_size,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    handle = torch.distributed.reduce_scatter_tensor(out, inp.contiguous(), group=tp_group, async_op=async_op)
    return out, handle


def allreduce(inp, tp_group=None, async_op=False):
    """All-reduce (TE ``distributed.py:2013-2028``)."""
    if torch.distributed.get_world_size(tp_group) == 1:
        return inp, None
    handle = torch.distributed.all_reduce(inp, group=tp_group, async_op=async_op)
    return inp, handle
