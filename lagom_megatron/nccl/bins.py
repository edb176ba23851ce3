"""Which byte counts NCCL's tuner plugin is asked about for one call, and which reductions and
dtypes NCCL runs NVLS for: the facts of a collective call that shape what a plan can change.

**Bins.** A call that issues several collectives in one NCCL group (a DDP bucket group's buckets
under ``torch.distributed._coalescing_manager``) does not reach the tuner as one collective.
NCCL's ``ncclPrepareTasks`` (NVIDIA/nccl v2.30.7 ``src/enqueue.cc:392-441``) bins the group's
tasks by (function, reduction, dtype) (an all-gather's or broadcast's dtype is always ``ncclInt8``:
NCCL enqueues them as bytes, ``BYTE_OPS``), walks each bin in the task sorter's order, and aggregates a
task with the ones after it while they stay below 4x its traffic; it then asks ``getCollInfo``
once per aggregate, with the aggregate's bytes (``ncclGetAlgoInfo``, ``:2126``: element size x
``ncclFuncMaxSendRecvCount``: the all-gather output, the reduce-scatter input, the all-reduce
buffer, as ``CollectiveSite.nbytes`` counts them). ``nccl_bins`` computes those byte counts from a
site's parts, so the plan table gets one row per aggregate (megatron-core's ``--fp8-param-gather``
merges bf16 buckets into an FP8 bucket group, core_v0.16.1 ``param_and_grad_buffer.py:997-1027``:
one bucket group then gathers uint8 and bf16 tensors, one bin of bytes to NCCL). The sorter's
order is not an exact sort (``ncclTaskCollSorterInsert``, ``src/include/comm.h:361-409``): it files a task by its traffic
(bytes x ``ncclFuncTrafficPerByte``: 2 for an all-reduce, nRanks for the all-gather's send and
the reduce-scatter's receive count, so the site's bytes, ``enqueue.cc:91-102``) in 4 bins per power
of two from 1 KiB to 1 GiB (``u32fpEncode`` with 2 mantissa bits, ``src/include/bitops.h:470-479``),
newest first inside a bin, and ``ncclPrepareTasks`` reverses the list per bin (``:405-416``): small
to large by sorter bin, in issue order inside one. The same in NCCL 2.27-2.29.

**NVLS support.** NCCL offers NVLS for a reduction only for the (reduction, dtype) pairs
``ncclNvlsSupported`` lists (``src/include/device.h:587-601``): sum, min and max of 32- and
64-bit integers, fp16 and bf16; sum of fp32 and fp64. torch's ``ReduceOp.AVG`` becomes
``ncclAvg`` (a pre-multiplied or post-divided sum on the device: neither ``ncclDevSum`` nor
``ncclDevMinMax``), and FP8 or 8-bit integers are not listed, so NCCL disables NVLS for them; an
all-gather runs NVLS whatever its dtype (``enqueue.cc:425-426``). A communicator made with
``NCCL_ALGO=<function>:NVLS`` then fails such a call with ``ncclInvalidUsage`` (``enqueue.cc:2052-2066``).
PAT reduce-scatter is skipped for the averaging reductions (``enqueue.cc:2010-2012``).
"""

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
"""Site ops NCCL enqueues as bytes (``datatype = ncclInt8``, ``count *= elementSize``, v2.30.7
``src/enqueue.cc:2733-2737``, v2.27.7 ``:2360-2362``): their tensors share one bin whatever their dtypes."""
REDUCING_OPS = frozenset({"all_reduce", "reduce_scatter"})
"""Site ops that reduce (their reduction and dtype decide NVLS)."""


def sorter_bin(traffic: int) -> int:
    """The ``u32fpEncode`` code NCCL's task sorter files ``traffic`` bytes under (larger = bigger
    tasks; ``ncclTaskCollSorterInsert``, module docstring)."""
    x = min(1 << SORTER_MAX_LOG2, max(0, int(traffic))) >> SORTER_UNIT_LOG2
    log2x = (x | 1).bit_length() - 1
    bits = SORTER_BITS_PER_POW2
    mantissa = (x >> (log2x - bits if log2x >= bits else 0)) & ((1 << bits) - 1)
    exponent = log2x - (bits - 1) if log2x >= bits else 0
    return exponent << bits | mantissa


def nccl_bins(parts: Iterable[tuple[str, int]], *, nbytes: int, op: str | None = None) -> list[int]:
    """The ``nBytes`` of each ``getCollInfo`` NCCL makes for one call of ``op`` issuing ``parts``
    ((dtype, bytes) per collective of the group in issue order, one function and reduction): bins in
    order of first dtype, each walked in the sorter's order and aggregated (module docstring). No
    parts: the call's ``nbytes``, once."""
    per_byte = 2 if op == "all_reduce" else 1  # ncclFuncTrafficPerByte over the site's bytes
    as_bytes = op in BYTE_OPS  # enqueued as ncclInt8: one bin whatever the dtypes (module docstring)
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
    """Whether NCCL runs NVLS for a reduction ``reduce_op`` (torch's name, lower case) of ``dtype``
    (``ncclNvlsSupported``); an unknown reduction or dtype counts as unsupported."""
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
