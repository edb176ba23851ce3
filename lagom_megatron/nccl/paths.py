"""Which protocols NCCL enables by default on which intra-node path.

NCCL v2.30.7 ``src/graph/tuning.cc:518-535`` (:441-446): LL128 only when every intra-node hop is NVLink (:531), the
GPU-NIC path is at most PXB (PXN from Hopper, :520-530) and the GPUs share a compute capability (:533); a disabled
protocol's bandwidth is 0 (:537), so a tuner preferring it is ignored."""

from __future__ import annotations

from lagom_megatron.engine.cluster import ClusterSpec


def ll128_enabled(cluster: ClusterSpec, *, n_nodes: int = 1, group_size: int = 2) -> bool:
    """Whether NCCL enables LL128 by default for ``group_size`` ranks on ``n_nodes`` (PCIe: a bridged pair per node)."""
    if cluster.sm_arch < 80:
        return False
    if cluster.intra_link != "pcie":
        return True
    return bool(cluster.nvlink_bridge_gbps) and max(1, group_size // max(1, n_nodes)) == 2
