"""NCCL's point-to-point channel rule (``engine.p2p``) on values worked out by hand from NVIDIA/nccl
v2.30.7 ``src/graph/paths.cc:918-1007``, ``src/enqueue.cc:915-925, 1141-1146`` and v2.27.5
``paths.cc:798-867``, and the cost model using it: a CTA bound reaches a P2P site's CTAs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lagom_megatron.engine import p2p
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.knobs import CommConfig

from .factory import site


def test_p2p_channels_follow_the_communicators_channels_rounded_up_to_a_power_of_two():
    # comm->p2pnChannels = pow2Up(max(min(nChannels, MAX_P2P), MIN_P2P)), at most 64
    assert p2p.p2p_channels([1, 2, 3, 6, 8, 24, 32, 64]).tolist() == [1, 2, 4, 8, 8, 32, 32, 64]
    assert float(p2p.p2p_channels(24, max_p2p=4)) == 4.0  # NCCL_MAX_P2P_NCHANNELS=4
    assert float(p2p.p2p_channels(1, min_p2p=3)) == 4.0  # NCCL_MIN_P2P_NCHANNELS=3, then rounded up


def test_channels_per_peer_by_path():
    kw = dict(sm_arch=90, nvlink_gbps=450.0, nccl=(2, 30, 7))
    # PCIe peers want 2 channels (paths.cc:937-938), cut to p2pnChannels
    assert p2p.peer_channels(p2p=[1, 2, 8], n_nodes=1, group_size=8, intra_link="pcie", **kw).tolist() == [1, 2, 2]
    # NVLink: 2 x max(1, 450 / 20.6) = 42 -> 64, cut to p2pnChannels 32
    assert float(p2p.peer_channels(p2p=32, n_nodes=1, group_size=8, intra_link="nvlink", **kw)) == 32.0
    # a 50 GB/s NIC: max(1 NIC, ceil(50 / 14)) = 4 per network peer (NCCL 2.29+); two ranks: ceil(2 / 8) = 1
    # round, halved while 4 x 1 > p2pnChannels
    assert p2p.peer_channels(
        p2p=[2, 4, 16], n_nodes=2, group_size=2, intra_link="nvlink", nic_gbps=50.0, **kw
    ).tolist() == [2, 4, 4]
    # nChannelsPerNetPeer set: no halving, only the cut to p2pnChannels (paths.cc:1002-1003)
    assert p2p.peer_channels(
        p2p=[4, 16], n_nodes=2, group_size=2, intra_link="nvlink", nic_gbps=50.0, net_peer_channels=8, **kw
    ).tolist() == [4, 8]
    # NCCL 2.27: 2 per network peer, 1 when 2 x nRanks > 4 x p2pnChannels, at least the NICs
    old = dict(kw, nccl=(2, 27, 5))
    assert p2p.peer_channels(p2p=[4, 16], n_nodes=2, group_size=16, intra_link="nvlink", **old).tolist() == [1, 2]


def test_task_channels_and_kernel_ctas():
    # 8-rank all-to-all on a PCIe node, 4 MiB per peer, 128 KiB chunk: nChannelsMin halves from 2 to 1
    # (2 x 8 > 2), a 4 MiB part is not above maxPart = 32 x 128 KiB: one channel per task
    t = p2p.task_channels(4 << 20, per_peer=2, p2p=2, n_ranks=8, chunk=1 << 17, multi_node=False)
    assert float(t) == 1.0 and float(p2p.kernel_ctas(t, tasks=8, p2p=2)) == 2.0
    # 8 MiB per peer: the part passes 4 MiB, so the task doubles within the peer's 2 channels
    assert float(p2p.task_channels(8 << 20, per_peer=2, p2p=16, n_ranks=8, chunk=1 << 17, multi_node=False)) == 2.0
    # a small send across nodes: ceil(16 KiB / 64 KiB) = 1 channel
    assert float(p2p.task_channels(16 << 10, per_peer=4, p2p=8, n_ranks=2, chunk=1 << 17, multi_node=True)) == 1.0
    # the kernel runs one CTA per channel used, never more than p2pnChannels
    assert p2p.kernel_ctas([1, 4], tasks=8, p2p=16).tolist() == [8, 16]


def test_the_cost_model_takes_p2p_ctas_from_the_communicators_cta_bound():
    """The channel code of a P2P site is its communicator's channel count; the model's CTAs (its SM
    share and bandwidth) follow NCCL's rule, so a bound of 6 behaves as 8 and NCCL's own count is
    the communicator's topology count, not a size rule."""
    a40 = ClusterSpec.load("a40-pcie-ib200")
    a2a = site(site_id="ep.dispatch_all_to_all[0]", op="all_to_all", nbytes=32 << 20, group="ep", group_size=8)
    m = CostModel.from_priors([a2a], [1000.0], a40)
    alg, proto, nc, nt, chunk = m.default_codes()
    # PCIe node: NCCL's ring search finds 2 rings of 12 GB/s on a 24 GB/s link, doubled by
    # connect.cc:460 (NCCL 2.30.7): 4 channels, the cluster file's coll_channels
    assert nc[0] == 4.0 == a40.coll_channels
    ctas = [float(m.prior_parts(0, alg[0], proto[0], float(n), nt[0], 0.0)[2]) for n in (1, 2, 4, 6, 8, 16, 32)]
    assert ctas == [1.0, 2.0, 4.0, 8.0, 8.0, 16.0, 16.0]  # 8 tasks x 2 channels per peer at most
    slow = [m.slowdown(a2a, CommConfig(n_channels=n)) for n in (1, 8, 16)]
    fast = [m.t_comm_us(a2a, CommConfig(n_channels=n)) for n in (1, 8, 16)]
    assert slow[0] < slow[1] < slow[2] and fast[0] > fast[1] >= fast[2]
    assert m.t_comm_us(a2a, CommConfig(n_channels=6)) == pytest.approx(m.t_comm_us(a2a, CommConfig(n_channels=8)))


