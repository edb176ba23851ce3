"""One region per call: the profile's per-call times, the cost model's call levels, their fit, and
the recorder that fills in each call's compute alone from the serialized iteration."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import MAX_CALL_LEVELS, CostModel, region_time_us
from lagom_megatron.engine.fit import fit_cost_model
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.profile import Profile, Sample
from lagom_megatron.engine.recorder import ProfileRecorder
from lagom_megatron.engine.steps import IterationMeasurement

from .factory import site

GATHER = dict(
    site_id="dp.param_all_gather[chunk0.bucket0]",
    op="all_gather",
    nbytes=256 * 2**20,
    group="dp",
    group_size=16,
    n_nodes=2,
    calls=4,
)


def _model(per_call_us, cluster="a40-pcie-ib200", **kw):
    spec = ClusterSpec.load(cluster)
    s = site(**(GATHER | kw))
    m = CostModel.from_priors([s], [float(np.sum(per_call_us)) * s.calls_per_iter / len(per_call_us)], spec)
    m.set_call_levels([per_call_us])
    return m


def test_profile_round_trips_per_call_times(tmp_path):
    s = site()
    smp = Sample(
        site_id=s.site_id,
        config=CommConfig(n_channels=4),
        t_comm_us=30.0,
        t_comp_us=math.nan,
        t_region_us=60.0,
        iteration=2,
        calls=((10.0, math.nan, 10.0), (20.0, 40.0, 50.0)),
    )
    prof = Profile(
        backend="nccl",
        cluster="h100-sxm-ib400",
        iteration_us=1e3,
        sites=[s],
        samples=[smp, Sample(site_id=s.site_id, config=CommConfig(), t_comm_us=1.0, t_comp_us=1.0, t_region_us=1.0)],
    )
    prof.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert "calls" not in data["samples"][1]  # optional: absent when not recorded
    back = Profile.from_dict(data).samples
    assert back[0].calls[1] == (20.0, 40.0, 50.0) and math.isnan(back[0].calls[0][1]) and back[1].calls == ()


def test_calls_of_equal_compute_keep_the_summed_region():
    m = _model([5000.0] * 4)
    assert m.comp_levels_SL is None and m.slow_SL is None  # nothing to tell apart
    t_comm, s, region = m.evaluate(0, *m.encode(0, CommConfig(n_channels=4)))
    assert region == pytest.approx(region_time_us(t_comm, 20000.0, s))


def test_an_exposed_call_is_its_own_region():
    # FSDP's first unit: two forward gathers waited at once (0.1 ms of compute), two backward
    # re-gathers under 48 ms; summed, the site looks compute-bound
    per_call = [100.0, 100.0, 48000.0, 48000.0]
    m = _model(per_call)
    assert m.comp_levels_SL[0].tolist() == [100.0, 48000.0] and m.comp_weights_SL[0].tolist() == [2.0, 2.0]
    assert m.t_comp_us_S[0] == pytest.approx(sum(per_call))
    for nc in (2, 4, 8):
        t_comm, s, region = (float(x) for x in m.evaluate(0, *m.encode(0, CommConfig(n_channels=nc))))
        tc = t_comm / 4
        want = sum(region_time_us(tc, c, s) for c in per_call)
        assert region == pytest.approx(want, rel=1e-12)
        assert 2 * tc < 2 * 100.0 + 2 * tc  # the forward calls are communication-bound ...
        assert region > float(region_time_us(t_comm, sum(per_call), s))  # ... which the sum cannot see
    # a faster collective now shortens the region by what it saves on the exposed calls
    slow, fast = (m.evaluate(0, *m.encode(0, CommConfig(n_channels=nc)))[::2] for nc in (1, 2))
    assert slow[1] - fast[1] > 0.4 * (slow[0] - fast[0])


@pytest.mark.parametrize("n", [4, 12, 16])
def test_an_exposed_call_keeps_its_own_level_among_many_hidden_ones(n):
    m = _model([48000.0] * (n // 2) + [100.0] + [48000.0 * (1 + 0.01 * k) for k in range(n // 2 - 1)], calls=n)
    assert m.comp_levels_SL.shape == (1, 2) and m.comp_levels_SL[0, 0] == 100.0  # noise of 1% stays in one level
    assert m.comp_weights_SL[0].tolist() == [1.0, n - 1.0]
    assert m.call_level[0].tolist() == [1] * (n // 2) + [0] + [1] * (n // 2 - 1)


def test_levels_merge_the_closest_neighbours_beyond_the_limit():
    per_call = [100.0 * 3.0**k for k in range(MAX_CALL_LEVELS + 3)][::-1]  # 11 windows, none alike
    m = _model(per_call, calls=2 * len(per_call))
    lv, w = m.comp_levels_SL[0], m.comp_weights_SL[0]
    assert lv.shape == (MAX_CALL_LEVELS,) and w.sum() == 2 * len(per_call) and (np.diff(lv) > 0).all()
    for c, k in zip(per_call, m.call_level[0]):  # each call's level is the mean of its own run
        run = [x for x, j in zip(per_call, m.call_level[0]) if j == k]
        assert c in run and lv[k] == pytest.approx(np.mean(run)) and w[k] == 2 * len(run)
    with pytest.raises(ValueError, match=r"per_call_us must have one entry per site \(1\); got 2"):
        m.set_call_levels([[], []])
    with pytest.raises(ValueError, match=r"per-call compute must be finite and >= 0 us; got \[1\.0, nan\]"):
        m.set_call_levels([[1.0, math.nan]])


def _measured(truth: CostModel, per_call, configs, *, drop_calls=()):
    """Samples of every site of ``truth`` with one (t_comm, t_comp, t_region) per call, noise-free;
    ``per_call``: per site, each call's compute; ``drop_calls``: (site, config index) pairs whose
    sample keeps only its sums (as when ranks timed different numbers of calls)."""
    out = []
    for it, cfg in enumerate(configs, start=1):
        for i, site_ in enumerate(truth.sites):
            t_comm, s, region = (float(x) for x in truth.evaluate(i, *truth.encode(i, cfg)))
            tc = t_comm / len(per_call[i])
            k = truth.slow_SL[i][truth.call_level[i]]
            calls = tuple((tc, c, float(region_time_us(tc, c, s * kc))) for c, kc in zip(per_call[i], k))
            out.append(
                Sample(
                    site_id=site_.site_id,
                    config=cfg,
                    t_comm_us=t_comm,
                    t_comp_us=float(sum(per_call[i])),
                    t_region_us=region,
                    iteration=it,
                    calls=() if (i, it - 1) in drop_calls else calls,
                )
            )
    return out


CONFIGS = [CommConfig()] + [CommConfig(n_channels=n) for n in (1, 2, 4, 8, 16)]


def _truth(per_call, factors):
    """Sites of one shape group (same op, bytes, communicator), one per entry of ``per_call``, with
    slowdown factors per level ``factors`` and a = 2, b = 1.5."""
    spec = ClusterSpec.load("a40-pcie-ib200")
    sites = [
        site(**(GATHER | {"site_id": f"dp.param_all_gather[chunk0.bucket{i}]", "calls": len(c)}))
        for i, c in enumerate(per_call)
    ]
    m = CostModel.from_priors(sites, [float(sum(c)) for c in per_call], spec, a=2.0, b=1.5)
    m.set_call_levels(per_call)
    for i, f in enumerate(factors):
        m.slow_SL[i, : len(f)] = f
    return m


def _tc() -> float:
    """One call's default T_comm (us) of the GATHER site."""
    m = _model([1.0, 2.0])
    return float(m.evaluate(0, *m.encode(0, CommConfig()))[0]) / 4


