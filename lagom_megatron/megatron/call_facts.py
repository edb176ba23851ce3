"""What a collective call says about what NCCL may run for it: reduction, coalesced tensors' dtypes and
sizes, buffer registration. Sources: torch 2.13 ``all_reduce(tensor, op, group, async_op)``,
``reduce_scatter_tensor(output, input, op, ...)``; megatron-core core_v0.16.1
``distributed/param_and_grad_buffer.py:395-397`` (AVG with ``average_in_collective``), ``:753-770``
(``nccl_ub`` pool); core_v0.18.2 ``:1066-1074`` (``nccl_mem_pool``).
"""

from __future__ import annotations

from typing import Any

OP_ARG = {"all_reduce": ("op", 1), "reduce_scatter": ("op", 2)}
"""(keyword, position) of the reduction in the torch functions the router wraps, per op."""


def reduce_op_name(op: Any) -> str:
    """torch's reduction as a lower-case name: ``ReduceOp.AVG`` -> ``avg``; None -> ``sum``."""
    if op is None:
        return "sum"
    op = getattr(op, "op", op)
    name = getattr(op, "name", None)
    return str(name if name is not None else op).rsplit(".", 1)[-1].lower()


def call_reduce_op(op: str, args: tuple, kwargs: dict) -> str | None:
    """The reduction of one wrapped call of ``op`` (None for an op that does not reduce)."""
    where = OP_ARG.get(op)
    if where is None:
        return None
    name, index = where
    value = kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)
    return reduce_op_name(value)


def bucket_reduce_op(bucket_group: Any, kind: str) -> str | None:
    """The reduction ``start_grad_sync`` uses for a bucket group; None for the parameter gather."""
    if kind != "grad":
        return None
    return "avg" if getattr(bucket_group.ddp_config, "average_in_collective", False) else "sum"


def bucket_parts(tensors: list[Any]) -> tuple[tuple[str, int], ...]:
    """(dtype, bytes) of each bucket tensor of one bucket-group call (empty for one tensor)."""
    from lagom_megatron.megatron.sites import dtype_name, tensor_nbytes

    if len(tensors) < 2:
        return ()
    return tuple((dtype_name(t), tensor_nbytes(t)) for t in tensors)


def bucket_registration(bucket_group: Any, pools: list | None) -> str:
    """``CollectiveSite.registered`` of a bucket group: ``""`` (no ``nccl_ub``), ``pool``, ``symmetric``,
    or ``fixed`` (pools unknown: megatron-core before 0.18 keeps no handle)."""
    if not getattr(bucket_group.ddp_config, "nccl_ub", False):
        return ""
    if not pools:
        return "fixed"
    return "symmetric" if any(symmetric for _, symmetric in pools) else "pool"


def registered_pools(model_chunks: Any, name_of: Any) -> dict[str, list[tuple[Any, bool]]]:
    """Group name -> [(NCCL memory pool, symmetric)] of the ``nccl_ub`` DDP buffers of ``model_chunks``;
    symmetric needs torch 2.9+ (core_v0.16.1 ``nccl_allocator.py:111-122, 244-263``)."""
    symm = _torch_at_least(2, 9)
    out: dict[str, list[tuple[Any, bool]]] = {}
    lost: set[str] = set()
    for chunk in model_chunks or ():
        for attr in ("buffers", "expert_parallel_buffers"):
            for buf in getattr(chunk, attr, None) or ():
                if not getattr(buf, "nccl_ub", False):
                    continue
                name = name_of(getattr(buf, "data_parallel_group", None))
                pool = getattr(buf, "nccl_mem_pool", None)
                if pool is None or name is None:
                    lost.add(str(name))
                    continue
                symmetric = symm and not getattr(buf.ddp_config, "disable_symmetric_registration", False)
                out.setdefault(name, []).append((pool, symmetric))
    return {k: v for k, v in out.items() if k not in lost}


def _torch_at_least(*version: int) -> bool:
    from lagom_megatron.megatron.versions import installed_torch, release

    found = installed_torch()
    try:
        return found is not None and release(found.version) >= version
    except ValueError:  # "unknown": no version in its source
        return False