def test_a_collective_on_the_same_cluster_keeps_its_own_channel_rule():
    # The H100 preset carries NCCL 2.30.7; the first half is about 2.27.5's P2P rule, so it names that version.
    h100 = dataclasses.replace(ClusterSpec.load("h100-sxm-ib400"), nccl_version="2.27.5")
    ag = site(nbytes=64 << 20)
    send = dataclasses.replace(
        site(site_id="pp.send_recv[0]", op="send", nbytes=16 << 20, group="pp", group_size=2, n_nodes=2)
    )
    m = CostModel.from_priors([ag, send], [10.0, 10.0], h100)
    nc = m.default_codes()[2]
    assert nc.tolist() == [32.0, 16.0]  # a 64 MiB all-gather: 32 (one per 128 KiB, capped); across nodes: 16
    ctas = m.prior_parts(
        np.array([0, 1]),
        np.array([0, 7]),
        np.array([2, 3]),
        np.array([6.0, 6.0]),
        np.array([512.0, 512.0]),
        np.zeros(2),
    )[2]
    # the all-gather runs the 6 channels it is given; the send on a 6-channel communicator: p2pnChannels 8,
    # 2 per network peer (NCCL 2.27.5's rule), one task
    assert ctas.tolist() == [6.0, 2.0]
    # NCCL 2.30: 4 per network peer (max(1 NIC, ceil(50 GB/s / 14)))
    m30 = CostModel.from_priors([ag, send], [10.0, 10.0], dataclasses.replace(h100, nccl_version="2.30.7"))
    assert float(m30.prior_parts(1, 7, 3, 6.0, 512.0, 0.0)[2]) == 4.0