def _fit(truth, samples):
    return fit_cost_model(
        Profile(backend="nccl", cluster="a40-pcie-ib200", iteration_us=1e6, sites=truth.sites, samples=samples),
        truth.cluster,
    )


def test_fit_recovers_a_slowdown_that_differs_per_call():
    # a backward window slows three times as much per byte moved as a forward one
    tc = _tc()
    per_call = [[2 * tc, 2 * tc, 6 * tc, 6 * tc]]  # every call compute-bound: s is seen on each
    truth = _truth(per_call, [[1.0, 3.0]])
    fitted = _fit(truth, _measured(truth, per_call, CONFIGS))
    k = fitted.slow_SL[0]
    assert k[1] / k[0] == pytest.approx(3.0, rel=0.05)
    for cfg in (CommConfig(n_channels=6), CommConfig(n_channels=12)):
        assert fitted.t_region_us(truth.sites[0], cfg) == pytest.approx(
            truth.t_region_us(truth.sites[0], cfg), rel=0.01
        )
    assert fitted.mape < 0.5
    # a sample that kept only its sums (its calls could not be matched) belongs to no level
    dropped = _fit(truth, _measured(truth, per_call, CONFIGS, drop_calls={(0, 0), (0, 3)}))
    kd = dropped.slow_SL[0]
    assert kd[1] / kd[0] == pytest.approx(3.0, rel=0.05) and dropped.mape < 1.0
    for cfg in (CommConfig(n_channels=6), CommConfig(n_channels=12)):
        assert dropped.t_region_us(truth.sites[0], cfg) == pytest.approx(
            truth.t_region_us(truth.sites[0], cfg), rel=0.01
        )


