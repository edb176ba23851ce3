"""Checks of knob values against NCCL's documented domains (``nccl.rules`` re-exports them). Where NCCL clamps silently
(``NCCL_NTHREADS=480`` -> 512) lagom refuses: the cost model would predict a wrong value."""

from __future__ import annotations

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import (
    ALGORITHMS, ALGORITHMS_FOR_OP, CGA_CLUSTER_SIZES, CTA_POLICIES, N_THREADS, P2P_OPS, PROTOCOLS,
    PROTOCOLS_FOR_ALGORITHM, CommConfig, invalid_value, max_channels,
)
from lagom_megatron.nccl.algorithms import algorithms_for, call_algorithms

CHUNK_RULES: dict[str, dict[str, int]] = {
    "Simple": {"min": 4096, "max": 524288, "multiple": 0},
    "LL": {"min": 1024, "max": 32768, "multiple": 0},
    "LL128": {"min": 3840, "max": 576000, "multiple": 120},
}
"""Chunk sizes per protocol, bytes, up to one step of the default buffer (Simple 4 MiB / 8; LL 512 KiB, half flags, / 8;
LL128 4,915,200 x 120/128 / 8, multiples of 120). NCCL clamps larger values (tuner v6)."""


def validate_config(config: CommConfig, *, op: str, cluster: ClusterSpec, mechanism: str = "tuner", n_nodes: int = 1,
                    group_size: int | None = None, reduce_op: str | None = None, dtype: str | None = None) -> None:
    """Checks every set knob of ``config`` against NCCL's domain for ``op`` on ``cluster`` (LL128 is never forced,
    nccl#786/#1261); ValueError names the first bad knob, its value and the allowed set."""
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
        ok = algorithms_for(op=op, cluster=cluster, n_nodes=cluster.nccl_nodes(n_nodes, group_size), group_size=group_size,
                            reduce_op=reduce_op)
        if c.algorithm not in ok:
            raise invalid_value("algorithm", c.algorithm, list(ok),
                        f"not available on {cluster.name} (sm{cluster.sm_arch}, NCCL {cluster.nccl_version}, {n_nodes} node(s))")
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
            raise invalid_value("protocol", c.protocol, ["LL", "Simple"],
                        "forcing LL128 through NCCL_PROTO can corrupt data silently; only the tuner plugin may prefer it")
        if c.algorithm is not None and c.protocol not in PROTOCOLS_FOR_ALGORITHM[c.algorithm]:
            raise invalid_value("protocol", c.protocol, list(PROTOCOLS_FOR_ALGORITHM[c.algorithm]), f"with algorithm {c.algorithm}")
    if c.n_threads is not None and (isinstance(c.n_threads, bool) or c.n_threads not in N_THREADS):
        raise invalid_value("n_threads", c.n_threads, list(N_THREADS), "NCCL_NTHREADS")
    if c.n_threads is not None and op in P2P_OPS:
        raise invalid_value("n_threads", c.n_threads, [None], f"NCCL runs {op} with NCCL_MAX_NTHREADS whatever "
                            "NCCL_NTHREADS says (src/enqueue.cc:1136)")
    if c.n_channels is not None:
        cap = max_channels(cluster)
        if isinstance(c.n_channels, bool) or not isinstance(c.n_channels, int) or not 1 <= c.n_channels <= cap:
            raise invalid_value("n_channels", c.n_channels, f"integers 1..{cap} (NCCL {cluster.nccl_version})")
    if c.chunk_size is not None:
        if mech != "tuner" or cluster.nccl < (2, 30, 0):
            raise invalid_value("chunk_size", c.chunk_size, [None], f"per-call chunk size needs the tuner plugin v6 (NCCL >= 2.30); have NCCL {cluster.nccl_version}, mechanism {mech}")
        _check_chunk(c.chunk_size, c.protocol or "Simple")
    if c.net_peer_channels is not None:
        n = c.net_peer_channels
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64 or n & (n - 1):
            raise invalid_value("net_peer_channels", n, "powers of two 1..64", "NCCL rounds nChannelsPerNetPeer up to one")
        if op not in P2P_OPS:
            raise invalid_value("net_peer_channels", n, [None], f"channels per network peer apply to point-to-point, not {op}")
        if cluster.nccl < (2, 12, 0):
            raise invalid_value("net_peer_channels", n, [None], f"NCCL_NCHANNELS_PER_NET_PEER needs NCCL 2.12; have {cluster.nccl_version}")
    if c.high_priority_stream is not None:
        if not isinstance(c.high_priority_stream, bool):
            raise invalid_value("high_priority_stream", c.high_priority_stream, [None, True, False])
        if mech == "env":
            raise invalid_value("high_priority_stream", c.high_priority_stream, [None],
                                "a stream priority is a process group's option (a pool entry), not a variable of the env mechanism")
    if c.cta_policy is not None and c.cta_policy not in CTA_POLICIES:
        raise invalid_value("cta_policy", c.cta_policy, list(CTA_POLICIES))
    if c.cga_cluster_size is not None:
        if isinstance(c.cga_cluster_size, bool) or c.cga_cluster_size not in CGA_CLUSTER_SIZES:
            raise invalid_value("cga_cluster_size", c.cga_cluster_size, "integers 0..8")
        if cluster.sm_arch < 90 and c.cga_cluster_size != 0:
            raise invalid_value("cga_cluster_size", c.cga_cluster_size, [0], f"thread-block clusters need sm90+; {cluster.name} is sm{cluster.sm_arch}")


def _check_chunk(chunk: int, protocol: str) -> None:
    rule = CHUNK_RULES[protocol]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not rule["min"] <= chunk <= rule["max"]:
        raise invalid_value("chunk_size", chunk, f"{rule['min']}..{rule['max']} bytes for protocol {protocol}")
    if rule["multiple"]:
        if chunk % rule["multiple"]:
            raise invalid_value("chunk_size", chunk, f"multiples of {rule['multiple']} bytes for protocol {protocol} (120 data bytes per 128-byte line)")
    elif chunk & (chunk - 1):
        raise invalid_value("chunk_size", chunk, f"powers of two for protocol {protocol}")


def validate_cta_range(min_ctas: int | None, max_ctas: int | None, *, cluster: ClusterSpec) -> None:
    """Checks a CTA range: both ends (NCCL PR#2256: a lone ``min_ctas`` fails), 1 <= min <= max <= 64 (32 before NCCL
    2.25); ValueError names what breaks."""
    if (min_ctas is None) != (max_ctas is None):
        given, missing = ("min_ctas", "max_ctas") if max_ctas is None else ("max_ctas", "min_ctas")
        raise ValueError(f"a CTA range needs both ends: {given} is set but {missing} is not (NCCL rejects a one-sided range)")
    if min_ctas is None:
        return
    cap = max_channels(cluster)
    for name, value in (("min_ctas", min_ctas), ("max_ctas", max_ctas)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap:
            raise invalid_value(name, value, f"integers 1..{cap} (NCCL {cluster.nccl_version})")
    if min_ctas > max_ctas:
        raise ValueError(f"min_ctas ({min_ctas}) must be <= max_ctas ({max_ctas})")
