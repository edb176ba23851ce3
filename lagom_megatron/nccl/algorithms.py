"""Which NCCL algorithms one collective can run: by op, hardware, NCCL version, NCCL's node count, reduction and dtype.
Node counts are NCCL's (``ClusterSpec.nccl_nodes``: an MNNVL domain is one node), not hosts."""

from __future__ import annotations

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import ALGORITHMS_FOR_OP
from lagom_megatron.nccl.bins import AVERAGING_OPS, REDUCING_OPS, nvls_supported, site_dtypes

ALGORITHM_SINCE: dict[str, tuple[int, int, int]] = {
    "Ring": (2, 0, 0), "Tree": (2, 4, 0), "NVLS": (2, 17, 0), "NVLSTree": (2, 18, 0),
    "CollNetDirect": (2, 14, 0), "CollNetChain": (2, 14, 0), "PAT": (2, 23, 0),
}
"""First NCCL release of each algorithm."""


NVLS_MAX_ARITY = 32
"""``NCCL_MAX_NVLS_ARITY`` (NVIDIA/nccl v2.30.7 ``src/include/device.h:213``): above this many local
ranks NCCL runs NVLS / NVLSTree only for all-reduce (``src/enqueue.cc:2004-2006``)."""


def algorithms_for(*, op: str, cluster: ClusterSpec, n_nodes: int = 1, group_size: int = 2,
                   reduce_op: str | None = None) -> tuple[str, ...]:
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
            continue  # more local ranks than NCCL_MAX_NVLS_ARITY: NCCL skips NVLS but for all-reduce
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


def call_algorithms(algorithms: tuple, *, op: str, reduce_op: str | None, dtype: str,
                    parts: tuple[tuple[str, int], ...] = ()) -> tuple[tuple, str]:
    """``algorithms`` minus NVLS / NVLSTree where ``ncclNvlsSupported`` lacks the call's (reduction, dtype), and why."""
    if op not in REDUCING_OPS or not any(a in ("NVLS", "NVLSTree") for a in algorithms):
        return algorithms, ""
    bad = sorted({d for d in site_dtypes(dtype, parts) if not nvls_supported(reduce_op, d)})
    if not bad:
        return algorithms, ""
    keep = tuple(a for a in algorithms if a not in ("NVLS", "NVLSTree"))
    why = "not recorded" if reduce_op is None else f"{reduce_op} of {', '.join(bad)}"
    return (keep if len(keep) > 1 else (None,)), f"no NVLS: NCCL runs none for this reduction ({why}; ncclNvlsSupported)"
