"""The simulated NCCL and device against outside numbers: NCCL's logs and source rules for its
defaults per topology, Megatron's registered-buffer SM table, public slowdown figures, and the
ranged constants' own ranges (each test cites the number it checks)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.sim import channel_defaults as nccl
from lagom_megatron.sim.constants import CONSTANTS, get, overridden
from lagom_megatron.sim.device import (
    HBM_EFF,
    Collective,
    ComputeKernel,
    Gpu,
    busbw_gbs,
    comm_cost,
    compute_time_us,
    resolve_config,
)
from lagom_megatron.sim.program import gemm

MIB = 1 << 20


def _gpu(name: str) -> Gpu:
    return Gpu.from_cluster(ClusterSpec.load(name))


@pytest.mark.parametrize(
    "cluster, n_nodes, channels",
    [
        ("h100-sxm-ib400", 1, 32),
        ("a100-ib100", 1, 24),  # NCCL INFO: "32 coll channels" (DGX H100), "24" (DGX A100)
        ("h100-sxm-ib400", 2, 16),  # across 8-NIC nodes: about 16 SMs (nccl#689)
        ("a40-pcie-ib100", 2, 2),  # one NIC per PCIe node: "should just launch 2 SMs" (nccl#689)
        ("a40-pcie-ib200", 1, 4),  # 2 PCIe GPUs: "4 coll channels" (nccl#1706 log)
    ],
)
def test_nccl_default_channels_match_nccl_reports(cluster, n_nodes, channels):
    g = _gpu(cluster)
    c = Collective(op="all_gather", nbytes=256 * MIB, group_size=8 * n_nodes, n_nodes=n_nodes)
    assert resolve_config(g, c, CommConfig(algorithm="Ring")).n_channels == channels


@pytest.mark.parametrize("cluster", ["a40-pcie-ib200", "a40-pcie-ib100", "a40-nvlink-ib800"])
def test_cluster_files_state_the_channels_the_simulated_nccl_launches(cluster):
    # the cost model reads coll_channels / coll_channels_inter from the file (what NCCL logs);
    # the simulator derives them from NCCL's search: the two must agree
    spec, g = ClusterSpec.load(cluster), _gpu(cluster)
    one = nccl.collective_ctas(g, Collective(op="all_gather", nbytes=1 << 30, group_size=8), "Ring")[0]
    two = nccl.collective_ctas(g, Collective(op="all_gather", nbytes=1 << 30, group_size=16, n_nodes=2), "Ring")[0]
    assert (spec.coll_channels, spec.coll_channels_inter) == (one, two)


def test_pcie_runs_no_ll128_and_nvlink_does_for_mid_sizes():
    # tuning.cc:518-535: LL128 only where every intra-node hop is NVLink
    ag = Collective(op="all_gather", nbytes=8 * MIB, group_size=8)
    assert resolve_config(_gpu("h100-sxm-ib400"), ag, CommConfig()).protocol == "LL128"
    assert resolve_config(_gpu("a40-pcie-ib200"), ag, CommConfig()).protocol != "LL128"
    # a tuner's LL128 where NCCL disabled it is not run (its bandwidth is 0, tuning.cc:537)
    assert resolve_config(_gpu("a40-pcie-ib200"), ag, CommConfig(protocol="LL128")).protocol != "LL128"
    pair = replace(ag, group_size=2)
    assert resolve_config(_gpu("a40-nvlink-ib800"), pair, CommConfig(protocol="LL128")).protocol == "LL128"


def test_nvlink_bridges_double_a_pcie_ring():
    # a ring alternating bridge and PCIe hops uses each GPU's PCIe one way per direction: rings both
    # ways fit (nccl-tests#74: 4 bridged A40 of one socket beat the ~36.6 GB/s P2P figure of PCIe)
    c = Collective(op="all_reduce", nbytes=1 << 30, group_size=8)
    pcie, bridged = busbw_gbs(_gpu("a40-pcie-ib200"), c), busbw_gbs(_gpu("a40-nvlink-ib800"), c)
    assert bridged == pytest.approx(2 * pcie, rel=0.05)
    assert 18.0 <= pcie <= 22.0  # NCCL runs a Gen4 x16 ring at 20 GB/s (search.cc:1051), range of pcie_link_eff


def test_registered_buffers_run_the_symmetric_kernel_nccls_picker_takes():
    # NCCL v2.30.7 src/sym_kernels.cc, sm90, 8 ranks, 256 MiB gathered (32 MiB per rank), NVLS multimem:
    # model(): bw = softmin(blocks x 44 GBps x mult, 320 GBps, 44 GBps), t = 7.8 + softplus(busBytes / bw - 1)
    # with GBps = 2^30 / 1e6 bytes per us and busBytes = 7 x 32 MiB.
    #   AllGather_STMC: mult 0.55 x 8 = 4.4, at most divUp(16, 8) = 2 blocks: softmin(387.2, 320, 44) = 311.35 GBps,
    #     t = 7.8 + 234881024 / (311.35 x 1073.74) - 1 + ... = 709.4 us on 2 blocks
    #   AllGather_ST: 64 blocks 691 us; the fewest within 2.5% (<= 708.6) is 9 blocks, 707.1 us
    #   picker (2.5% per SM): STMC 709.4 x 1.05 = 744.9 < ST 707.1 x 1.225 = 866.2; LL kernels move 9x the bytes
    g = _gpu("h100-sxm-ib400")
    ag = Collective(op="all_gather", nbytes=256 * MIB, group_size=8, registered=True)
    r = resolve_config(g, ag, CommConfig())
    assert (r.algorithm, r.n_channels, r.path.kernel) == ("SYMK", 2, "AllGather_STMC")
    assert r.path.time_us == pytest.approx(709.4, abs=0.2)
    rs = resolve_config(g, replace(ag, op="reduce_scatter"), CommConfig())  # LDMC: the same bus bytes and blocks
    assert (rs.n_channels, rs.path.kernel) == (2, "ReduceScatter_LDMC")
    # a plan's channels do not reach it (symmetric kernels ask no tuner); no symmetric kernels on PCIe
    assert resolve_config(g, ag, CommConfig(n_channels=8)).algorithm != "SYMK"
    assert resolve_config(_gpu("a40-pcie-ib200"), ag, CommConfig()).algorithm == "Ring"


def test_cta_policy_zero_runs_an_all_gather_on_copy_engines_at_nccls_estimate():
    # NVIDIA/nccl src/tuning/ce_model.cc @8898068, sm90, outside graphs, in place, 8 ranks, 32 MiB per rank:
    # unicast 17.50 + 1.957 x 8 = 33.16 us + 7 x 33554432 B / 392 GB/s = 599.2 us -> 632.4 us;
    # multicast 14.90 + 0.726 x 8 = 20.71 us + 8 x 33554432 / 392 = 684.8 us -> 705.5 us: unicast is taken
    g = _gpu("h100-sxm-ib400")
    ag = Collective(op="all_gather", nbytes=256 * MIB, group_size=8, registered=True)
    r = resolve_config(g, ag, CommConfig(cta_policy="ZERO"))
    assert (r.algorithm, r.n_channels, r.path.kernel) == ("CE", 0, "CE_AllGather")
    assert r.path.time_us == pytest.approx(632.4, abs=0.1)
    # none without registration, for a reduce-scatter, on PCIe, or before NCCL 2.28: NCCL's SM kernels run
    assert resolve_config(g, replace(ag, registered=False), CommConfig(cta_policy="ZERO")).algorithm != "CE"
    assert resolve_config(g, replace(ag, op="reduce_scatter"), CommConfig(cta_policy="ZERO")).algorithm != "CE"
    assert resolve_config(_gpu("a40-pcie-ib200"), ag, CommConfig(cta_policy="ZERO")).algorithm != "CE"
    old = Gpu.from_cluster(replace(ClusterSpec.load("h100-sxm-ib400"), nccl_version="2.27.5"))
    assert resolve_config(old, ag, CommConfig(cta_policy="ZERO")).algorithm != "CE"


def test_cta_policy_efficiency_changes_only_registered_nvls_gathers():
    # NCCL 2.30.7 src/enqueue.cc:2152-2170: EFFICIENCY acts only on registered all-gather /
    # reduce-scatter buffers where NVLS is available; Megatron's buffers are not registered.
    g = _gpu("h100-sxm-ib400")
    ag = Collective(op="all_gather", nbytes=256 * MIB, group_size=8)
    eff = CommConfig(cta_policy="EFFICIENCY")
    assert resolve_config(g, ag, eff) == resolve_config(g, ag, CommConfig())
    assert resolve_config(g, replace(ag, registered=True), eff).algorithm == "NVLS"
    a100 = _gpu("a100-ib100")
    assert resolve_config(a100, replace(ag, registered=True), eff) == resolve_config(a100, ag, CommConfig())


def test_persistent_gemm_takes_twice_as_long_when_nccl_holds_ten_percent_of_the_sms():
    # pytorch#143988 (H100, FSDP): persistent cuBLAS matmuls 2x with NCCL on ~10% of the SMs
    g = _gpu("h100-sxm-ib400")
    k = ComputeKernel("persistent", "gemm", 2.0 * 8192**3, 1e6, persistent=True)
    assert compute_time_us(g, k, sms_free=g.sms - 13) / compute_time_us(g, k) == pytest.approx(2.0, rel=0.03)


def _steady_slowdown(g: Gpu, k: ComputeKernel, c: Collective) -> float:
    """Slowdown of ``k`` beside ``c`` at NCCL's defaults, by the timeline's sharing rule."""
    cost = comm_cost(g, c, resolve_config(g, c, CommConfig()))
    hbm = g.hbm_gbs * HBM_EFF
    t_alone = compute_time_us(g, k, sms_free=g.sms - cost.ctas)
    d_c = k.hbm_bytes / (t_alone * 1e3)
    comm = cost.bw_gbs * cost.hbm_mult
    f = min(1.0, hbm / (d_c + comm))
    t = compute_time_us(
        g, k, sms_free=g.sms - cost.ctas, hbm_gbs=d_c * f if f < 1.0 else None, comm_hbm_share=comm * f / hbm
    )
    return t / compute_time_us(g, k)


@pytest.mark.parametrize("end", ["low", "value", "high"])
def test_memory_bound_kernel_slowdown_is_in_the_public_range_across_kappa_mem(end):
    # nccl#1428 (A100, GPT training, all-gather overlapped): element-wise 2.5x, attention 1.83x:
    # every value of kappa_mem's range keeps memory-bound kernels inside 1.8-2.5x
    with overridden({"kappa_mem": getattr(CONSTANTS["kappa_mem"], end)}):
        g = _gpu("a100-ib100")
        ag = Collective(op="all_gather", nbytes=256 * MIB, group_size=8, n_nodes=1)
        ew = ComputeKernel("elementwise", "elementwise", 2 * 2**30 / 4, 2 * 2**30)
        assert 1.75 <= _steady_slowdown(g, ew, ag) <= 2.55


@pytest.mark.parametrize("end", ["low", "value", "high"])
def test_gemm_slowdown_stays_below_the_public_maximum_across_kappa_compute(end):
    # a large GEMM is compute bound and slows less than memory-bound kernels: nccl#1428 1.76x, ISPASS'25
    # 19% mean / 40% max; every value of kappa_compute's range keeps it within 1.1-1.8x
    with overridden({"kappa_compute": getattr(CONSTANTS["kappa_compute"], end)}):
        g = _gpu("a100-ib100")
        ag = Collective(op="all_gather", nbytes=256 * MIB, group_size=8, n_nodes=1)
        assert 1.1 <= _steady_slowdown(g, gemm("gemm", 8192, 8192, 8192), ag) <= 1.8


def test_every_ranged_constant_has_a_range_around_its_value_and_a_stated_source():
    for c in CONSTANTS.values():
        assert c.low <= c.value <= c.high and c.low < c.high, c.name
        assert len(c.source) > 40, c.name
    with pytest.raises(ValueError, match="outside its range"):
        with overridden({"sat_p": 100.0}):
            pass
    with pytest.raises(KeyError, match="unknown simulator constant"):
        get("no_such_constant")
    with overridden({"sat_p": 3.0}):
        assert get("sat_p") == 3.0
    assert get("sat_p") == CONSTANTS["sat_p"].value
