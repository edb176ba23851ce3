"""The bandwidth fit of ``lagom calibrate bandwidth`` (``sim/calibrate.py``): on runs in
nccl-tests' format made from a shape chosen here (not the simulator's constants) it recovers that
shape, says what a sweep cannot show, maps the result to cluster keys in one place, and the
simulator given the calibrated cluster reproduces the measured bus bandwidth."""

from __future__ import annotations

import random
import re

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.nccl.perf_table import read_perf_run
from lagom_megatron.sim.calibrate import (
    calibrated_cluster,
    fit_bandwidth,
    fit_to_cluster_fields,
    run_bandwidth,
    summary_lines,
)
from lagom_megatron.sim.device import SAT_P, THREAD_EXPONENT, Collective, Gpu, busbw_gbs
from tests.nccl.perf_text import Truth, run_text, sizes

A40 = ClusterSpec.load("a40-pcie-ib100")  # nvlink_gbps_per_gpu 24 (PCIe), net 1.5625 per GPU


def sweep(
    tmp_path,
    truth,
    *,
    ops=("all_gather", "all_reduce", "sendrecv"),
    channels=(1, 2, 4, 8, 16),
    threads=(128, 256, 512),
    protocols=("LL", "LL128", "Simple"),
    noise=0.0,
    nodes=1,
    link=1.0,
):
    """Reads back one file per run made from ``truth`` (its ceilings scaled by ``link``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rng, runs = random.Random(7), []
    for op in ops:
        p2p = op in ("alltoall", "sendrecv")
        for proto in ("Simple",) if p2p else protocols:
            kind = "P2P" if p2p else proto
            for ch in channels:
                for th in (640,) if p2p or proto == "LL128" else threads:
                    ran = 1 << (ch - 1).bit_length() if p2p else ch
                    scaled = Truth(
                        per_channel=truth.per_channel,
                        ceiling={k: v * link for k, v in truth.ceiling.items()},
                        p=truth.p,
                        e=truth.e,
                        latency_us=truth.latency_us,
                    )
                    bw = scaled.busbw(kind, ran, th) * (1.0 + noise * rng.gauss(0.0, 1.0))
                    line = (
                        f"# lagom-sweep op={op} algorithm={'P2P' if p2p else 'Ring'} protocol={proto} channels={ch} "
                        f"threads={th} nodes={nodes}"
                    )
                    path = tmp_path / f"{op}.{kind}.c{ch}.t{th}.txt"
                    path.write_text(
                        run_text(
                            op=op,
                            sizes=sizes(),
                            busbw=bw,
                            ranks=8 * nodes,
                            latency_us=truth.latency_us,
                            hosts=[f"n{i}" for i in range(nodes)],
                            sweep_line=line,
                        )
                    )
                    runs.append(read_perf_run(path))
    return runs


def curve(fit, scope, kind):
    return next(c for c in fit.curves if (c.scope, c.kind) == (scope, kind))


TRUTH = Truth(
    per_channel={"LL": 2.2, "LL128": 3.7, "Simple": 6.3, "P2P": 7.1},
    ceiling={"LL": 9.5, "LL128": 17.0, "Simple": 19.4, "P2P": 20.6},
    p=2.6,
    e=0.45,
    latency_us=15.0,
)


def test_the_fit_recovers_the_shape_the_runs_were_made_with(tmp_path):
    runs = sweep(tmp_path, TRUTH)
    fit = fit_bandwidth(runs, A40)
    for kind in ("LL", "LL128", "Simple", "P2P"):
        c = curve(fit, "intra", kind)
        assert c.per_channel_gbs == pytest.approx(TRUTH.per_channel[kind], rel=0.01), kind
        assert c.link_eff * 24.0 == pytest.approx(TRUTH.ceiling[kind], rel=0.01), kind
        assert c.mape_pct < 0.5
    assert fit.saturation_p == pytest.approx(TRUTH.p, rel=0.03)
    assert fit.thread_exponent == pytest.approx(TRUTH.e, abs=0.01)
    one = run_bandwidth(runs[0])  # all_gather LL, 1 channel, 128 threads
    assert one.latency_us == pytest.approx(TRUTH.latency_us, rel=0.02)
    assert one.bw_gbs == pytest.approx(TRUTH.busbw("LL", 1, 128), rel=0.005)


def test_noisy_runs_still_give_the_shape(tmp_path):
    fit = fit_bandwidth(sweep(tmp_path, TRUTH, noise=0.02, protocols=("Simple",)), A40)
    simple = curve(fit, "intra", "Simple")
    assert simple.per_channel_gbs == pytest.approx(6.3, rel=0.05)
    assert simple.link_eff * 24.0 == pytest.approx(19.4, rel=0.04)
    assert (
        1.8 < fit.saturation_p < 3.6 and 0.8 < simple.mape_pct < 2.5
    )  # 2% noise: ~1.6% mean error, less what the fit absorbs


def test_what_a_sweep_cannot_show_is_not_identified(tmp_path):
    sharp = Truth(per_channel=TRUTH.per_channel, ceiling=TRUTH.ceiling, p=8.0, e=TRUTH.e, latency_us=15.0)
    one_kind = dict(ops=("all_gather",), threads=(512,), protocols=("Simple",))
    low = fit_bandwidth(sweep(tmp_path / "low", sharp, channels=(1, 2), **one_kind), A40)  # 6.3, 12.6 of 19.4 GB/s
    simple = curve(low, "intra", "Simple")
    assert simple.link_eff is None and simple.per_channel_gbs == pytest.approx(6.3, rel=0.01)
    assert low.saturation_p is None and low.thread_exponent is None
    notes = " ".join(low.notes)
    assert "intra Simple: ceiling not identified: no run was limited by it (add runs with more channels)" in notes
    assert "saturation p not identified" in notes and f"one thread count; the fit used {THREAD_EXPONENT:g}" in notes
    assert fit_to_cluster_fields(low) == {"per_channel_gbps": {"Simple": pytest.approx(6.3, rel=0.01)}}
    high = fit_bandwidth(sweep(tmp_path / "high", sharp, channels=(16, 32, 64), **one_kind), A40)
    assert curve(high, "intra", "Simple").per_channel_gbs is None
    assert "every run was at the ceiling (add runs with fewer channels)" in " ".join(high.notes)
    assert fit_to_cluster_fields(high) == {"link_eff": {"Simple": pytest.approx(19.4 / 24, rel=0.01)}}
    single = fit_bandwidth(sweep(tmp_path / "single", sharp, channels=(4,), **one_kind), A40)
    assert fit_to_cluster_fields(single) == {}  # one run cannot tell per-channel bandwidth from the ceiling
    assert "cannot tell per-channel bandwidth from the ceiling" in " ".join(single.notes)


def test_runs_across_nodes_give_the_network_share(tmp_path):
    # 2 nodes x 8 ranks: the ceiling is the node's network, net_gbps_per_gpu x 8 = 12.5 GB/s
    fit = fit_bandwidth(
        sweep(tmp_path, TRUTH, ops=("all_reduce",), protocols=("Simple",), nodes=2, link=0.5, channels=(1, 2, 4, 8)),
        A40,
    )
    inter = curve(fit, "inter", "Simple")
    assert inter.link_name == "net_gbps_per_gpu x 8 ranks per node"
    assert inter.link_eff * 12.5 == pytest.approx(19.4 * 0.5, rel=0.01)
    assert fit_to_cluster_fields(fit)["net_eff"] == {"Simple": pytest.approx(9.7 / 12.5, rel=0.01)}


def test_the_one_mapping_and_the_merged_cluster(tmp_path):
    fit = fit_bandwidth(sweep(tmp_path, TRUTH, ops=("all_gather", "sendrecv"), protocols=("LL", "Simple")), A40)
    fields = fit_to_cluster_fields(fit)
    assert set(fields) == {"per_channel_gbps", "link_eff", "bw_saturation_p", "channel_thread_exponent"}
    assert set(fields["per_channel_gbps"]) == {"LL", "Simple"}  # P2P maps to no key
    base = {k: v for k, v in A40.to_dict().items() if v is not None} | {"per_channel_gbps": {"LL128": 3.3}}
    doc = calibrated_cluster(base, fit, name="lab-a40", source="lab.yaml")
    assert doc["name"] == "lab-a40" and doc["per_channel_gbps"]["LL128"] == 3.3  # an unfitted protocol is kept
    assert doc["per_channel_gbps"]["Simple"] == pytest.approx(6.3, rel=0.01)
    lines = summary_lines(fit)
    p2p = re.compile(
        r"intra P2P: 7\.(09|1|11) GB/s per channel; ceiling 0\.85[78] x nvlink_gbps_per_gpu = 20\.6 GB/s; 5 runs"
    )
    assert any(p2p.match(line) for line in lines), lines


def test_the_simulator_given_the_calibrated_cluster_reproduces_the_runs(tmp_path):
    fit = fit_bandwidth(sweep(tmp_path, TRUTH, ops=("all_gather",), protocols=("Simple",)), A40)
    base = {k: v for k, v in A40.to_dict().items() if v is not None}
    spec = ClusterSpec.from_dict(calibrated_cluster(base, fit, name="lab", source="lab.yaml"))
    gpu, stock = Gpu.from_cluster(spec), Gpu.from_cluster(A40)
    assert (gpu.sat_p, stock.sat_p) == (pytest.approx(TRUTH.p, rel=0.03), SAT_P)
    big = Collective(op="all_gather", nbytes=1 << 30, group_size=8)
    for ch, th in ((1, 512), (2, 128), (4, 256), (16, 512)):
        cfg = CommConfig(algorithm="Ring", protocol="Simple", n_channels=ch, n_threads=th)
        assert busbw_gbs(gpu, big, cfg) == pytest.approx(TRUTH.busbw("Simple", ch, th), rel=0.01), (ch, th)
    site = CollectiveSite(
        site_id="dp.ag[0]",
        op="all_gather",
        nbytes=1 << 26,
        dtype="bf16",
        group="dp",
        group_size=8,
        n_nodes=1,
        calls_per_iter=1,
    )
    assert CostModel.from_priors([site], [100.0], spec).pcb == spec.per_channel_gbps["Simple"]
    # the per-arch prior without a measurement: NCCL's Ampere graph asks 40 / 2 (search.cc:1045) / 2 CTAs of a CTA
    assert CostModel.from_priors([site], [100.0], A40).pcb == 40.0 / 2 / 2


def test_no_usable_row_is_refused(tmp_path):
    path = tmp_path / "zero.txt"
    text = run_text(
        op="all_gather",
        sizes=[0],
        busbw=1.0,
        ranks=8,
        hosts=["n"],
        latency_us=5,
        sweep_line="# lagom-sweep op=all_gather algorithm=Ring protocol=Simple channels=2 threads=512 nodes=1",
    )
    path.write_text(text.replace("0.00       0", "0.00       0"))
    run = read_perf_run(path)
    assert run.rows == () and run_bandwidth(run) is None
    with pytest.raises(ValueError, match=r"no usable row in 1 file\(s\) \(.*zero.txt\): every row has size 0"):
        fit_bandwidth([run], A40)
