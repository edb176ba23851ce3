"""Registered buffers as a knob: NCCL's own kernel picker and copy-engine model, worked by hand, and the per-group
choice the search makes with them."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.registered import copy_engine_all_gather, symmetric_kernel
from lagom_megatron.engine.search import search

from .factory import build, site

MIB = 2**20


def test_the_picker_trades_time_for_sms_as_sym_kernels_cc_does():
    # NCCL v2.30.7 src/sym_kernels.cc, sm90, 8 ranks, an 8 KiB share per rank (64 KiB gathered):
    # LL kernels move 8 x 8192 x 9 = 589,824 bus bytes; at 64 blocks bw = 320 GBps (GBps = 2^30 / 1e6 B/us), so
    #   AllGather_LL:   t(64) = 4.5 + softplus(589824 / 343597 - 1) = 5.62; the fewest blocks within 2.5% is 8
    #                   (softmin(352, 320, 44) = 302.7 GBps): 5.68 us
    #   AllGather_LLMC: x1.1 per block: 7 blocks (softmin(338.8, 320, 44) = 297.9 GBps): 5.70 us
    #   AllGather_STMC: 7 x 8192 bus bytes on 2 blocks: 7.8 + softplus(0.17 - 1) = 8.16 us
    # picker, 2.5% per SM: LLMC 5.70 x 1.175 = 6.70 < LL 5.68 x 1.2 = 6.82 < STMC 8.16 x 1.05 = 8.57
    p = symmetric_kernel("all_gather", n_ranks=8, nbytes=8 * 8192, sm_arch=90, multicast=True)
    assert (p.kernel, p.ctas) == ("AllGather_LLMC", 7) and p.time_us == pytest.approx(5.70, abs=0.01)
    # without multimem (no NVLS): plain LL on 8 blocks
    p = symmetric_kernel("all_gather", n_ranks=8, nbytes=8 * 8192, sm_arch=90, multicast=False)
    assert (p.kernel, p.ctas) == ("AllGather_LL", 8) and p.time_us == pytest.approx(5.68, abs=0.01)
    # all-reduce 64 MiB: RSxLDMC_AGxSTMC, bus bytes 64 MiB x (1 + 1/8), 2 blocks x 65 GBps x 8 ranks against the
    # 480 GBps peak: 7.8 + 75497472 / (479.99 x 1073.74) - 1 = 153.3 us
    p = symmetric_kernel("all_reduce", n_ranks=8, nbytes=64 * MIB, sm_arch=90, multicast=True)
    assert (p.kernel, p.ctas) == ("AllReduce_RSxLDMC_AGxSTMC", 2) and p.time_us == pytest.approx(153.3, abs=0.1)
    assert symmetric_kernel("all_to_all", n_ranks=8, nbytes=64 * MIB, sm_arch=90, multicast=True) is None


def test_copy_engines_take_nccls_floor_and_rate():
    # ce_model.cc @8898068, sm90: multicast 14.90 + 0.726 x 8 = 20.708 us + 8 x 8192 B / 392 GB/s = 0.167 us;
    # unicast 17.50 + 1.957 x 8 = 33.156 + 7 x 8192 / 392 = 0.146: small messages go multicast
    p = copy_engine_all_gather(n_ranks=8, nbytes=8 * 8192, sm_arch=90, multicast=True)
    assert (p.kernel, p.ctas) == ("CE_AllGather_MC", 0) and p.time_us == pytest.approx(20.875, abs=0.001)
    assert copy_engine_all_gather(n_ranks=8, nbytes=8 * 8192, sm_arch=90, multicast=False).time_us == pytest.approx(
        33.302, abs=0.001
    )


def _dp_sites():
    return [
        site(site_id="dp.param_all_gather[0]", op="all_gather", nbytes=256 * MIB, group="dp"),
        site(site_id="dp.grad_reduce_scatter[0]", op="reduce_scatter", nbytes=256 * MIB, group="dp"),
        site(site_id="tp.ag[0]", op="all_gather", nbytes=16 * MIB, group="tp"),
    ]


def test_a_group_whose_registration_pays_is_registered_from_the_next_launch():
    # compute-heavy overlap with a strong SM slowdown: 24-32 CTA rings cost more than 2 symmetric CTAs or none
    problem = build(sites=_dp_sites(), comp_ratio=[3.0, 3.0, 3.0], a=2.0)
    plan = search(problem, method="priority").plan
    assert plan.registered_groups == ("dp",)  # tp's buffers are activations: Megatron registers none
    ag, rs = plan.entries["dp.param_all_gather[0]"], plan.entries["dp.grad_reduce_scatter[0]"]
    assert ag.config == CommConfig(cta_policy="ZERO") and "copy engines" in ag.note
    assert rs.config == CommConfig() and "ReduceScatter_LDMC" in rs.note  # NCCL's own choice on the window
    assert plan.stats["registration_gain_us"]["dp"] > 0
    # this launch has no registered buffers: dp's sites run on NCCL's defaults, tp's tuning stays
    now = plan.for_launch(())
    assert now.entries["dp.param_all_gather[0]"].config.is_default()
    assert now.entries["tp.ag[0]"].config == plan.entries["tp.ag[0]"].config
    assert plan.for_launch(("dp",)) is plan
    # its verdict waits for the launch that registers them, which verifies the whole plan
    pending = plan.verdict("applied", "1.02x", registered_now=())
    assert pending.stats["verification"] is None and pending.stats["verification_unregistered"] == "applied"
    assert plan.verdict("applied", "1.02x", registered_now=("dp",)).stats["verification"] == "applied"


def test_no_registration_where_nccl_offers_nothing_for_it():
    problem = build(sites=_dp_sites(), comp_ratio=[3.0, 3.0, 3.0], a=2.0, cluster="a40-pcie-ib200")
    assert search(problem, method="priority").plan.registered_groups == ()
