"""Applied = observed, on NCCL: does what NCCL reported it ran for a site's calls match the plan?

The profiler half of lagom's plugin records per communicator the shape of every call and NCCL's
choice for it (``profiler_status.ObservedComm``). A site's calls are found in the records of the
communicator it runs on (a pool entry's tag, or the commName NCCL was given) by NCCL's function
and the call's bytes, counted the way the plan counts them (``op_bytes``). Then each knob the
plan sets is compared with the event field that shows it (docs/nccl.md, "observed by"):

- ``algorithm`` / ``protocol``: the coll event's ``algo`` / ``proto`` (``ncclAlgoToString``,
  ``ncclProtoToString``, NVIDIA/nccl v2.30.7 ``src/collectives.cc:95-127``, filled from the task at
  launch, ``src/plugin/profiler.cc:498-499``);
- ``n_channels`` of a collective: the coll event's ``nChannels``, the channels the task really runs
  on after NCCL split it (``task->nChannels``, ``src/enqueue.cc:701-704``; ABI v1-v3 report the
  most it may use, ``nMaxChannels``, which is the tuner's value as it gave it, :2178). NCCL takes
  the tuner's count exactly (:2178) but then splits the call into 32 KiB traffic cells (16 KiB
  before 2.29) and runs it on no more channels than it has cells, so a small call runs on fewer
  channels than planned (``nccl_coll_channels``). The site is applied when the count is the plan's
  or the count NCCL's split gives for it ("split" note), else it differs ("clamped" when fewer).
  CollNet and multi-node NVLS tasks carry no channel count (NCCL never sets it on that path,
  :624-654) and are not compared;
- ``n_channels`` of a point-to-point site (the entry's CTA bound, ``engine.p2p``): every p2p event's
  ``nChannels`` (ABI v4+) is at most the P2P channels that bound gives (``p2p_channels``);
- ``n_threads``: the coll event's ``nWarps`` x 32;
- ``chunk_size``: the proxyOp event's ``chunkSize``, which is the collective's chunk times its
  slice steps from NCCL 2.24 (the chunk alone in 2.23, ABI v1) (``src/plugin/profiler.cc:580``; slice steps 2 = ``NCCL_STEPS / 4`` for ring /
  simple all-reduce, all-gather and reduce-scatter, else 1: ``src/enqueue.cc:2223-2224``,
  ``src/include/collectives.h:19-28``); only network transfers have proxy ops, so elsewhere the chunk
  is not observable and not compared.

A site whose calls left no record is ``unobserved`` (never a mismatch): the profiler half is not
loaded, another profiler plugin is, or the calls did not run while recording was on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from lagom_megatron.engine.knobs import P2P_OPS, CommConfig
from lagom_megatron.engine.p2p import p2p_channels
from lagom_megatron.nccl.profiler_status import ObservedComm, ObservedOp

FUNC_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
            "Broadcast": "broadcast", "Reduce": "reduce", "Send": "send", "Recv": "recv", "AlltoAll": "all_to_all"}
"""NCCL's function names (``ncclFuncToString``, ``src/collectives.cc:14-45``) -> lagom's op names."""
ALGORITHMS = {"TREE": "Tree", "RING": "Ring", "COLLNET_DIRECT": "CollNetDirect", "COLLNET_CHAIN": "CollNetChain",
              "NVLS": "NVLS", "NVLS_TREE": "NVLSTree", "PAT": "PAT"}
"""``ncclAlgoToString`` names -> ``engine.knobs.ALGORITHMS``."""
PROTOCOLS = {"LL": "LL", "LL128": "LL128", "SIMPLE": "Simple"}
DTYPE_BYTES = {"ncclInt8": 1, "ncclUint8": 1, "ncclFloat8e4m3": 1, "ncclFloat8e5m2": 1, "ncclFloat16": 2,
               "ncclBfloat16": 2, "ncclInt32": 4, "ncclUint32": 4, "ncclFloat32": 4, "ncclInt64": 8,
               "ncclUint64": 8, "ncclFloat64": 8}
"""Element bytes per NCCL datatype name (``ncclTypeSize``, ``src/include/collectives.h:44-66``)."""
PER_RANK_COUNT = ("AllGather", "ReduceScatter")
"""Functions whose ``count`` is one rank's share: the plan counts the whole buffer (the all-gather's
output, the reduce-scatter's input), ``nRanks`` x that (``ncclFuncMaxSendRecvCount``)."""


