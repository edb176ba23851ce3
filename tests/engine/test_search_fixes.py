"""The search and verification fixes: ties to fewer resources, the SM term's form, the static
fixes as candidates, paired verification."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lagom_megatron.engine.descent import Counter, scan_knob
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.priority import GROUP_CAPS, STATIC_CAPS, group_caps_state, static_states
from lagom_megatron.engine.search import search
from lagom_megatron.engine.verify import verdict
from tests.engine.factory import build, profile_from, site, synthetic


def test_ties_go_to_the_fewest_channels(monkeypatch):
    problem = build(sites=[site()], comp_ratio=1.0)
    st = problem.default_state()
    assert st.nc[0] > 2

    def flat(idx, alg, proto, nc, nt, lvl):  # every channel count predicts the same time
        shape = np.broadcast(idx, alg, proto, nc, nt, lvl).shape
        t = np.full(shape, 100.0)
        return t, np.zeros(shape), t

    monkeypatch.setattr(problem, "evaluate_codes", flat)
    assert scan_knob(problem, st, np.array([0]), "n_channels", "region", Counter()).tolist() == [0]
    assert st.nc[0] == 1.0
    # ...and threads the same way
    assert scan_knob(problem, st, np.array([0]), "n_threads", "region", Counter()).tolist() == [0]
    assert st.nt[0] == 64.0


def test_a_real_gain_beats_a_tie(monkeypatch):
    problem = build(sites=[site()], comp_ratio=1.0)
    st = problem.default_state()

    def prefers_16(idx, alg, proto, nc, nt, lvl):
        t = 100.0 + np.abs(np.asarray(nc, dtype=float) - 16.0)  # 1 us per channel away from 16
        t = np.broadcast_to(t, np.broadcast(idx, alg, proto, nc, nt, lvl).shape)
        return t, np.zeros_like(t), t

    monkeypatch.setattr(problem, "evaluate_codes", prefers_16)
    scan_knob(problem, st, np.array([0]), "n_channels", "region", Counter())
    assert st.nc[0] == 16.0


def test_sm_term_has_the_devices_form():
    # compute left SMs - c SMs runs SMs / (SMs - c) slower: s = c / (SMs - c) with a = 1, b = 0
    problem = build(sites=[site()], a=1.0, b=0.0)
    m = problem.model
    sms = m.cluster.sms_per_gpu
    for c in (1, 8, 32, 64):
        assert m.slowdown("tp.ag[0]", CommConfig(n_channels=c, protocol="Simple", algorithm="Ring")) == pytest.approx(
            c / (sms - c)
        )


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_never_predicted_worse_than_a_static_fix(seed):
    problem = synthetic(n_sites=30, seed=seed)
    plan_us = search(problem, method="priority").stats["predicted_iteration_us"]
    default_nc = problem.default_state().nc
    states = static_states(problem, default_nc)
    assert set(states) == {"nccl-default"} | {f"cap{c}" for c in STATIC_CAPS}
    for name, st in states.items():
        total = (
            problem.iteration_us
            - float(problem.evaluate(problem.default_state())[2].sum())
            + float(problem.evaluate(st)[2].sum())
        )
        assert plan_us <= total * (1 + 1e-9), (name, plan_us, total)


@pytest.mark.parametrize("seed", range(4))
def test_plan_is_never_predicted_worse_than_any_per_group_cap(seed):
    """One ``max_ctas`` per process group (Megatron's --nccl-communicator-config-path): every
    combination of caps over the synthetic problem's three groups is a static fix a user could
    deploy; the plan's predicted iteration is at or below the best of them all."""
    import itertools

    problem = synthetic(n_sites=30, seed=seed)
    plan_us = search(problem, method="priority").stats["predicted_iteration_us"]
    default = problem.default_state()
    base = problem.iteration_us - float(problem.evaluate(default)[2].sum())
    groups = sorted(set(problem.comm_S))
    tun = problem.tunable["n_channels"]
    best = np.inf
    for caps in itertools.product(GROUP_CAPS, repeat=len(groups)):
        st = default.copy()
        for g, cap in zip(groups, caps):
            idx = np.array([i for i, c in enumerate(problem.comm_S) if c == g and tun[i]])
            if idx.size:
                st.nc[idx] = np.minimum(default.nc[idx], float(cap))
        best = min(best, base + float(problem.evaluate(st)[2].sum()))
    assert plan_us <= best * (1 + 1e-9)
    # the candidate alone: coordinate descent over the groups lands on caps no worse than every single cap
    st = group_caps_state(problem, default.nc, Counter())
    caps_us = base + float(problem.evaluate(st)[2].sum())
    for cap in GROUP_CAPS:
        one = default.copy()
        one.nc[tun] = np.minimum(default.nc[tun], float(cap))
        assert caps_us <= base + float(problem.evaluate(one)[2].sum()) * (1 + 1e-9)


def _arms(rng, *, n, gain, white, drift):
    """Alternating defaults / plan iterations of 100,000 us with a slow random-walk drift."""
    base, level, d, p = 100_000.0, 0.0, [], []
    for _ in range(n):
        level += rng.gauss(0.0, drift)
        d.append(base * (1 + level) * (1 + rng.gauss(0.0, white)))
        level += rng.gauss(0.0, drift)
        p.append(base * (1 - gain) * (1 + level) * (1 + rng.gauss(0.0, white)))
    return p, d


def _share_kept(rule, **kw):
    rng = random.Random(1)
    kept = sum(verdict(*_arms(rng, **kw), min_gain=0.002, noise_rule=rule).keep for _ in range(300))
    return kept / 300


def test_paired_verification_keeps_a_one_percent_gain_under_drift():
    kw = dict(n=8, gain=0.01, white=0.003, drift=0.004)
    assert _share_kept("paired", **kw) >= 0.95
    assert _share_kept("half-range", **kw) <= 0.5  # the old rule: drift inflates the arm ranges


def test_paired_verification_rejects_noise():
    assert _share_kept("paired", n=8, gain=0.0, white=0.01, drift=0.0) <= 0.08
    assert _share_kept("paired", n=8, gain=0.0, white=0.003, drift=0.004) <= 0.08


def test_paired_verification_needs_two_pairs_and_a_known_rule():
    v = verdict([99_000.0], [100_000.0], min_gain=0.002, noise_rule="paired")  # falls back to half-range
    assert v.keep and v.needed_us == pytest.approx(200.0)
    with pytest.raises(ValueError, match="noise_rule"):
        verdict([1.0], [1.0], min_gain=0.0, noise_rule="median")


def test_model_follows_nccls_default_chunk_and_thread_rules():
    # Ring / Simple runs 2 MiB chunks by default (collectives.h:20, enqueue.cc:2222-2225): an
    # explicit 2 MiB chunk is NCCL's own; 512 KiB is a smaller chunk (less L2 spill, less per-step work)
    problem = build(sites=[site(nbytes=256 * 2**20)], a=1.0, b=1.0)
    m = problem.model
    ring = dict(algorithm="Ring", protocol="Simple", n_channels=16)
    own = m.t_comm_us("tp.ag[0]", CommConfig(**ring))
    assert m.t_comm_us("tp.ag[0]", CommConfig(**ring, chunk_size=2 * 2**20)) == pytest.approx(own)
    assert m.slowdown("tp.ag[0]", CommConfig(**ring, chunk_size=512 * 1024)) < m.slowdown(
        "tp.ag[0]", CommConfig(**ring)
    )
    # NCCL_NTHREADS governs Ring/Tree Simple and LL only (tuning.cc:246-254): not NVLS or LL128
    for cfg, moves in (
        (dict(algorithm="Ring", protocol="Simple"), True),
        (dict(algorithm="Ring", protocol="LL"), True),
        (dict(algorithm="NVLS", protocol="Simple"), False),
        (dict(algorithm="Ring", protocol="LL128"), False),
    ):
        t64 = m.t_comm_us("tp.ag[0]", CommConfig(**cfg, n_channels=4, n_threads=64))
        t512 = m.t_comm_us("tp.ag[0]", CommConfig(**cfg, n_channels=4, n_threads=512))
        assert (t64 > t512 * 1.01) == moves, cfg


def test_per_channel_prior_is_absolute_not_a_share_of_the_link():
    # On PCIe (24 GB/s) one channel moves 10 GB/s (Ampere): 1 channel is clearly slower than 2, and 4 saturate.
    # A link/16 prior (1.5 GB/s a channel) would need 16x more channels.
    from lagom_megatron.engine.cost_model import PER_CHANNEL_PRIOR_GBS

    problem = build(sites=[site(nbytes=256 * 2**20)], cluster="a40-pcie-ib200")
    m = problem.model
    assert m.pcb == PER_CHANNEL_PRIOR_GBS[80]
    t = {
        c: m.t_comm_us("tp.ag[0]", CommConfig(algorithm="Ring", protocol="Simple", n_channels=c)) for c in (1, 2, 4, 8)
    }
    assert t[1] > 1.3 * t[2] and t[4] < 1.1 * t[8]


def test_per_channel_prior_is_what_nccls_ring_graph_asks_of_one_cta():
    # NVIDIA/nccl v2.30.7-1: the ring search starts at 60 GB/s per channel on sm90, 40 before (src/graph/search.cc:1051,
    # 1057); ncclTopoDupChannels halves a speed >= 25 and doubles the channels (:1039, :1045-1047; :1040 spares
    # only sm > 80 graphs under 50 GB/s with more than 4 channels); connect.cc:460 runs two CTAs per channel.
    from lagom_megatron.engine.cost_model import PER_CHANNEL_PRIOR_GBS

    assert PER_CHANNEL_PRIOR_GBS[90] == 60.0 / 2 / 2 == 15.0
    assert PER_CHANNEL_PRIOR_GBS[80] == 40.0 / 2 / 2 == 10.0


def test_queued_communicator_charges_a_slower_collective_to_the_iteration():
    # FSDP's backward: reduce-scatters launched right before the wait on the next gather have no
    # compute of their own (empty windows): the data-parallel communicator is a queue
    sites = [site(site_id=f"dp.ag[{i}]", group="dp") for i in range(4)]
    sites += [site(site_id=f"dp.rs[{i}]", op="reduce_scatter", group="dp") for i in range(4)]
    sites += [site(site_id="tp.ag[0]", group="tp")]
    problem = build(sites=sites, comp_ratio=[3.0] * 4 + [0.0] * 4 + [3.0])
    m = problem.model
    m.mark_queues()
    assert m.queued_S is not None and m.queued_S.tolist() == [1.0] * 8 + [0.0]
    slow = CommConfig(algorithm="Ring", protocol="Simple", n_channels=1)
    extra = m.t_comm_us("dp.ag[0]", slow) - m.t_comm_us("dp.ag[0]", CommConfig())
    assert extra > 0
    m.queued_S = None
    free, base = m.t_region_us("dp.ag[0]", slow), m.t_region_us("dp.ag[0]", CommConfig())
    m.mark_queues()
    # the queue's windows hold 12 default gathers' worth of compute against 8 collectives: the
    # slack hides part of the extra time, the rest is charged one for one, less what the window's
    # own region already holds of it (its compute waited for the slower gather: one delay, counted once)
    share = m.queue_free_S[0]
    assert share > 0
    held = min(max(free - base, 0.0), extra)
    assert m.t_region_us("dp.ag[0]", slow) == pytest.approx(free + max(0.0, extra - share - held))
    assert m.t_region_us("dp.ag[0]", slow) <= base + max(extra, free - base) + 1e-6
    # an empty window's own region is its queue time, charged whole: the slack lies in the gathers' windows
    # (another pass, for FSDP's backward reduce-scatters), not beside it
    assert m.queue_free_S[4:8].tolist() == [0.0] * 4
    rs_extra = m.t_comm_us("dp.rs[0]", slow) - m.t_comm_us("dp.rs[0]", CommConfig())
    assert rs_extra > 0
    assert m.t_region_us("dp.rs[0]", slow) == pytest.approx(m.t_region_us("dp.rs[0]", CommConfig()) + rs_extra)
    # without slack (gathers with as much compute as comm) every extra microsecond is charged
    tight = build(sites=sites, comp_ratio=[1.0] * 4 + [0.0] * 4 + [3.0]).model
    tight.mark_queues()
    assert tight.queue_free_S[:8].max() == pytest.approx(0.0)
    tight.queued_S = None
    bare, base = tight.t_region_us("dp.ag[0]", slow), tight.t_region_us("dp.ag[0]", CommConfig())
    tight.mark_queues()
    assert tight.t_region_us("dp.ag[0]", slow) == pytest.approx(bare + extra - min(max(bare - base, 0.0), extra))
    assert tight.t_region_us("dp.ag[0]", slow) > bare
    # one empty window on a communicator (DDP's last bucket) is not a queue
    problem = build(sites=sites, comp_ratio=[3.0] * 7 + [0.0] + [3.0])
    problem.model.mark_queues()
    assert problem.model.queued_S is None


def test_measured_slowdown_shape_is_interpolated_between_probed_channel_counts():
    from lagom_megatron.engine.fit import _channel_correction

    F = np.array([0, 0, 0, 0])
    ctas = np.array([8.0, 8.0, 16.0, 16.0])
    s_fit = np.array([0.2, 0.2, 0.4, 0.4])
    s_obs = np.array([0.2, 0.2, 0.6, 0.6])  # x1 at 8 channels, x1.5 at 16
    corr = _channel_correction(F, 1, np.array([0, 0]), ctas, s_obs, s_fit, np.ones(4, bool), 64)
    assert corr.shape == (2, 65)
    assert corr[0, 8] == pytest.approx(1.0) and corr[0, 16] == pytest.approx(1.5) and corr[0, 12] == pytest.approx(1.25)
    assert corr[0, 2] == pytest.approx(1.0) and corr[0, 64] == pytest.approx(1.5)  # flat beyond the probed range
    # one probed count says nothing about the shape
    assert _channel_correction(F[:2], 1, np.array([0]), ctas[:2], s_obs[:2], s_fit[:2], np.ones(2, bool), 64) is None


def test_imprecise_samples_do_not_shape_the_channel_correction():
    # a collective a tenth of its region: a 2% timing error moves s by ~20%, so such samples are
    # left out of the correction; a collective comparable to its compute pins s and shapes it
    from lagom_megatron.engine.fit import fit_cost_model
    from tests.engine.factory import profile_from

    short = build(sites=[site()], comp_ratio=30.0)  # only the 2-channel probe's collective is >= 20% of its region
    assert fit_cost_model(profile_from(short, noise=0.02), short.cluster).corr_SC is None
    long = build(sites=[site()], comp_ratio=3.0)
    corr = fit_cost_model(profile_from(long, noise=0.0), long.cluster).corr_SC
    assert corr is not None
    assert corr[0, [4, 8, 16, 32]] == pytest.approx(1.0, abs=0.02)  # data of the model's own form: nothing to correct


def test_a_site_with_no_predicted_gain_keeps_nccls_defaults(monkeypatch):
    """The scans' tie rule moves a flat site to fewer channels; the plan must still leave it on
    NCCL's own choice (no move for zero predicted gain), while a site with a real gain moves."""
    from lagom_megatron.engine.priority import keep_defaults_without_gain

    problem = build(sites=[site(site_id="tp.ag[0]"), site(site_id="tp.ag[1]", nbytes=32 * 2**20)], comp_ratio=1.0)
    real = problem.model.evaluate

    def flat_for_first(idx, alg, proto, nc, nt, chunk):  # site 0: every config predicts 100 us
        t_comm, s, region = real(idx, alg, proto, nc, nt, chunk)
        first = np.broadcast_to(np.asarray(idx) == 0, np.shape(region))
        return np.where(first, 100.0, t_comm), s, np.where(first, 100.0, region)

    monkeypatch.setattr(problem.model, "evaluate", flat_for_first)
    st = problem.default_state()
    st.nc[:] = 1.0  # both sites moved (site 0 by a tie, site 1 to a config of its own)
    out, reset = keep_defaults_without_gain(problem, st, ("n_channels", "chunk_size", "protocol", "algorithm"))
    assert out.nc[0] == problem.default_state().nc[0] and reset >= 1
    gain_1 = real(np.array([1]), st.alg[1:], st.proto[1:], st.nc[1:], st.nt[1:], np.zeros(1))[2][0]
    default_1 = real(
        np.array([1]),
        *(
            x[1:]
            for x in (
                problem.default_state().alg,
                problem.default_state().proto,
                problem.default_state().nc,
                problem.default_state().nt,
            )
        ),
        np.zeros(1),
    )[2][0]
    assert (out.nc[1] == 1.0) == (gain_1 < default_1)
    # and the searched plan holds NCCL's default for the flat site
    plan = search(problem, method="priority").plan
    assert plan.entries["tp.ag[0]"].config == CommConfig()
    assert plan.stats["zero_gain_sites_reset"] >= 0


def test_the_search_bets_only_on_algorithms_and_protocols_a_site_measured():
    """NCCL caps an LL128 channel at its own table (18.35 GB/s per CTA on Hopper, tuning.cc:185-190),
    which a Simple probe cannot show, and NVLS's channel rate differs from Ring's: a site's domain
    keeps the algorithms and protocols its samples ran (NCCL's own included), and a probe that sets
    one makes it searchable."""
    from lagom_megatron.engine.problem import SearchProblem

    problem = build(sites=[site()])
    assert problem.domains_S[0]["protocol"] == ("LL", "LL128", "Simple")
    assert "NVLS" in problem.domains_S[0]["algorithm"]
    narrowed = SearchProblem.from_profile(profile_from(problem), rules=problem.rules)
    assert narrowed.domains_S[0]["protocol"] == ("Simple",) and narrowed.domains_S[0]["algorithm"] == ("Ring",)
    probes = list(problem.rules.probe_configs()) + [
        CommConfig(protocol="LL128", n_channels=16),
        CommConfig(algorithm="NVLS", n_channels=16),
    ]
    probed = SearchProblem.from_profile(profile_from(problem, probes=probes), rules=problem.rules)
    assert probed.domains_S[0]["protocol"] == ("LL128", "Simple")
    assert probed.domains_S[0]["algorithm"] == ("Ring", "NVLS")
