"""How many channels NCCL launches by default on a topology (the simulator's NCCL side).

NCCL builds its rings in two steps, and the channel count a collective runs with comes from both
(NCCL 2.30.7 source, ``NVIDIA/nccl`` master of this writing):

1. The graph search (``src/graph/search.cc``, ``ncclTopoCompute``) packs as many rings as the
   path bandwidth allows at the highest speed of its speed table (``speedArrayIntra``,
   search.cc:1051). A PCIe Gen4 x16 path is worth 24 GB/s in NCCL's units (``kvDictPciGen``,
   topo.cc:553: 120 per lane x 16 lanes / 80), so one ring fits at 20 GB/s.
2. ``ncclTopoDupChannels`` (search.cc:1036-1047) doubles the rings only when the ring speed
   ``bwIntra`` is at least 25 GB/s (search.cc:1039), and ``ncclTopoPostset``
   (``src/graph/connect.cc:460``) doubles the channels once more when it connects them.

So a PCIe node, and a PCIe node behind one NIC, launches 2 channels (an NCCL maintainer in
nccl#689: a PCIe system with one NIC "should just launch 2 SMs"). NVSwitch nodes find many fast
rings: DGX A100 logs "24 coll channels", DGX H100 "32 coll channels" (NCCL_DEBUG=INFO, one
node); across nodes with one 400 Gb/s NIC per GPU about 16 (nccl#689). NVLS runs 16 channels
(``NCCL_MAX_NVLS_ARITY``-bounded heads, search.cc:1127). The size rule after it (fewer channels
for small messages) is NCCL's ``ncclCollTuning`` reduction of ``nc`` for small sizes in broad
strokes (``src/enqueue.cc``: each channel needs enough chunks).
"""

from __future__ import annotations

PCIE_CHANNELS = 2
"""Channels on a PCIe node or across PCIe nodes (one search ring, not duplicated, doubled once)."""
NVSWITCH_CHANNELS = {90: 32, 80: 24}
"""Channels in one NVSwitch node by SM architecture (NCCL INFO logs of DGX H100 / DGX A100)."""
NVLINK_INTER_NODE_CHANNELS = 16
"""Channels across NVSwitch nodes with one NIC per GPU (nccl#689: about 16 SMs)."""
NVLS_CHANNELS = 16


def topology_channels(*, intra_link: str, sm_arch_key: int, n_nodes: int, algorithm: str) -> int:
    """NCCL's default channel count for a collective before the size rule (module docstring).

    Args:
        intra_link: ``nvlink`` or ``pcie`` (``ClusterSpec.intra_link``).
        sm_arch_key: 90 (Hopper and later) or 80 (Ampere).
        n_nodes: nodes the communicator spans.
        algorithm: the algorithm NCCL runs (Ring, Tree, NVLS); point-to-point follows the
            communicator's Ring count (``device.p2p_kernel_channels``).

    Returns:
        Channels (CTAs), >= 1.
    """
    if intra_link == "pcie":
        return PCIE_CHANNELS
    if algorithm == "NVLS":
        return NVLS_CHANNELS
    if n_nodes > 1:
        return NVLINK_INTER_NODE_CHANNELS
    return NVSWITCH_CHANNELS[90 if sm_arch_key >= 90 else 80]