def test_level_factors_pool_only_sites_with_as_many_levels():
    # two sites of one shape group: two windows (forward, backward) and three (forward, recompute, backward)
    tc = _tc()
    per_call = [[2 * tc, 6 * tc], [2 * tc, 4 * tc, 6 * tc]]
    truth = _truth(per_call, [[1.0, 3.0], [1.0, 2.0, 3.0]])
    a, b = _fit(truth, _measured(truth, per_call, CONFIGS)).slow_SL
    assert a[1] / a[0] == pytest.approx(3.0, rel=0.05) and a[2] == 1.0  # a third level it does not have
    assert (b[1] / b[0], b[2] / b[0]) == pytest.approx((2.0, 3.0), rel=0.05)


def test_a_call_of_almost_no_time_does_not_break_the_fit():
    tc = _tc()
    per_call = [[2 * tc, 6 * tc]]
    truth = _truth(per_call, [[1.0, 3.0]])
    samples = _measured(truth, per_call, CONFIGS)
    samples[1] = replace(samples[1], calls=((1e-300, 2 * tc, 2 * tc), samples[1].calls[1]))
    fitted = _fit(truth, samples)
    assert np.isfinite(fitted.slow_SL).all() and np.isfinite(
        fitted.t_region_us(truth.sites[0], CommConfig(n_channels=4))
    )


def test_recorder_gives_each_call_its_serialized_compute():
    s = site(calls=2)
    rec = ProfileRecorder(backend="nccl", cluster_name="h100-sxm-ib400", fingerprint={})

    def m(it, calls, comp=math.nan):
        smp = Sample(
            site_id=s.site_id,
            config=CommConfig(),
            t_comm_us=sum(c[0] for c in calls),
            t_comp_us=comp,
            t_region_us=sum(c[2] for c in calls),
            iteration=it,
            calls=calls,
        )
        return IterationMeasurement(iteration=it, iteration_us=1e3, sites=[s], samples=[smp])

    rec.record_default(m(1, ((10.0, math.nan, 12.0), (10.0, math.nan, 40.0))))
    rec.record_serialized(m(2, ((10.0, 1.0, 11.0), (10.0, 35.0, 45.0)), comp=36.0))
    rec.record_default(m(3, ((10.0, math.nan, 12.0),)))  # a call missing: no per-call times
    got = rec.build_profile().samples
    assert got[0].calls == ((10.0, 1.0, 12.0), (10.0, 35.0, 40.0)) and got[0].t_comp_us == 36.0
    assert got[1].calls == () and got[1].t_comp_us == 36.0