def test_channels_per_network_peer_are_decided_once_for_the_process_where_the_model_gains():
    """A pipeline send across nodes overlapped with compute that it slows (compute-bound): fewer
    channels per network peer free SMs, so the plan sets NCCL_NCHANNELS_PER_NET_PEER below NCCL's 4;
    a send that only waits (communication-bound) never gets fewer (its time is the NIC's)."""
    from lagom_megatron.engine.problem import SearchProblem
    from lagom_megatron.megatron.pool.comm_pool import rules_for

    h200 = ClusterSpec.load("h200-sxm")
    send = site(site_id="pp.send_recv", op="send", nbytes=64 << 20, group="pp", group_size=2, n_nodes=2)
    rules = rules_for("nccl", h200, None)
    assert rules.scope("net_peer_channels") == "process"
    for comp, gains in ((100_000.0, True), (1.0, False)):
        model = CostModel.from_priors([send], [comp], h200, a=5.0)
        problem = SearchProblem.from_model(model, rules=rules)
        assert problem.domains_S[0]["net_peer_channels"] == (None, 1, 2, 4, 8, 16)
        plan = problem.make_plan(problem.default_state(), method="test", stats={})
        assert not model.p2p.net_peer_S.any()  # the decision leaves the model at NCCL's defaults
        e = plan.entries["pp.send_recv"]
        assert e.config == CommConfig() and "net_peer_channels" in e.tunable  # process scope: env only
        if not gains:
            assert int(plan.env.get("NCCL_NCHANNELS_PER_NET_PEER", 4)) >= 4
            continue
        # NCCL's own: max(1 NIC, ceil(50 GB/s / 14)) = 4 per network peer; the plan takes fewer
        value = int(plan.env["NCCL_NCHANNELS_PER_NET_PEER"])
        assert value < 4 and e.predicted_t_region_us < e.predicted_default_t_region_us
        model.p2p.net_peer_S[0] = float(value)  # the plan's prediction is the model's under that value
        assert e.predicted_t_region_us == pytest.approx(model.t_region_us(send, CommConfig()), abs=1e-3)


def test_the_network_peer_wants_a_channel_per_14_gb_of_all_its_nics():
    """NCCL 2.29+: ``max(netCount, divUp((int)netBw, P2P_PER_CHANNEL_NET_BW))`` where ``netBw`` is the
    sum over the NICs the GPU uses (``ncclTopoGetLocalNetCountByBw``, v2.30.7 ``src/graph/topo.cc:1974-2000``;
    ``paths.cc:941-950``): two 25 GB/s NICs per GPU want max(2, divUp(50, 14)) = 4, not 2; and the
    bandwidth is truncated to an integer first (28.5 GB/s: divUp(28, 14) = 2)."""
    kw = dict(p2p=16, n_nodes=2, group_size=2, intra_link="nvlink", sm_arch=90, nvlink_gbps=450.0, nccl=(2, 30, 7))
    assert float(p2p.peer_channels(nics_per_gpu=2, nic_gbps=25.0, **kw)) == 4.0
    assert float(p2p.peer_channels(nics_per_gpu=1, nic_gbps=28.5, **kw)) == 2.0


def test_nccl_2_27_compares_the_ranks_with_the_channels_before_rounding():
    """v2.27.5 ``paths.cc:818-830`` runs inside ``ncclTopoComputeP2pChannels`` while ``p2pnChannels`` is
    still ``min(nChannels, MAX_P2P)`` (``:844-848``), rounded only after (``:863-864``): a 6-channel
    communicator of 14 ranks halves its 2 per network peer (2 x 14 > 4 x 6), though 2 x 14 <= 4 x 8."""
    old = dict(n_nodes=2, group_size=14, intra_link="nvlink", sm_arch=90, nvlink_gbps=450.0, nccl=(2, 27, 5))
    assert float(p2p.peer_channels(p2p=8, comm_channels=6, **old)) == 1.0
    assert float(p2p.peer_channels(p2p=8, comm_channels=8, **old)) == 2.0


def test_hosts_of_one_nvlink_domain_are_one_nccl_node_for_point_to_point():
    """MNNVL: NCCL counts a node per NVLink domain (``comm->nNodes``, v2.30.7 ``src/init.cc:1285-1297``),
    and a peer in the domain is in the topology (NVLink), so a send between two hosts of one domain
    takes NVLink's channels per peer and the NVLink chunk (``src/init.cc:830-837``), not the network's."""
    h100 = ClusterSpec.load("h100-sxm-ib400")
    nvl = dataclasses.replace(h100, nvlink_domain_gpus=16, nccl_version="2.30.7")
    send = site(site_id="pp.send_recv[0]", op="send", nbytes=16 << 20, group="pp", group_size=2, n_nodes=2)
    m = CostModel.from_priors([send], [10.0], nvl)
    # p2pnChannels 16; NVLink per peer 2 x 21 -> 64, cut to 16; nChannelsMin 8 (8 x 2 <= 16); 16 MiB / 8 = 2 MiB
    assert float(m.p2p.ctas(0, 16.0)) == 8.0
    across = CostModel.from_priors([send], [10.0], dataclasses.replace(h100, nccl_version="2.30.7"))
    assert float(across.p2p.ctas(0, 16.0)) == 4.0  # two domains: 4 per network peer (50 GB/s NIC)
