"""The search and verification fixes: ties to fewer resources, the SM term's form, the static
fixes as candidates, paired verification."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lagom_megatron.engine.descent import Counter, scan_knob
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.priority import STATIC_CAPS, static_states
from lagom_megatron.engine.search import search
from lagom_megatron.engine.verify import verdict
from tests.engine.factory import build, site, synthetic


def test_ties_go_to_the_fewest_channels(monkeypatch):
    problem = build(sites=[site()], comp_ratio=1.0)
    st = problem.default_state()
    assert st.nc[0] > 2

    def flat(idx, alg, proto, nc, nt, lvl):  # every channel count predicts the same time
        shape = np.broadcast(idx, alg, proto, nc, nt, lvl).shape
        t = np.full(shape, 100.0)
        return t, np.zeros(shape), t

    monkeypatch.setattr(problem, "evaluate_codes", flat)
    assert scan_knob(problem, st, np.array([0]), "n_channels", "region", Counter())
    assert st.nc[0] == 1.0
    # ...and threads the same way
    assert scan_knob(problem, st, np.array([0]), "n_threads", "region", Counter())
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
        assert m.slowdown("tp.ag[0]", CommConfig(n_channels=c, protocol="Simple", algorithm="Ring")) == pytest.approx(c / (sms - c))


@pytest.mark.parametrize("seed", range(6))
def test_plan_is_never_predicted_worse_than_a_static_fix(seed):
    problem = synthetic(n_sites=30, seed=seed)
    plan_us = search(problem, method="priority").stats["predicted_iteration_us"]
    default_nc = problem.default_state().nc
    states = static_states(problem, default_nc)
    assert set(states) == {"nccl-default"} | {f"cap{c}" for c in STATIC_CAPS}
    for name, st in states.items():
        total = problem.iteration_us - float(problem.evaluate(problem.default_state())[2].sum()) + float(problem.evaluate(st)[2].sum())
        assert plan_us <= total * (1 + 1e-9), (name, plan_us, total)


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
    assert m.slowdown("tp.ag[0]", CommConfig(**ring, chunk_size=512 * 1024)) < m.slowdown("tp.ag[0]", CommConfig(**ring))
    # NCCL_NTHREADS governs Ring/Tree Simple and LL only (tuning.cc:246-254): not NVLS or LL128
    for cfg, moves in ((dict(algorithm="Ring", protocol="Simple"), True), (dict(algorithm="Ring", protocol="LL"), True),
                       (dict(algorithm="NVLS", protocol="Simple"), False), (dict(algorithm="Ring", protocol="LL128"), False)):
        t64 = m.t_comm_us("tp.ag[0]", CommConfig(**cfg, n_channels=4, n_threads=64))
        t512 = m.t_comm_us("tp.ag[0]", CommConfig(**cfg, n_channels=4, n_threads=512))
        assert (t64 > t512 * 1.01) == moves, cfg
