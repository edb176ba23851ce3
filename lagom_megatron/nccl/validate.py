"""Knob values checked against NCCL's domains, refusing what NCCL clamps silently (``NCCL_NTHREADS=480`` -> 512)."""

from __future__ import annotations

from collections.abc import Iterable

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import (
    ALGORITHMS,
    ALGORITHMS_FOR_OP,
    CGA_CLUSTER_SIZES,
    CTA_POLICIES,
    N_THREADS,
    P2P_OPS,
    PROTOCOLS,
    PROTOCOLS_FOR_ALGORITHM,
    CommConfig,
    invalid_value,
    max_channels,
)

AGGREGATE_RATIO = 4
"""NCCL aggregates a bin's tasks while they stay below this multiple of the first (``enqueue.cc:430``)."""
SORTER_UNIT_LOG2, SORTER_MAX_LOG2, SORTER_BITS_PER_POW2 = 10, 30, 2
"""``ncclTaskCollSorter``'s ``UnitLog2`` (1 KiB), ``MaxLog2`` (1 GiB) and ``BitsPerPow2`` (``comm.h:362-368``)."""

NVLS_SUM_MINMAX_DTYPES = frozenset({"int32", "uint32", "int64", "uint64", "float16", "bfloat16"})
"""dtypes (torch's names) NCCL reduces with NVLS for sum, min and max."""
NVLS_SUM_DTYPES = frozenset({"float32", "float64"})
AVERAGING_OPS = frozenset({"avg", "premul_sum"})
"""torch reductions NCCL runs as a scaled sum (``ncclDevPreMulSum`` / ``ncclDevSumPostDiv``)."""
BYTE_OPS = frozenset({"all_gather", "broadcast"})
"""Ops NCCL enqueues as ``ncclInt8``: one bin (v2.30.7 ``src/enqueue.cc:2733-2737``, v2.27.7 :2360-2362)."""
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
    as_bytes = op in BYTE_OPS
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


ALGORITHM_SINCE: dict[str, tuple[int, int, int]] = {
    "Ring": (2, 0, 0),
    "Tree": (2, 4, 0),
    "NVLS": (2, 17, 0),
    "NVLSTree": (2, 18, 0),
    "CollNetDirect": (2, 14, 0),
    "CollNetChain": (2, 14, 0),
    "PAT": (2, 23, 0),
}


NVLS_MAX_ARITY = 32
"""``NCCL_MAX_NVLS_ARITY`` (NVIDIA/nccl v2.30.7 ``src/include/device.h:213``): above this many local
ranks NCCL runs NVLS / NVLSTree only for all-reduce (``src/enqueue.cc:2004-2006``)."""


def algorithms_for(
    *, op: str, cluster: ClusterSpec, n_nodes: int = 1, group_size: int = 2, reduce_op: str | None = None
) -> tuple[str, ...]:
    """Algorithms NCCL can run for ``op`` on ``cluster`` (``n_nodes``: NCCL's); ``reduce_op`` None excludes PAT
    reduce-scatter, which NCCL 2.30 skips for averaging reductions (``src/enqueue.cc:2010-2012``)."""
    if op not in ALGORITHMS_FOR_OP:
        return ()
    v = cluster.nccl
    out = []
    for alg in ALGORITHMS_FOR_OP[op]:
        if v < ALGORITHM_SINCE[alg]:
            continue
        if alg in ("NVLS", "NVLSTree") and not (cluster.nvswitch and cluster.sm_arch >= 90):
            continue
        if alg == "NVLSTree" and n_nodes < 2:
            continue
        if alg in ("NVLS", "NVLSTree") and group_size <= 2 * n_nodes:
            continue  # two GPUs per NVLink domain: a direct copy, nothing for the switch to do (our rule)
        if alg == "NVLS" and n_nodes > 1 and op != "all_reduce":
            continue  # NVLS all-gather / reduce-scatter are modelled inside one NVLink domain only
        if alg in ("NVLS", "NVLSTree") and op != "all_reduce" and group_size > NVLS_MAX_ARITY * max(1, n_nodes):
            continue
        if alg == "NVLS" and n_nodes > 1 and not cluster.collnet:
            continue  # NCCL disables NVLS across nodes without CollNet (2.30 src/enqueue.cc:2008)
        if alg.startswith("CollNet") and not (cluster.collnet and n_nodes > 1):
            continue
        if alg == "PAT" and group_size != n_nodes:
            continue
        if alg == "PAT" and op == "reduce_scatter" and (reduce_op is None or reduce_op.lower() in AVERAGING_OPS):
            continue
        out.append(alg)
    return tuple(out)


