"""Calibration of the simulator's device model against public figures (each test cites its source).

Every number here comes out of the simulator's own mechanisms (device costs and the timeline's
sharing rule), run on the cluster files in configs/clusters/.
"""

from __future__ import annotations

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.sim import timeline
from lagom_megatron.sim.device import Collective, ComputeKernel, Gpu, busbw_gbs, comm_cost, resolve_config
from lagom_megatron.sim.program import Call, Program

GIB = 1 << 30


def _gpu(name: str) -> Gpu:
    return Gpu.from_cluster(ClusterSpec.load(name))


# Source: nccl-tests issue 212 (NVIDIA maintainer): on 8 H100 "NCCL can get an effective NVLink
# bandwidth of 370GB/s ... with NCCL_ALGO=RING" and NVLink SHARP all-reduce "should reach a peak
# busBw of ~480GB/s"; nccl-tests issue 290: 476 GB/s single-node H100 "in the expected range".
def test_allreduce_busbw_8xh100_nvlink():
    g = _gpu("h100-sxm-ib400")
    c = Collective(op="all_reduce", nbytes=8 * GIB, group_size=8, n_nodes=1)
    assert 440 <= busbw_gbs(g, c) <= 490, busbw_gbs(g, c)  # NCCL's default (NVLS) on sm90 NVSwitch
    ring = busbw_gbs(g, c, CommConfig(algorithm="Ring"))
    assert 340 <= ring <= 390, ring


# Source: nccl-tests issue 290 (NVIDIA): "For NDR @ 400Gbps you should see 46-48GB/s per NIC".
# One rank per node uses its own NIC; a group of whole nodes runs one ring per NIC (8 NICs) and is
# then capped by NVLink's ~370 GB/s (nccl-tests issue 212).
@pytest.mark.parametrize("group_size, n_nodes, lo, hi", [(8, 8, 40, 48), (16, 2, 300, 380), (64, 8, 300, 380)])
def test_allreduce_busbw_across_400g_ib_nodes(group_size, n_nodes, lo, hi):
    g = _gpu("h100-sxm-ib400")
    c = Collective(op="all_reduce", nbytes=8 * GIB, group_size=group_size, n_nodes=n_nodes)
    bw = busbw_gbs(g, c)
    assert lo <= bw <= hi, f"got {bw:.0f} GB/s but should be in [{lo}, {hi}]"


# Source: nccl-tests issues 149 and 178: 8 A100 SXM over NVLink reach ~200-208 GB/s all-reduce
# busbw; NVIDIA quotes up to ~230 GB/s. 100 Gb/s NICs give at most 12.5 GB/s per NIC.
def test_allreduce_busbw_a100_and_100g():
    g = _gpu("a100-ib100")
    intra = busbw_gbs(g, Collective(op="all_reduce", nbytes=8 * GIB, group_size=8))
    assert 190 <= intra <= 240, intra
    inter = busbw_gbs(g, Collective(op="all_reduce", nbytes=8 * GIB, group_size=8, n_nodes=8))
    assert 10 <= inter <= 12.5, inter


def _overlap(g: Gpu, gemm: ComputeKernel, coll: Collective, cfg: CommConfig) -> tuple[float, float, float, float]:
    """(gemm alone, gemm overlapped, collective alone, collective overlapped), microseconds."""
    cost = comm_cost(g, coll, resolve_config(g, coll, cfg))
    prog = Program()
    prog.kernel(gemm, 0)
    alone = timeline.run(prog, g, [], sigma_comp=0.0, sigma_comm=0.0).total_us
    prog = Program()
    i = prog.launch(Call("x", coll, "tp"))
    prog.kernel(gemm, 0)
    prog.wait(i)
    res = timeline.run(prog, g, [cost], sigma_comp=0.0, sigma_comm=0.0)
    comm_alone_prog = Program()
    comm_alone_prog.wait(comm_alone_prog.launch(Call("x", coll, "tp")))
    comm_alone = timeline.run(comm_alone_prog, g, [cost], sigma_comp=0.0, sigma_comm=0.0).calls[0].t_comm_us
    return alone, res.calls[0].window_busy_us, comm_alone, res.calls[0].t_comm_us


GEMM = ComputeKernel("gemm", "gemm", 2.0 * 8192 * 8192 * 8192, 2.0 * 3 * 8192 * 8192)
AG = Collective(op="all_gather", nbytes=2 * GIB, group_size=8)


# Source: NVIDIA/nccl issue 1428 (A100, GPT training): GEMM 1.18 -> 2.08 ms (1.76x) when overlapped
# with an NCCL all-gather; pytorch/pytorch issue 179937: overlapped matmuls "30-40% slower"
# (research notes, lagom_autoccl.md section 4). Default NCCL config, whole GEMM under the collective.
@pytest.mark.parametrize("cluster", ["h100-sxm-ib400", "a100-ib100"])
def test_gemm_slowed_by_overlapped_all_gather(cluster):
    g = _gpu(cluster)
    alone, overlapped, _, _ = _overlap(g, GEMM, AG, CommConfig())
    assert 1.3 <= overlapped / alone <= 1.8, f"slowdown x{overlapped / alone:.2f}"


