"""Applied = observed, on NCCL: does what NCCL reported it ran for a site's calls match the plan? Records are matched
by function and bytes; fields (docs/nccl.md; NVIDIA/nccl v2.30.7): ``algo``/``proto`` (``src/collectives.cc:95-127``,
``src/plugin/profiler.cc:498-499``), ``nChannels`` (``src/enqueue.cc:701-704``; ABI v1-v3 the maximum, :2178; none for
CollNet / multi-node NVLS, :624-654), ``nWarps``, the proxy ``chunkSize`` (``src/plugin/profiler.cc:580``; network).
Channel counts are judged by the scheduling rule of the NCCL version that ran (``CELL_RULES``); under a version whose
rule lagom has not read they are reported but never make a site differ. A site planned on copy engines (CTA policy
ZERO) is applied only when NCCL's copy-engine events (profiler ABI v6+, ``src/plugin/profiler.cc:823-938``) report its
calls: NCCL falls back to SM kernels silently (``observe_site``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lagom_megatron.engine.knobs import P2P_OPS, CommConfig
from lagom_megatron.engine.p2p import P2PModel, p2p_channels
from lagom_megatron.nccl.plugin_status import ObservedComm, ObservedOp

FUNC_OPS = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "Send": "send",
    "Recv": "recv",
}
"""NCCL's function names (``ncclFuncToString``, ``src/collectives.cc:14-45``) -> lagom's op names."""
CE_FALLBACK = "no symmetric window or no NVLink domain (or a CUDA driver before 12.5)"
"""Why NCCL runs a CTA-policy-ZERO call on SMs instead of copy engines, silently: ``ncclCeAvailable`` wants a CUDA
driver >= 12.5, every rank in the NVLink (LSA) team, symmetric support and the receive buffer in a symmetric window
(v2.30.7 ``src/ce_coll.cc:93-131``), and neither buffer in system memory (``src/enqueue.cc:3054``); otherwise the call
is enqueued as a kernel collective (:3057-3116)."""
CE_UNPLANNED = (
    "NCCL ran copy engines, which the plan did not ask for (no CTA policy ZERO); NCCL picks them itself for an "
    "all-gather of more than NCCL_SYM_CE_THRESHOLD elements on an all-NVLink Blackwell with symmetric buffers"
)
"""A site planned without ZERO that shows copy-engine records (v2.30.7 ``src/enqueue.cc:3110-3113``, threshold 8 Mi
elements, :31)."""
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


NcclVersion = tuple[int, int, int]

CELL_RULES: tuple[tuple[NcclVersion, NcclVersion, int, bool], ...] = (
    ((2, 27, 0), (2, 28, 9), 16 << 10, False),
    ((2, 29, 0), (2, 31, 2), 32 << 10, True),
)
"""How ``scheduleCollTasksToPlan`` cuts one collective into channels, per range of NCCL versions whose source was read:
(first, last version, minimum traffic per channel in bytes, per-channel traffic rounded up to 16 bytes instead of
raised to that minimum). 16 KiB, raised: v2.27.3 ``src/enqueue.cc:539``, :572 through v2.28.9 :529, :562 (every tag
between). 32 KiB, rounded: v2.29.2 ``src/enqueue.cc:576``, :609 through v2.30.7 :585, :618 (every tag between), and
2.31.2 ``src/enqueue/enqueue.cc`` ``scheduleCollTasksToPlan`` @8898068 (the same cells; new there only the per-call
CTA bounds clamp a task's maximum before the split, no-ops without ``ncclCollConfig_t``). NCCL before 2.27 reports the
tuner's maximum (ABI v1-v3), compared as it is."""

NEWEST_RULE_READ: NcclVersion = CELL_RULES[-1][1]
"""The newest NCCL whose channel rule lagom has read; newer ones' channel counts never make a site differ."""


def _rule(nccl_version: NcclVersion | None) -> tuple[int, bool] | None:
    for first, last, min_traffic, rounded in CELL_RULES:
        if nccl_version is not None and first <= tuple(nccl_version) <= last:
            return min_traffic, rounded
    return None


def channel_rule_read(nccl_version: NcclVersion | None) -> bool:
    """True when lagom has read how NCCL ``nccl_version`` reports channels: before 2.27 (the tuner's maximum) or in a
    ``CELL_RULES`` range; False for a newer or unknown (None) version."""
    if nccl_version is None:
        return False
    return tuple(nccl_version) < CELL_RULES[0][0] or _rule(nccl_version) is not None


def unread_rule_note(nccl_version: NcclVersion | None) -> str | None:
    """The one log line for a run whose NCCL's channel rule lagom has not read; None when it has."""
    if channel_rule_read(nccl_version):
        return None
    which = f"NCCL {'.'.join(map(str, nccl_version))}" if nccl_version is not None else "an NCCL of unknown version"
    return (
        f"lagom: note: the observed check runs on {which}; the newest NCCL whose channel scheduling lagom has read is "
        f"{'.'.join(map(str, NEWEST_RULE_READ))}, so a site whose channel count differs is reported, never reverted "
        "for it (algorithm, protocol, threads and chunk size are still checked)"
    )


UNREAD = " (not counted: this NCCL's channel rule is not read)"
"""The end of a channel note under an NCCL whose rule lagom has not read (``unread_rule_note`` says which, once)."""


def nccl_coll_channels(op: ObservedOp, n_channels: int, n_ranks: int, nccl_version: NcclVersion | None) -> int | None:
    """Channels NCCL ``nccl_version`` runs one collective on, alone in its launch, given ``n_channels``; None where the
    record cannot tell or the version's rule is not read (``CELL_RULES``). ``scheduleCollTasksToPlan`` (v2.30.7
    ``src/enqueue.cc:576-704``; v2.27.3 :536-648, v2.28.9 :529-638): traffic per byte :91-102, :2790; LL x4 :461, :658;
    minimum per channel :585, :597; split :598-599, :618; cells :659-664, :665-701. ValueError: ``n_channels`` or
    ``n_ranks`` < 1."""
    if n_channels < 1 or n_ranks < 1:
        raise ValueError(f"n_channels ({n_channels}) and n_ranks ({n_ranks}) must be >= 1")
    size = DTYPE_BYTES.get(op.dtype)
    rule = _rule(nccl_version)
    if (
        size is None
        or rule is None
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
    min_traffic, rounded = rule
    total = max(min_traffic, nbytes * per_byte)
    if rounded:
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


def matching_ops(
    comms: Iterable[ObservedComm], key: str, op: str, nbytes: int, group_size: int, parts: Iterable[Any] = ()
) -> list[ObservedOp]:
    """Records of the communicator(s) known as ``key`` whose function is ``op`` and bytes the plan's ``nbytes``, or
    one of its ``parts``' ((dtype, bytes): NCCL reports each tensor of a coalesced call as a task of its own). An
    all-to-all is the send and receive tasks NCCL enqueues per peer (v2.30.7 ``src/enqueue.cc:3070-3082``): every
    one on the communicator, whatever its split; on copy engines (CTA policy ZERO) its ``ce`` record of function
    ``AlltoAll`` (v2.30.7 ``src/plugin/profiler.cc:834``)."""
    sizes = {int(b) for _, b in parts} or {nbytes}
    out = []
    for comm in comms:
        if key not in comm.keys():
            continue
        n_ranks = comm.n_ranks if comm.n_ranks > 0 else group_size
        if op == "all_to_all":  # on copy engines: one AlltoAll record per call (``ncclFuncToString``)
            out += [
                o
                for o in comm.ops
                if (o.kind == "p2p" and o.func in ("Send", "Recv")) or (o.kind == "ce" and o.func == "AlltoAll")
            ]
        else:
            out += [o for o in comm.ops if FUNC_OPS.get(o.func) == op and op_bytes(o, n_ranks) in sizes]
    return out


def _ctas(n: int) -> str:
    return f"{n} CTA" + ("" if n == 1 else "s")


def _sm_run(ops: list[ObservedOp]) -> str:
    """What NCCL ran on SMs, for a note: ``RING/SIMPLE on 8 CTAs`` per distinct coll record, send/receive tasks."""
    shapes = sorted({(o.algo or "-", o.proto or "-", o.channels) for o in ops if o.kind == "coll"})
    parts = [f"{a}/{p} on {_ctas(n)}" for a, p, n in shapes]
    p2p = [o.channels for o in ops if o.kind == "p2p"]
    if p2p:
        parts.append(f"send/receive tasks on up to {_ctas(max(p2p))}")
    return ", ".join(parts)


def _engine(planned: CommConfig, ops: list[ObservedOp]) -> tuple[str, str, str] | None:
    """(planned engine, observed engine(s), note) when the plan asks for copy engines (CTA policy ZERO) or any record
    is a copy-engine one; the note is "" when they agree. None when neither: the site is judged on SM knobs alone."""
    zero = str(planned.cta_policy or "").upper() == "ZERO"
    ce = [o for o in ops if o.kind == "ce"]
    if not zero and not ce:
        return None
    sm = [o for o in ops if o.kind != "ce"]
    seen = _one("CE" if o.kind == "ce" else "SM" for o in ops)
    if zero and sm:
        share = f" for {sum(o.calls for o in sm)} of {sum(o.calls for o in ops)} calls" if ce else ""
        note = f"planned copy engines (CTA policy ZERO), NCCL ran {_sm_run(sm)}{share}: {CE_FALLBACK}"
    elif ce and not zero:
        note = f"{CE_UNPLANNED} ({sum(o.calls for o in ce)} calls)"
    else:
        note = ""
    return ("CE" if zero else "SM"), seen, note


def not_run(site_id: str) -> SiteObservation:
    """A site the plan changed with no record of its calls while lagom's profiler recorded: the plan's config did not
    run (a tuner row that matched nothing, a communicator it never reached), so it counts as differing."""
    return SiteObservation(
        site_id,
        "differs",
        {"calls": ">= 1"},
        {"calls": 0},
        ("calls",),
        0,
        "no record of its calls (function and bytes) on its communicator while lagom's profiler recorded",
    )


def observe_site(
    site_id: str,
    planned: CommConfig,
    *,
    op: str,
    nbytes: int,
    group_size: int,
    ops: list[ObservedOp],
    nccl_version: NcclVersion | None,
    p2p_expected: Callable[[ObservedOp], int | None] | None = None,
) -> SiteObservation:
    """Compares ``planned`` (the plan's config for the site) with its calls' records ``ops`` (empty: unobserved), which
    NCCL ``nccl_version`` (None: unknown) reported; its channel counts count only when ``channel_rule_read``. A P2P
    task must run on exactly ``p2p_expected(record)`` channels (``p2p_task_channels``); without it only on no more
    than the bound gives.

    Copy engines: a site planned with ``cta_policy`` ZERO is applied only when every record of its calls is a
    copy-engine (``ce``) one; an SM record means NCCL fell back to SM kernels (``CE_FALLBACK``), so it differs on
    ``cta_policy`` (``engine``: planned ``CE``, observed ``SM``), and its other knobs, which copy engines ignore, are
    not judged. A site planned without ZERO that shows ``ce`` records differs on ``cta_policy`` too (``CE_UNPLANNED``),
    its SM records judged as usual. NCCL reports copy engines from profiler ABI v6 (NCCL 2.29); NCCL 2.28 runs them
    with no event at all, so such a site is unobserved there."""
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
    calls = sum(o.calls for o in ops)
    engine = _engine(planned, ops)
    if engine is not None:
        want["engine"], seen["engine"], note = engine
        bad += ["cta_policy"] if note else []
        notes += [note] if note else []
        ops = [o for o in ops if o.kind != "ce"]
        if want["engine"] == "CE" or not ops:
            return SiteObservation(site_id, "differs" if bad else "applied", want, seen, tuple(bad), calls, note)
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
        read = channel_rule_read(nccl_version)
        if p2p:
            bound = int(p2p_channels(planned.n_channels))
            expect = {o: p2p_expected(o) for o in ops} if p2p_expected is not None else {}
            if all(c == 0 for c in channels):  # p2p events carry no channel count before ABI v4
                del want["n_channels"], seen["n_channels"]
            elif expect and all(e is not None for e in expect.values()):
                off = sorted({(o.channels, expect[o]) for o in ops if o.channels != expect[o]})
                if off:
                    bad += ["n_channels"] if read else []
                    notes.append(
                        f"P2P ran on {off[0][0]} channels where NCCL's rule gives {off[0][1]} for the planned bound "
                        f"{planned.n_channels}" + ("" if read else UNREAD)
                    )
            elif max(channels) > bound:
                bad += ["n_channels"] if read else []
                notes.append(
                    f"P2P ran on up to {max(channels)} channels, more than the {bound} its bound allows"
                    + ("" if read else UNREAD)
                )
        else:
            split = {
                o: nccl_coll_channels(o, planned.n_channels, o.n_ranks if o.n_ranks > 0 else group_size, nccl_version)
                for o in ops
            }
            if not read:
                if any(o.channels != planned.n_channels for o in ops):
                    notes.append(f"NCCL ran {seen['n_channels']} of the {planned.n_channels} planned channels{UNREAD}")
            elif all(s is None and o.abi >= 4 for o, s in split.items()):
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
    status = "differs" if bad else "applied"
    return SiteObservation(site_id, status, want, seen, tuple(bad), calls, "; ".join(notes))


def p2p_task_channels(cluster: Any, op: ObservedOp, *, bound: int, group_size: int, n_nodes: int) -> int | None:
    """Channels NCCL runs one P2P task of ``op`` on, on a communicator whose CTAs are bound to ``bound``, on ``cluster``
    (its topology gives ``p2pnChannelsPerPeer``): the count the plan's cost model predicts for it (``engine.p2p``).
    Read at v2.27.3, v2.28.9, v2.29.2 and v2.30.7 (cited): ``p2pnChannels`` from the bound
    (``src/graph/paths.cc:977-991``, per peer :993-1003), ``nChannelsMin`` halved while it x nRanks >
    ``p2pnChannels`` (``src/enqueue.cc:1143-1146``),
    the task's count from its bytes in parts of the P2P chunk / 8 .. x32 (/ 2 .. x1 across nodes) (:914-926), which
    NCCL hands the profiler as ``p2p.nChannels`` (:929, ``src/plugin/profiler.cc:534``); a task to the rank itself
    counts the same. None: unknown datatype."""
    nbytes = op_bytes(op, 1)
    if nbytes is None:
        return None
    model = P2PModel(
        cluster,
        op_p2p_S=np.array([True]),
        a2a_S=np.array([False]),
        nbytes_S=np.array([float(nbytes)]),
        group_size_S=np.array([float(group_size)]),
        n_nodes_S=np.array([float(n_nodes)]),
    )
    return int(np.asarray(model.ctas(0, float(bound))).item())  # one task: the kernel's CTAs are its channels
