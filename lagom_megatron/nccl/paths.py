"""Which protocols NCCL enables by default on which intra-node path (the search domain must not
offer what NCCL would not run).

NCCL v2.30.7 ``src/graph/tuning.cc:518-535``: LL128 starts "enabled by default only in certain
cases" (tuning.cc:441-446) and is kept only when every intra-node hop of the communicator's graph
is NVLink (``typeIntra <= PATH_NVB``, tuning.cc:531), the GPU-NIC path is at most PXB (PXN from
Hopper, tuning.cc:520-530) and the GPUs share a compute capability (tuning.cc:533); a disabled
protocol's bandwidth is set to 0 (tuning.cc:537), so a tuner that prefers it is not followed.
"""

from __future__ import annotations

from lagom_megatron.engine.cluster import ClusterSpec


def ll128_enabled(cluster: ClusterSpec, *, n_nodes: int = 1, group_size: int = 2) -> bool:
    """Whether NCCL enables LL128 by default for a group of ``group_size`` ranks over ``n_nodes``.

    True on NVLink nodes (NVSwitch; sm80+ here, NCCL: sm70+). On a PCIe node (``intra_link:
    pcie``) a ring's hops cross PCIe, so False, except for a group that is one NVLink-bridged
    pair per node (``nvlink_bridge_gbps``), whose only hop is the bridge. The GPU-NIC path is
    taken to be a PCIe switch (PXB), as on every modelled cluster.
    """
    if cluster.sm_arch < 80:
        return False
    if cluster.intra_link != "pcie":
        return True
    return bool(cluster.nvlink_bridge_gbps) and max(1, group_size // max(1, n_nodes)) == 2
