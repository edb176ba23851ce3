"""Calibration of the device model's newer terms: NCCL's default channels per topology, wave
quantization, persistent kernels, memory-bound contention, soft bandwidth saturation (each test
cites the measurement or NCCL source line it checks)."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.sim.device import (
    HBM_EFF, KAPPA_COMM, Collective, ComputeKernel, Gpu, comm_cost, compute_time_us, resolve_config, softmin,
)
from lagom_megatron.sim.program import gemm

MIB = 1 << 20


def _gpu(name: str) -> Gpu:
    return Gpu.from_cluster(ClusterSpec.load(name))


@pytest.mark.parametrize("cluster, n_nodes, channels", [
    # NVSwitch: NCCL INFO logs "32 coll channels" (DGX H100), "24 coll channels" (DGX A100)
    ("h100-sxm-ib400", 1, 32), ("a100-ib100", 1, 24),
    # across NVSwitch nodes with one NIC per GPU: about 16 (nccl#689)
    ("h100-sxm-ib400", 2, 16),
    # PCIe: one ring below 25 GB/s is not duplicated (search.cc:1039), then doubled
    # (connect.cc:460): 2 channels (nccl#689 "should just launch 2 SMs"), in a node and across nodes
    ("a40-pcie-ib200", 1, 2), ("a40-pcie-ib200", 2, 2), ("a40-pcie-ib100", 2, 2),
])
def test_nccl_default_channels_follow_the_topology(cluster, n_nodes, channels):
    g = _gpu(cluster)
    c = Collective(op="all_gather", nbytes=256 * MIB, group_size=8 * n_nodes, n_nodes=n_nodes)
    assert resolve_config(g, c, CommConfig(algorithm="Ring")).n_channels == channels


def test_gemm_of_exactly_one_wave_slows_by_a_whole_wave_when_one_sm_is_taken():
    g = _gpu("h100-sxm-ib400")
    k = ComputeKernel("one_wave", "gemm", 2.0 * 4096 ** 3, 1e6, tiles=g.sms)
    alone = compute_time_us(g, k)
    assert compute_time_us(g, k, sms_free=g.sms - 1) == pytest.approx(2.0 * alone, rel=0.02)
    # many waves: close to the linear share (the transformer GEMMs)
    big = gemm("big", 16384, 16384, 8192)
    assert big.tiles > 50 * g.sms
    ratio = compute_time_us(g, big, sms_free=g.sms - 8) / compute_time_us(g, big)
    assert ratio == pytest.approx(g.sms / (g.sms - 8), rel=0.02)


def test_persistent_gemm_takes_twice_as_long_when_nccl_holds_ten_percent_of_the_sms():
    # pytorch#143988 (H100, FSDP): persistent cuBLAS matmuls 2x with NCCL on ~10% of the SMs
    g = _gpu("h100-sxm-ib400")
    k = ComputeKernel("persistent", "gemm", 2.0 * 8192 ** 3, 1e6, persistent=True)
    ratio = compute_time_us(g, k, sms_free=g.sms - 13) / compute_time_us(g, k)
    assert ratio == pytest.approx(2.0, rel=0.03)


def _steady_slowdown(g: Gpu, k: ComputeKernel, c: Collective) -> float:
    """Slowdown of ``k`` beside ``c`` at NCCL's defaults, by the timeline's sharing rule."""
    cost = comm_cost(g, c, resolve_config(g, c, CommConfig()))
    hbm = g.hbm_gbs * HBM_EFF
    t_alone = compute_time_us(g, k, sms_free=g.sms - cost.ctas)
    d_c = k.hbm_bytes / (t_alone * 1e3)
    comm = cost.bw_gbs * cost.hbm_mult
    f = min(1.0, hbm / (d_c + comm))
    t = compute_time_us(g, k, sms_free=g.sms - cost.ctas, hbm_gbs=d_c * f if f < 1.0 else None,
                        comm_hbm_share=comm * f / hbm)
    assert KAPPA_COMM >= 0
    return t / compute_time_us(g, k)


def test_memory_bound_kernel_slowdown_is_in_the_public_range():
    # nccl#1428 (A100, GPT training, all-gather overlapped): element-wise 2.5x, attention 1.83x;
    # the public range for memory-bound kernels is 1.8-2.5x.
    g = _gpu("a100-ib100")
    ag = Collective(op="all_gather", nbytes=256 * MIB, group_size=8, n_nodes=1)
    ew = ComputeKernel("elementwise", "elementwise", 2 * 2 ** 30 / 4, 2 * 2 ** 30)
    assert 1.8 <= _steady_slowdown(g, ew, ag) <= 2.5
    # a large GEMM is compute bound and slows less (nccl#1428: 1.76x; ISPASS'25: 19% mean, 40% max)
    gm = gemm("gemm", 8192, 8192, 8192)
    assert 1.1 <= _steady_slowdown(g, gm, ag) <= 1.8


def test_bandwidth_saturates_softly():
    # shape assumption (SAT_P): within 0.1% of the link far beyond it, below the link at the knee
    assert softmin(2 * 100.0, 100.0) == pytest.approx(100.0, rel=0.003)
    assert 0.9 * 100.0 < softmin(100.0, 100.0) < 100.0