def call_algorithms(
    algorithms: tuple, *, op: str, reduce_op: str | None, dtype: str, parts: tuple[tuple[str, int], ...] = ()
) -> tuple[tuple, str]:
    """``algorithms`` minus NVLS / NVLSTree where ``ncclNvlsSupported`` lacks the call's (reduction, dtype), and why."""
    if op not in REDUCING_OPS or not any(a in ("NVLS", "NVLSTree") for a in algorithms):
        return algorithms, ""
    bad = sorted({d for d in site_dtypes(dtype, parts) if not nvls_supported(reduce_op, d)})
    if not bad:
        return algorithms, ""
    keep = tuple(a for a in algorithms if a not in ("NVLS", "NVLSTree"))
    why = "not recorded" if reduce_op is None else f"{reduce_op} of {', '.join(bad)}"
    return (
        keep if len(keep) > 1 else (None,)
    ), f"no NVLS: NCCL runs none for this reduction ({why}; ncclNvlsSupported)"


CHUNK_RULES: dict[str, dict[str, int]] = {
    "Simple": {"min": 4096, "max": 524288, "multiple": 0},
    "LL": {"min": 1024, "max": 32768, "multiple": 0},
    "LL128": {"min": 3840, "max": 576000, "multiple": 120},
}
"""Chunk sizes per protocol, bytes, up to one step of the default buffer (Simple 4 MiB / 8; LL 512 KiB, half flags, / 8;
LL128 4,915,200 x 120/128 / 8, multiples of 120). NCCL clamps larger values (tuner v6)."""


def validate_config(
    config: CommConfig,
    *,
    op: str,
    cluster: ClusterSpec,
    mechanism: str = "tuner",
    n_nodes: int = 1,
    group_size: int | None = None,
    reduce_op: str | None = None,
    dtype: str | None = None,
) -> None:
    """Checks each set knob of ``config`` for ``op`` on ``cluster`` (no forced LL128, nccl#786/#1261); ValueError."""
    mech = mechanism
    group_size = group_size or max(2, n_nodes * getattr(cluster, "gpus_per_node", 1))  # whole nodes
    c = config
    if c.algorithm is not None:
        if c.algorithm not in ALGORITHMS:
            raise invalid_value("algorithm", c.algorithm, list(ALGORITHMS), "unknown NCCL algorithm")
        if op not in ALGORITHMS_FOR_OP:
            raise invalid_value("algorithm", c.algorithm, [None], f"op {op!r} is point-to-point")
        if c.algorithm not in ALGORITHMS_FOR_OP[op]:
            raise invalid_value("algorithm", c.algorithm, list(ALGORITHMS_FOR_OP[op]), f"not implemented for {op}")
        ok = algorithms_for(
            op=op,
            cluster=cluster,
            n_nodes=cluster.nccl_nodes(n_nodes, group_size),
            group_size=group_size,
            reduce_op=reduce_op,
        )
        if c.algorithm not in ok:
            raise invalid_value(
                "algorithm",
                c.algorithm,
                list(ok),
                f"not available on {cluster.name} (sm{cluster.sm_arch}, NCCL {cluster.nccl_version}, {n_nodes} node(s))",
            )
        if dtype is not None:
            kept, why = call_algorithms(ok, op=op, reduce_op=reduce_op, dtype=dtype)
            if why and c.algorithm not in kept:
                raise invalid_value("algorithm", c.algorithm, [a for a in kept if a], why)
    if c.protocol is not None:
        if c.protocol not in PROTOCOLS:
            raise invalid_value("protocol", c.protocol, list(PROTOCOLS), "unknown NCCL protocol")
        if op in P2P_OPS:
            raise invalid_value("protocol", c.protocol, [None], f"op {op!r} is point-to-point")
        if c.protocol == "LL128" and mech != "tuner":
            raise invalid_value(
                "protocol",
                c.protocol,
                ["LL", "Simple"],
                "forcing LL128 through NCCL_PROTO can corrupt data silently; only the tuner plugin may prefer it",
            )
        if c.algorithm is not None and c.protocol not in PROTOCOLS_FOR_ALGORITHM[c.algorithm]:
            raise invalid_value(
                "protocol", c.protocol, list(PROTOCOLS_FOR_ALGORITHM[c.algorithm]), f"with algorithm {c.algorithm}"
            )
    if c.n_threads is not None and (isinstance(c.n_threads, bool) or c.n_threads not in N_THREADS):
        raise invalid_value("n_threads", c.n_threads, list(N_THREADS), "NCCL_NTHREADS")
    if c.n_threads is not None and op in P2P_OPS:
        raise invalid_value(
            "n_threads",
            c.n_threads,
            [None],
            f"NCCL runs {op} with NCCL_MAX_NTHREADS whatever NCCL_NTHREADS says (src/enqueue.cc:1136)",
        )
    if c.n_channels is not None:
        cap = max_channels(cluster)
        if isinstance(c.n_channels, bool) or not isinstance(c.n_channels, int) or not 1 <= c.n_channels <= cap:
            raise invalid_value("n_channels", c.n_channels, f"integers 1..{cap} (NCCL {cluster.nccl_version})")
    if c.chunk_size is not None:
        if mech != "tuner" or cluster.nccl < (2, 30, 0):
            raise invalid_value(
                "chunk_size",
                c.chunk_size,
                [None],
                f"per-call chunk size needs the tuner plugin v6 (NCCL >= 2.30); have NCCL {cluster.nccl_version}, mechanism {mech}",
            )
        _check_chunk(c.chunk_size, c.protocol or "Simple")
    if c.net_peer_channels is not None:
        n = c.net_peer_channels
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64 or n & (n - 1):
            raise invalid_value(
                "net_peer_channels", n, "powers of two 1..64", "NCCL rounds nChannelsPerNetPeer up to one"
            )
        if op not in P2P_OPS:
            raise invalid_value(
                "net_peer_channels", n, [None], f"channels per network peer apply to point-to-point, not {op}"
            )
        if cluster.nccl < (2, 12, 0):
            raise invalid_value(
                "net_peer_channels",
                n,
                [None],
                f"NCCL_NCHANNELS_PER_NET_PEER needs NCCL 2.12; have {cluster.nccl_version}",
            )
    if c.high_priority_stream is not None:
        if not isinstance(c.high_priority_stream, bool):
            raise invalid_value("high_priority_stream", c.high_priority_stream, [None, True, False])
        if mech == "env":
            raise invalid_value(
                "high_priority_stream",
                c.high_priority_stream,
                [None],
                "a stream priority is a process group's option (a pool entry), not a variable of the env mechanism",
            )
    if c.cta_policy is not None and c.cta_policy not in CTA_POLICIES:
        raise invalid_value("cta_policy", c.cta_policy, list(CTA_POLICIES))
    if c.cga_cluster_size is not None:
        if isinstance(c.cga_cluster_size, bool) or c.cga_cluster_size not in CGA_CLUSTER_SIZES:
            raise invalid_value("cga_cluster_size", c.cga_cluster_size, "integers 0..8")
        if cluster.sm_arch < 90 and c.cga_cluster_size != 0:
            raise invalid_value(
                "cga_cluster_size",
                c.cga_cluster_size,
                [0],
                f"thread-block clusters need sm90+; {cluster.name} is sm{cluster.sm_arch}",
            )