def op_bytes(op: ObservedOp, n_ranks: int) -> int | None:
    """The call's bytes as a plan entry counts them (``nbytes``), or None for an unknown datatype."""
    size = DTYPE_BYTES.get(op.dtype)
    if size is None:
        return None
    return op.count * size * (n_ranks if op.func in PER_RANK_COUNT else 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def nccl_coll_channels(op: ObservedOp, n_channels: int, n_ranks: int) -> int | None:
    """The channels NCCL runs one collective on when its tuner gave it ``n_channels`` and the call
    is alone in its launch, or None where the record cannot tell (unknown datatype, ABI below v4,
    CollNet / multi-node NVLS). Follows ``scheduleCollTasksToPlan`` (NVIDIA/nccl v2.30.7
    ``src/enqueue.cc:576-704``; v2.27.3 :536-648 and v2.28.9 :529-638 for ABI v4 and v5):

    - the task's traffic is its bytes x ``ncclFuncTrafficPerByte`` (2 for all-reduce, ``nRanks``
      for all-gather and reduce-scatter, 1 else, :91-102, :2790), x 4 for LL (:461, :658), at
      least ``MinTrafficPerChannel`` (32 KiB from 2.29 = ABI v6, 16 KiB in 2.27-2.28, :585, :597);
    - each channel gets that traffic / ``min(n_channels, comm channels)`` (:598-599, :618; 2.27-2.28
      at least the minimum), in cells of the minimum traffic (:659-664);
    - the call fills a first channel, then whole channels, then a last one (:665-701).

    The communicator is assumed to have at least ``n_channels`` channels (lagom's pool entries set
    ``min_ctas = max_ctas`` to the plan's largest count, docs/nccl.md); a call grouped with others
    in one launch shares their channel budget and may differ.

    Args:
        op: the record (``count``, ``dtype``, ``proto``, ``func``, ``abi``, ``n_nodes``).
        n_channels: the tuner's channel count (>= 1).
        n_ranks: the communicator's size.
    Raises:
        ValueError: ``n_channels`` or ``n_ranks`` below 1.
    """
    if n_channels < 1 or n_ranks < 1:
        raise ValueError(f"n_channels ({n_channels}) and n_ranks ({n_ranks}) must be >= 1")
    size = DTYPE_BYTES.get(op.dtype)
    if size is None or op.abi < 4 or op.algo in ("COLLNET_DIRECT", "COLLNET_CHAIN") or (
            op.algo == "NVLS" and op.n_nodes > 1):
        return None
    nbytes = op.count * size
    if nbytes <= 0:
        return 0
    per_byte = {"AllReduce": 2, "AllGather": n_ranks, "ReduceScatter": n_ranks}.get(op.func, 1)
    per_byte *= 4 if op.proto == "LL" else 1
    min_traffic = (32 if op.abi >= 6 else 16) << 10
    total = max(min_traffic, nbytes * per_byte)
    if op.abi >= 6:
        per_channel = _div_up(total // n_channels, 16) * 16
    else:
        per_channel = max(min_traffic, total // n_channels)
    cell = _div_up(_div_up(min_traffic, per_byte), 16) * 16
    cells = _div_up(nbytes, cell)
    per_cell = cell * per_byte
    cells_per_channel = min(cells, _div_up(per_channel, per_cell))
    lo = cells if n_channels == 1 else min(cells, _div_up(per_channel, per_cell))
    mid, hi = divmod(cells - lo, cells_per_channel)
    if hi == 0 and mid != 0:
        hi, mid = cells_per_channel, mid - 1
    return 1 + mid + (1 if hi else 0)


def slice_steps(op: ObservedOp) -> int:
    """Steps per slice of the call (the proxy's chunk is chunk x this): 2 for ring / simple
    all-reduce, all-gather and reduce-scatter, 1 otherwise (see the module docstring). 1 under
    profiler ABI v1, which only NCCL 2.23 loads from lagom's library: it reports the chunk itself
    (v2.23.4 ``src/misc/profiler.cc:361``; x sliceSteps from 2.24, v2.24.3 :475)."""
    if op.abi == 1:
        return 1
    ring_simple = op.algo == "RING" and op.proto == "SIMPLE"
    return 2 if ring_simple and op.func in ("AllReduce", "AllGather", "ReduceScatter") else 1


@dataclass(frozen=True)
class SiteObservation:
    """The verdict on one site of the plan: ``status`` ``applied`` (every knob the plan sets was
    seen as planned), ``differs`` (``knobs`` names those that were not) or ``unobserved``.

    ``planned`` and ``observed`` map each compared knob to its value (``observed``: the values seen,
    a tuple when the calls differ among themselves); ``calls``: calls matched; ``note``: why a site
    is unobserved or what "differs" means for a knob (``clamped``)."""

    site_id: str
    status: str
    planned: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    knobs: tuple[str, ...] = ()
    calls: int = 0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the consensus all-gather and the report)."""
        return {"site_id": self.site_id, "status": self.status, "planned": dict(self.planned),
                "observed": {k: list(v) if isinstance(v, tuple) else v for k, v in self.observed.items()},
                "knobs": list(self.knobs), "calls": self.calls, "note": self.note}


def _one(values: Iterable[Any]) -> Any:
    vals = tuple(sorted(set(values), key=repr))
    return vals[0] if len(vals) == 1 else vals


def matching_ops(comms: Iterable[ObservedComm], key: str, op: str, nbytes: int, group_size: int) -> list[ObservedOp]:
    """The records of the communicator(s) known as ``key`` (tag or commName) whose function is
    ``op`` and whose bytes are ``nbytes``; ``group_size`` turns per-rank counts into the plan's."""
    out = []
    for comm in comms:
        if key not in comm.keys():
            continue
        n_ranks = comm.n_ranks if comm.n_ranks > 0 else group_size
        out += [o for o in comm.ops if FUNC_OPS.get(o.func) == op and op_bytes(o, n_ranks) == nbytes]
    return out


def observe_site(site_id: str, planned: CommConfig, *, op: str, nbytes: int, group_size: int,
                 ops: list[ObservedOp]) -> SiteObservation:
    """Compares ``planned`` with the records ``ops`` of the site's calls (``matching_ops``).

    Args:
        planned: the plan's config for the site (what the entry and the tuner table apply).
        op, nbytes, group_size: the plan entry's op, bytes and group size.
        ops: the matching records; empty = the site is unobserved.
    """
    if not ops:
        return SiteObservation(site_id, "unobserved", note="no record of its calls (function and bytes) on its "
                                                          "communicator while NCCL's events were on")
    p2p = op in P2P_OPS
    want: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    bad: list[str] = []
    notes: list[str] = []
    if planned.algorithm is not None and not p2p:
        want["algorithm"], seen["algorithm"] = planned.algorithm, _one(ALGORITHMS.get(o.algo or "", o.algo) for o in ops)
        bad += ["algorithm"] if seen["algorithm"] != planned.algorithm else []
    if planned.protocol is not None and not p2p:
        want["protocol"], seen["protocol"] = planned.protocol, _one(PROTOCOLS.get(o.proto or "", o.proto) for o in ops)
        bad += ["protocol"] if seen["protocol"] != planned.protocol else []
    if planned.n_channels is not None:
        channels = [o.channels for o in ops]
        want["n_channels"], seen["n_channels"] = planned.n_channels, _one(channels)
        if p2p:
            bound = int(p2p_channels(planned.n_channels))
            if all(c == 0 for c in channels):  # p2p events carry no channel count before ABI v4
                del want["n_channels"], seen["n_channels"]
            elif max(channels) > bound:
                bad.append("n_channels")
                notes.append(f"P2P ran on up to {max(channels)} channels, more than the {bound} its bound allows")
        else:
            split = {o: nccl_coll_channels(o, planned.n_channels, o.n_ranks if o.n_ranks > 0 else group_size)
                     for o in ops}
            if all(s is None and o.abi >= 4 for o, s in split.items()):  # CollNet / multi-node NVLS
                del want["n_channels"], seen["n_channels"]
            elif any(o.channels not in (planned.n_channels, split[o]) for o in ops):
                bad.append("n_channels")
                rule = _one(s for s in split.values() if s is not None)
                nccl = f" (NCCL's split of the call gives {rule})" if rule != () else ""
                if max(channels) < planned.n_channels:
                    notes.append(f"clamped: NCCL ran {seen['n_channels']} of the {planned.n_channels} planned "
                                 f"channels{nccl}")
            elif any(o.channels != planned.n_channels for o in ops):
                notes.append(f"split: NCCL ran the {planned.n_channels} planned channels' call on "
                             f"{seen['n_channels']}, as its traffic cells give for these bytes")
    if planned.n_threads is not None and not p2p:
        want["n_threads"], seen["n_threads"] = planned.n_threads, _one(32 * o.warps for o in ops)
        bad += ["n_threads"] if seen["n_threads"] != planned.n_threads else []
    chunks = [o.chunk // slice_steps(o) for o in ops if o.chunk > 0]
    if planned.chunk_size is not None and chunks:
        want["chunk_size"], seen["chunk_size"] = planned.chunk_size, _one(chunks)
        bad += ["chunk_size"] if any(c != planned.chunk_size for c in chunks) else []
    calls = sum(o.calls for o in ops)
    status = "differs" if bad else "applied"
    return SiteObservation(site_id, status, want, seen, tuple(bad), calls, "; ".join(notes))


def site_kernel_us(comms: Iterable[ObservedComm], key: str, op: str, nbytes: int, group_size: int,
                   calls: int) -> float | None:
    """The site's NCCL kernel time in the records, microseconds summed over its ``calls`` calls,
    when the records tell it apart: every call of that shape on the communicator is the site's
    (its bucket's calls equal ``calls``) and each reported its channels' timers. None otherwise
    (another site shares the shape, or no timer: profiler ABI below v4)."""
    ops = matching_ops(comms, key, op, nbytes, group_size)
    if not ops or calls <= 0 or sum(o.calls for o in ops) != calls or sum(o.kernel_calls for o in ops) != calls:
        return None
    return sum(o.kernel_ns for o in ops) / 1e3
