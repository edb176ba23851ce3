"""The simulator's point-to-point CTAs follow NCCL's rule (``engine.p2p``), on the paper's PCIe cluster
and across nodes: NVIDIA/nccl v2.30.7 ``src/graph/paths.cc:918-1007`` (channels per peer: PCIe 2)
and ``src/enqueue.cc:915-925, 1141-1146`` (a task's channels)."""

from __future__ import annotations

import dataclasses

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.sim.channel_defaults import p2p_channels
from lagom_megatron.sim.device import Collective, Gpu


def test_a_pipeline_send_on_pcie_runs_two_ctas_whatever_the_bound():
    """A PCIe peer wants 2 channels (``paths.cc:937-938``): a 64 MiB send on a communicator bounded at 8
    (p2pnChannels 8) still runs 2 CTAs; at bound 1 it runs 1."""
    a40 = Gpu.from_cluster(ClusterSpec.load("a40-pcie-ib200"))
    send = Collective(op="send", nbytes=64 << 20, group_size=2)
    assert [p2p_channels(a40, send, cta_bound=bound) for bound in (1, 2, 8, 32)] == [1, 2, 2, 2]


def test_a_send_across_nodes_takes_the_nics_channels_per_peer():
    """NCCL 2.30, one 50 GB/s NIC per GPU: max(1, divUp(50, 14)) = 4 per network peer; NCCL 2.27.5: 2."""
    h100 = ClusterSpec.load("h100-sxm-ib400")
    send = Collective(op="send", nbytes=64 << 20, group_size=2, n_nodes=2)
    assert p2p_channels(Gpu.from_cluster(dataclasses.replace(h100, nccl_version="2.30.7")), send, cta_bound=16) == 4
    assert p2p_channels(Gpu.from_cluster(dataclasses.replace(h100, nccl_version="2.27.5")), send, cta_bound=16) == 2


def test_a_bridged_pair_is_an_nvlink_peer_and_a_bridged_ring_has_pcie_peers():
    """NVLink-bridged A40 pairs (``nvlink_bridge_gbps`` 56.25): a group of one pair is an NVLink peer,
    2 x int(56.25 / 12 GB/s per sm86 link) = 8 channels per peer (paths.cc:930-936, ``SM86_NVLINK_BW``
    ``src/graph/topo.h``), so a 64 MiB send on a 16-channel bound runs 8 CTAs; in a group of 8 the
    least over the peers is a PCIe peer's 2 (paths.cc:961-966)."""
    bridged = Gpu.from_cluster(ClusterSpec.load("a40-nvlink-ib800"))
    assert p2p_channels(bridged, Collective(op="send", nbytes=64 << 20, group_size=2), cta_bound=16) == 8
    a2a = Collective(op="all_to_all", nbytes=512 << 20, group_size=8)  # 64 MiB per peer
    assert p2p_channels(bridged, a2a, cta_bound=16) == 16  # 8 tasks x 2 channels