# Source: the same issues and Lagom's introduction (channel count is among the knobs with the
# largest effect on compute): fewer channels make the collective slower and the overlapped GEMM faster.
@pytest.mark.parametrize("cluster", ["h100-sxm-ib400", "a100-ib100"])
def test_fewer_channels_slower_collective_faster_gemm(cluster):
    g = _gpu(cluster)
    runs = [_overlap(g, GEMM, AG, CommConfig(n_channels=n)) for n in (24, 8, 2)]
    gemm = [r[1] for r in runs]
    comm = [r[3] for r in runs]
    assert gemm[0] > gemm[1] > gemm[2], gemm
    assert comm[0] < comm[1] < comm[2], comm
    # and the collective itself is slowed by the GEMM beside it (nccl#1433: "both get slower")
    for _, _, comm_alone, comm_overlapped in runs:
        assert comm_overlapped > comm_alone


def test_cta_policy_efficiency_changes_only_registered_nvls_gathers():
    # NCCL 2.30.7 src/enqueue.cc:2152-2170: EFFICIENCY acts only on registered all-gather /
    # reduce-scatter buffers where NVLS is available; Megatron's buffers are not registered.
    from dataclasses import replace

    g = _gpu("h100-sxm-ib400")
    eff = CommConfig(cta_policy="EFFICIENCY")
    assert resolve_config(g, AG, eff) == resolve_config(g, AG, CommConfig())
    reg = replace(AG, registered=True)
    r = resolve_config(g, reg, eff)
    assert (r.algorithm, r.protocol, r.n_channels) == ("NVLS", "Simple", 16)
    assert resolve_config(_gpu("a100-ib100"), reg, eff) == resolve_config(_gpu("a100-ib100"), reg, CommConfig())
    ar = Collective(op="all_reduce", nbytes=256 << 20, group_size=8, n_nodes=1, registered=True)
    assert resolve_config(g, ar, eff) == resolve_config(g, ar, CommConfig())


# Source: NVIDIA/Megatron-LM README (performance section): Megatron-Core trains GPT models "with up
# to 47% Model FLOP Utilization (MFU) on H100 clusters" (GPT-3 175B, weak scaling to 6144 GPUs).
def test_gpt3_175b_model_flop_utilization_on_h100():
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.sim.backend import SimulatedCluster

    preset = load_preset("gpt3-175b-h100x512")
    sim = SimulatedCluster(preset, seed=0)
    m, w, t = preset.model_spec(), sim.workload, preset.training
    tokens = t.global_batch_size * t.seq_length
    per_layer = m.hidden_size * (w.q_dim + 2 * w.kv_dim) + w.q_dim * m.hidden_size + 2 * m.hidden_size * w.ffn
    params = m.num_layers * per_layer + 2 * w.vocab * m.hidden_size
    # 6 FLOPs per parameter and token, plus causal attention (PaLM appendix B, halved for causality)
    flops = 6 * params * tokens + 6 * m.num_layers * tokens * t.seq_length * w.q_dim
    us = sim.run_iteration(iteration=1).iteration_us
    mfu = flops / (us * 1e-6 * preset.world_size * sim.gpu.peak_tflops * 1e12)
    assert 0.40 <= mfu <= 0.50, f"MFU {mfu:.1%}"


def test_the_per_cta_rate_is_what_nccls_ring_graph_asks_on_dgx_a100_and_dgx_h100():
    # NVIDIA/nccl v2.30.7-1, worked by hand:
    # DGX H100: 18 NVLinks x 20.6 GB/s (src/graph/topo.h:23) = 370.8 per GPU. The ring search starts at the first
    #   sm90 intra speed <= that, 60 (search.cc:1057): floor(370.8 / 60) = 6 channels, 360 GB/s. 6 x 60 >= 25 and
    #   not (sm > 80, < 50 GB/s, > 4 channels) (:1039-1040), so ncclTopoDupChannels doubles the channels and halves
    #   the speed (:1045-1047): 12 x 30. connect.cc:460 runs two CTAs per channel: 24 CTAs, each asked 30 / 2 = 15.
    # DGX A100: 12 NVLinks x 20 (topo.h:21) = 240: 6 x 40 (search.cc:1051), duplicated to 12 x 20, 24 CTAs at 10.
    # The exception at :1040: an sm90 graph of 6 channels at 40 GB/s stays as it is.
    from lagom_megatron.sim import tuning_model as nm
    from lagom_megatron.sim.constants import get

    assert nm.ring_graph(18 * 20.6, sm_arch=90, inter=False) == (12, 30.0)
    assert nm.ring_graph(12 * 20.0, sm_arch=80, inter=False) == (12, 20.0)
    assert nm.dup_channels(6, 40.0, sm_arch=90) == (6, 40.0)
    assert nm.comm_ctas(12) == 24
    assert get("cta_gbs_sm90") == 30.0 / 2 and get("cta_gbs_sm80") == 20.0 / 2
