"""The byte counts NCCL's tuner is asked about for one call, and the (reduction, dtype) pairs NCCL runs NVLS for.

NCCL v2.30.7 (as 2.27-2.29) ``ncclPrepareTasks`` (``src/enqueue.cc:392-441``) bins a group's tasks by (function,
reduction, dtype), orders each bin small to large (``ncclTaskCollSorterInsert``, ``src/include/comm.h:361-409``;
``src/include/bitops.h:470-479``; :91-102, :405-416), aggregates tasks below 4x the first and asks ``getCollInfo``
once per aggregate (:2126); FP8 bucket groups mix uint8 and bf16 (core_v0.16.1
``param_and_grad_buffer.py:997-1027``). NVLS only for the pairs ``ncclNvlsSupported`` lists
(``src/include/device.h:587-601``) and all-gather (:425-426); ``NCCL_ALGO=<function>:NVLS`` fails the others
(:2052-2066). PAT reduce-scatter skips averaging (:2010-2012)."""

from __future__ import annotations

from collections.abc import Iterable

AGGREGATE_RATIO = 4
"""NCCL aggregates a bin's tasks while they stay below this multiple of the first (``enqueue.cc:430``)."""
SORTER_UNIT_LOG2, SORTER_MAX_LOG2, SORTER_BITS_PER_POW2 = 10, 30, 2
"""``ncclTaskCollSorter``'s ``UnitLog2`` (1 KiB), ``MaxLog2`` (1 GiB) and ``BitsPerPow2`` (``comm.h:362-368``)."""

NVLS_SUM_MINMAX_DTYPES = frozenset({"int32", "uint32", "int64", "uint64", "float16", "bfloat16"})
"""dtypes (torch's names) NCCL reduces with NVLS for sum, min and max."""
NVLS_SUM_DTYPES = frozenset({"float32", "float64"})
"""dtypes (torch's names) NCCL reduces with NVLS for sum only."""
AVERAGING_OPS = frozenset({"avg", "premul_sum"})
"""torch reductions NCCL runs as a scaled sum (``ncclDevPreMulSum`` / ``ncclDevSumPostDiv``)."""
BYTE_OPS = frozenset({"all_gather", "broadcast"})
"""Ops NCCL enqueues as ``ncclInt8`` bytes, so one bin whatever the dtypes (v2.30.7 ``src/enqueue.cc:2733-2737``,
v2.27.7 :2360-2362)."""
REDUCING_OPS = frozenset({"all_reduce", "reduce_scatter"})


def sorter_bin(traffic: int) -> int:
    """``u32fpEncode`` code NCCL's task sorter files ``traffic`` bytes under (larger = bigger tasks)."""
    x = min(1 << SORTER_MAX_LOG2, max(0, int(traffic))) >> SORTER_UNIT_LOG2
    log2x = (x | 1).bit_length() - 1
    bits = SORTER_BITS_PER_POW2
    mantissa = (x >> (log2x - bits if log2x >= bits else 0)) & ((1 << bits) - 1)
    exponent = log2x - (bits - 1) if log2x >= bits else 0
    return exponent << bits | mantissa


def nccl_bins(parts: Iterable[tuple[str, int]], *, nbytes: int, op: str | None = None) -> list[int]:
    """``nBytes`` per ``getCollInfo`` for a call of ``op`` issuing ``parts`` ((dtype, bytes)), else ``[nbytes]``."""
    per_byte = 2 if op == "all_reduce" else 1  # ncclFuncTrafficPerByte over the site's bytes
    as_bytes = op in BYTE_OPS  # enqueued as ncclInt8: one bin whatever the dtypes
    by_dtype: dict[str, list[tuple[int, int]]] = {}
    for i, (dtype, b) in enumerate(parts):
        by_dtype.setdefault("int8" if as_bytes else str(dtype), []).append((i, int(b)))
    if not by_dtype:
        return [int(nbytes)]
    out: list[int] = []
    for tasks in by_dtype.values():
        sizes = [b for _, b in sorted(tasks, key=lambda t: (sorter_bin(per_byte * t[1]), t[0]))]
        first = agg = sizes[0]
        for b in sizes[1:]:
            if b < AGGREGATE_RATIO * first:
                agg += b
            else:
                out.append(agg)
                first = agg = b
        out.append(agg)
    return out


def nvls_supported(reduce_op: str | None, dtype: str | None) -> bool:
    """Whether ``ncclNvlsSupported`` lists (``reduce_op``, ``dtype``) (torch names); unknown counts as unsupported."""
    op = (reduce_op or "").lower()
    dt = (dtype or "").lower()
    if dt in NVLS_SUM_MINMAX_DTYPES:
        return op in ("sum", "max", "min")
    if dt in NVLS_SUM_DTYPES:
        return op == "sum"
    return False


def site_dtypes(dtype: str, parts: Iterable[tuple[str, int]]) -> list[str]:
    """The dtypes one call of a site reduces: its parts' when it has parts, else its own."""
    names = [str(d) for d, _ in parts]
    return names or [dtype]
