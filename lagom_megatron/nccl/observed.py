"""Applied = observed, on NCCL: does what NCCL reported it ran for a site's calls match the plan? Records are matched
by function and bytes; fields (docs/nccl.md; NVIDIA/nccl v2.30.7): ``algo``/``proto`` (``src/collectives.cc:95-127``,
``src/plugin/profiler.cc:498-499``), ``nChannels`` (``src/enqueue.cc:701-704``; ABI v1-v3 the maximum, :2178; none for
CollNet / multi-node NVLS, :624-654), ``nWarps``, the proxy ``chunkSize`` (``src/plugin/profiler.cc:580``; network)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lagom_megatron.engine.knobs import P2P_OPS, CommConfig
from lagom_megatron.engine.p2p import p2p_channels
from lagom_megatron.nccl.plugin_status import ObservedComm, ObservedOp

FUNC_OPS = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "Send": "send",
    "Recv": "recv",
    "AlltoAll": "all_to_all",
}
"""NCCL's function names (``ncclFuncToString``, ``src/collectives.cc:14-45``) -> lagom's op names."""
ALGORITHMS = {
    "TREE": "Tree",
    "RING": "Ring",
    "COLLNET_DIRECT": "CollNetDirect",
    "COLLNET_CHAIN": "CollNetChain",
    "NVLS": "NVLS",
    "NVLS_TREE": "NVLSTree",
    "PAT": "PAT",
}
"""``ncclAlgoToString`` names -> ``engine.knobs.ALGORITHMS``."""
PROTOCOLS = {"LL": "LL", "LL128": "LL128", "SIMPLE": "Simple"}
DTYPE_BYTES = {
    "ncclInt8": 1,
    "ncclUint8": 1,
    "ncclFloat8e4m3": 1,
    "ncclFloat8e5m2": 1,
    "ncclFloat16": 2,
    "ncclBfloat16": 2,
    "ncclInt32": 4,
    "ncclUint32": 4,
    "ncclFloat32": 4,
    "ncclInt64": 8,
    "ncclUint64": 8,
    "ncclFloat64": 8,
}
"""Element bytes per NCCL datatype name (``ncclTypeSize``, ``src/include/collectives.h:44-66``)."""
PER_RANK_COUNT = ("AllGather", "ReduceScatter")
"""Functions whose ``count`` is one rank's share; the plan counts ``nRanks`` x that (``ncclFuncMaxSendRecvCount``)."""