def _check_chunk(chunk: int, protocol: str) -> None:
    rule = CHUNK_RULES[protocol]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not rule["min"] <= chunk <= rule["max"]:
        raise invalid_value("chunk_size", chunk, f"{rule['min']}..{rule['max']} bytes for protocol {protocol}")
    if rule["multiple"]:
        if chunk % rule["multiple"]:
            raise invalid_value(
                "chunk_size",
                chunk,
                f"multiples of {rule['multiple']} bytes for protocol {protocol} (120 data bytes per 128-byte line)",
            )
    elif chunk & (chunk - 1):
        raise invalid_value("chunk_size", chunk, f"powers of two for protocol {protocol}")


def validate_cta_range(min_ctas: int | None, max_ctas: int | None, *, cluster: ClusterSpec) -> None:
    """Checks a CTA range: both ends (NCCL PR#2256), 1 <= min <= max <= 64 (32 before NCCL 2.25); ValueError."""
    if (min_ctas is None) != (max_ctas is None):
        given, missing = ("min_ctas", "max_ctas") if max_ctas is None else ("max_ctas", "min_ctas")
        raise ValueError(
            f"a CTA range needs both ends: {given} is set but {missing} is not (NCCL rejects a one-sided range)"
        )
    if min_ctas is None:
        return
    cap = max_channels(cluster)
    for name, value in (("min_ctas", min_ctas), ("max_ctas", max_ctas)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap:
            raise invalid_value(name, value, f"integers 1..{cap} (NCCL {cluster.nccl_version})")
    if min_ctas > max_ctas:
        raise ValueError(f"min_ctas ({min_ctas}) must be <= max_ctas ({max_ctas})")
