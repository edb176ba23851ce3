"""NCCL's own tuning model (``sim/tuning_model.py``) against what NCCL reports on real systems:
its INFO logs, a maintainer's statements, and the behaviour its source lines define."""

from __future__ import annotations

import pytest

from lagom_megatron.engine import p2p
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.nccl.rules import domains, ll128_enabled
from lagom_megatron.sim import tuning_model as nm


def test_ring_search_of_a_dgx_a100_gives_the_24_channels_its_log_reports():
    # DGX A100: 12 NVLinks of 20 GB/s in NCCL's units per GPU (topo.h:21); NCCL INFO logs
    # "24 coll channels" (nccl-tests#100 log: "Channel 23/24")
    ch, speed = nm.ring_graph(12 * nm.NVLINK_BW[80], sm_arch=80, inter=False)
    assert nm.comm_ctas(ch) == 24
    assert ch * speed == pytest.approx(240.0)


def test_a_pcie_system_behind_one_100g_nic_launches_two_sms_with_256_threads():
    # nccl#689, an NCCL maintainer: a PCI system with one NIC "should just launch 2 SMs"
    ch, speed = nm.ring_graph(12.5, sm_arch=86, inter=True, max_bw=12.5)
    assert nm.comm_ctas(ch) == 2
    # and Ring/Simple runs 256 threads when the graph is not faster than PCI Gen3 (tuning.cc:244-245)
    assert nm.default_threads("Simple", "Ring", ring_busbw_gbs=ch * speed) == 256


def test_two_pcie_gpus_get_the_channels_an_nccl_log_shows():
    # nccl#1706 (2 GPUs without NVLink): "4 coll channels ... 2 p2p channels per peer"
    ch, _ = nm.ring_graph(nm.PCIE_GEN4_X16, sm_arch=80, inter=False)
    assert nm.comm_ctas(ch) == 4
    assert (
        float(
            p2p.peer_channels(
                p2p=p2p.p2p_channels(4), n_nodes=1, group_size=2, intra_link="pcie", sm_arch=80, nvlink_gbps=24.0
            )
        )
        == 2
    )


def test_dgx_h100_p2p_channels_per_peer_match_its_log():
    # NCCL INFO on 8 x H100 SXM: "32 p2p channels, 32 p2p channels per peer" (18 NVLinks: 2 per link,
    # rounded up and capped at the communicator's P2P channels, paths.cc:932-990)
    assert (
        float(
            p2p.peer_channels(
                p2p=p2p.p2p_channels(32),
                n_nodes=1,
                group_size=8,
                intra_link="nvlink",
                sm_arch=90,
                nvlink_gbps=18 * 20.6,
            )
        )
        == 32
    )


def test_network_p2p_channels_follow_the_nic_speed():
    # paths.cc:943-948: max(NICs, divUp((int)NIC GB/s, NCCL_P2P_PER_CHANNEL_NET_BW 14)), NCCL 2.29+
    kw = dict(p2p=32, n_nodes=2, group_size=2, intra_link="nvlink", sm_arch=90, nvlink_gbps=450.0, nccl=(2, 30, 7))
    assert float(p2p.peer_channels(nic_gbps=50.0, **kw)) == 4  # 400 Gb/s
    assert float(p2p.peer_channels(nic_gbps=12.5, **kw)) == 1  # 100 Gb/s


def test_size_rule_drops_channels_then_threads_for_small_messages():
    # enqueue.cc:2093-2104: Simple keeps a channel per 512 threads x 64 bytes
    assert nm.size_rule(64 << 20, channels=32, threads=512, protocol="Simple", algorithm="Ring", n_ranks=8) == (32, 512)
    assert nm.size_rule(64 << 10, channels=32, threads=512, protocol="Simple", algorithm="Ring", n_ranks=8) == (2, 512)
    nc, nt = nm.size_rule(8 << 10, channels=32, threads=512, protocol="Simple", algorithm="Ring", n_ranks=8)
    assert nc == 1 and nt < 512


@pytest.mark.parametrize(
    "cluster, n_nodes, group, expect",
    [
        ("h100-sxm-ib400", 1, 8, True),
        ("a100-ib100", 2, 16, True),  # NVLink paths
        ("a40-pcie-ib200", 1, 8, False),
        ("a40-pcie-ib100", 2, 16, False),  # PCIe: typeIntra > PATH_NVB
        ("a40-nvlink-ib800", 1, 8, False),  # a ring through bridged pairs crosses PCIe
        ("a40-nvlink-ib800", 1, 2, True),  # one bridged pair: only the bridge
    ],
)
def test_ll128_is_enabled_only_on_nvlink_paths(cluster, n_nodes, group, expect):
    # NCCL v2.30.7 src/graph/tuning.cc:518-535
    spec = ClusterSpec.load(cluster)
    assert ll128_enabled(spec, n_nodes=n_nodes, group_size=group) is expect
    protos = domains(cluster=spec, op="all_gather", n_nodes=n_nodes, group_size=group)["protocol"]
    assert ("LL128" in protos) is expect


def test_ll128_bandwidth_is_capped_per_search_channel():
    # tuning.cc:328-329: min(0.92 x busBw, channels x perChMaxRingLL128Bw)
    bus = nm.model_busbw_gbs(
        "Ring", "LL128", op="all_gather", graph_channels=12, graph_speed=30.0, sm_arch=90, n_nodes=1
    )
    assert bus == pytest.approx(min(0.92 * 360.0, 12 * 36.7))
    ampere = nm.model_busbw_gbs(
        "Ring", "LL128", op="all_gather", graph_channels=12, graph_speed=30.0, sm_arch=80, n_nodes=1
    )
    assert ampere == pytest.approx(12 * 20.0)


def test_ring_latency_adds_network_steps_across_nodes():
    # tuning.cc:393-412: 7 NVLink steps of 3.4 us on one node; across 2 nodes one step is the network's
    one = nm.ring_latency_us("Simple", op="all_gather", n_ranks=8, n_nodes=1, intra="nvlink")
    assert one == pytest.approx(8.4 + 7 * 3.4)
    two = nm.ring_latency_us("Simple", op="all_gather", n_ranks=16, n_nodes=2, intra="nvlink")
    assert two == pytest.approx(8.4 + 14 * 3.4 + 14.0)