def op_bytes(op: ObservedOp, n_ranks: int) -> int | None:
    """The call's bytes as a plan entry counts them (``nbytes``), or None for an unknown datatype."""
    size = DTYPE_BYTES.get(op.dtype)
    if size is None:
        return None
    return op.count * size * (n_ranks if op.func in PER_RANK_COUNT else 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def nccl_coll_channels(op: ObservedOp, n_channels: int, n_ranks: int) -> int | None:
    """Channels NCCL runs one collective on, alone in its launch, given ``n_channels``; None where the record cannot
    tell. ``scheduleCollTasksToPlan`` (v2.30.7 ``src/enqueue.cc:576-704``; v2.27.3 :536-648, v2.28.9 :529-638): traffic
    per byte :91-102, :2790; LL x4 :461, :658; minimum per channel (32 KiB from ABI v6, else 16) :585, :597; split
    :598-599, :618; cells :659-664, :665-701. ValueError: ``n_channels`` or ``n_ranks`` < 1."""
    if n_channels < 1 or n_ranks < 1:
        raise ValueError(f"n_channels ({n_channels}) and n_ranks ({n_ranks}) must be >= 1")
    size = DTYPE_BYTES.get(op.dtype)
    if (
        size is None
        or op.abi < 4
        or op.algo in ("COLLNET_DIRECT", "COLLNET_CHAIN")
        or (op.algo == "NVLS" and op.n_nodes > 1)
    ):
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
    """Steps per slice (proxy chunk = chunk x this; ``src/enqueue.cc:2223-2224``, ``src/include/collectives.h:19-28``);
    1 under ABI v1 (v2.23.4 ``src/misc/profiler.cc:361``; x slice steps from v2.24.3 :475)."""
    if op.abi == 1:
        return 1
    ring_simple = op.algo == "RING" and op.proto == "SIMPLE"
    return 2 if ring_simple and op.func in ("AllReduce", "AllGather", "ReduceScatter") else 1


@dataclass(frozen=True)
class SiteObservation:
    """One site's verdict: ``applied``, ``differs`` (``knobs`` says which; ``note``: ``clamped``) or ``unobserved``."""

    site_id: str
    status: str
    planned: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    knobs: tuple[str, ...] = ()
    calls: int = 0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the consensus all-gather and the report)."""
        return {
            "site_id": self.site_id,
            "status": self.status,
            "planned": dict(self.planned),
            "observed": {k: list(v) if isinstance(v, tuple) else v for k, v in self.observed.items()},
            "knobs": list(self.knobs),
            "calls": self.calls,
            "note": self.note,
        }


def _one(values: Iterable[Any]) -> Any:
    vals = tuple(sorted(set(values), key=repr))
    return vals[0] if len(vals) == 1 else vals


def matching_ops(comms: Iterable[ObservedComm], key: str, op: str, nbytes: int, group_size: int) -> list[ObservedOp]:
    """Records of the communicator(s) known as ``key`` whose function is ``op`` and bytes the plan's ``nbytes``."""
    out = []
    for comm in comms:
        if key not in comm.keys():
            continue
        n_ranks = comm.n_ranks if comm.n_ranks > 0 else group_size
        out += [o for o in comm.ops if FUNC_OPS.get(o.func) == op and op_bytes(o, n_ranks) == nbytes]
    return out


def observe_site(
    site_id: str, planned: CommConfig, *, op: str, nbytes: int, group_size: int, ops: list[ObservedOp]
) -> SiteObservation:
    """Compares ``planned`` (the plan's config for the site) with its calls' records ``ops`` (empty: unobserved)."""
    if not ops:
        return SiteObservation(
            site_id,
            "unobserved",
            note="no record of its calls (function and bytes) on its communicator while NCCL's events were on",
        )
    p2p = op in P2P_OPS
    want: dict[str, Any] = {}
    seen: dict[str, Any] = {}
    bad: list[str] = []
    notes: list[str] = []
    if planned.algorithm is not None and not p2p:
        want["algorithm"], seen["algorithm"] = (
            planned.algorithm,
            _one(ALGORITHMS.get(o.algo or "", o.algo) for o in ops),
        )
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
            split = {
                o: nccl_coll_channels(o, planned.n_channels, o.n_ranks if o.n_ranks > 0 else group_size) for o in ops
            }
            if all(s is None and o.abi >= 4 for o, s in split.items()):
                del want["n_channels"], seen["n_channels"]
            elif any(o.channels not in (planned.n_channels, split[o]) for o in ops):
                bad.append("n_channels")
                rule = _one(s for s in split.values() if s is not None)
                nccl = f" (NCCL's split of the call gives {rule})" if rule != () else ""
                if max(channels) < planned.n_channels:
                    notes.append(
                        f"clamped: NCCL ran {seen['n_channels']} of the {planned.n_channels} planned channels{nccl}"
                    )
            elif any(o.channels != planned.n_channels for o in ops):
                notes.append(
                    f"split: NCCL ran the {planned.n_channels} planned channels' call on "
                    f"{seen['n_channels']}, as its traffic cells give for these bytes"
                )
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


def site_kernel_us(
    comms: Iterable[ObservedComm], key: str, op: str, nbytes: int, group_size: int, calls: int
) -> float | None:
    """The site's NCCL kernel time, us summed over ``calls``; None unless the records tell it apart (ABI v4+)."""
    ops = matching_ops(comms, key, op, nbytes, group_size)
    if not ops or calls <= 0 or sum(o.calls for o in ops) != calls or sum(o.kernel_calls for o in ops) != calls:
        return None
    return sum(o.kernel_ns for o in ops) / 1e3
