"""One region per call: the profile's per-call times, the cost model's call levels, their fit, and
the recorder that fills in each call's compute alone from the serialized iteration."""

from __future__ import annotations

import json
import math

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

GATHER = dict(site_id="dp.param_all_gather[chunk0.bucket0]", op="all_gather", nbytes=256 * 2**20, group="dp",
              group_size=16, n_nodes=2, calls=4)


def _model(per_call_us, cluster="a40-pcie-ib200", **kw):
    spec = ClusterSpec.load(cluster)
    s = site(**(GATHER | kw))
    m = CostModel.from_priors([s], [float(np.sum(per_call_us)) * s.calls_per_iter / len(per_call_us)], spec)
    m.set_call_levels([per_call_us])
    return m


def test_profile_round_trips_per_call_times_and_names_a_bad_entry(tmp_path):
    s = site()
    smp = Sample(site_id=s.site_id, config=CommConfig(n_channels=4), t_comm_us=30.0, t_comp_us=math.nan, t_region_us=60.0,
                 iteration=2, calls=((10.0, math.nan, 10.0), (20.0, 40.0, 50.0)))
    prof = Profile(backend="nccl", cluster="h100-sxm-ib400", iteration_us=1e3, sites=[s], samples=[smp, Sample(
        site_id=s.site_id, config=CommConfig(), t_comm_us=1.0, t_comp_us=1.0, t_region_us=1.0)])
    prof.save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert "calls" not in data["samples"][1]  # optional: absent when not recorded
    back = Profile.load(tmp_path / "p.json").samples
    assert back[0].calls[1] == (20.0, 40.0, 50.0) and math.isnan(back[0].calls[0][1]) and back[1].calls == ()
    data["samples"][0]["calls"][1] = [20.0, 40.0]
    with pytest.raises(ValueError, match=r"x\.json: calls\[1\] must be \[t_comm_us, t_comp_us, t_region_us\]; got \[20\.0, 40\.0\]"):
        Profile.from_dict(data, source="x.json")


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
    assert m.comp_levels_SL[0, :4].tolist() == per_call and m.comp_weights_SL[0].sum() == 4.0
    for nc in (2, 4, 8):
        t_comm, s, region = (float(x) for x in m.evaluate(0, *m.encode(0, CommConfig(n_channels=nc))))
        tc = t_comm / 4
        want = sum(region_time_us(tc, c, s) for c in per_call)
        assert region == pytest.approx(want, rel=1e-12)
        assert 2 * tc < 2 * 100.0 + 2 * tc  # the forward calls are communication-bound ...
        assert region > float(region_time_us(t_comm, sum(per_call), s))  # ... which the sum cannot see
    # a faster collective now shortens the region by what it saves on the exposed calls
    slow, fast = (m.evaluate(0, *m.encode(0, CommConfig(n_channels=nc)))[:: 2] for nc in (1, 2))
    assert slow[1] - fast[1] > 0.4 * (slow[0] - fast[0])


def test_levels_group_sorted_calls_into_runs_of_equal_count():
    per_call = list(range(1, 2 * MAX_CALL_LEVELS + 1))
    m = _model([float(x) * 1000 for x in per_call[::-1]], calls=2 * MAX_CALL_LEVELS)
    assert m.comp_levels_SL[0].tolist() == [1500.0 + 2000.0 * k for k in range(MAX_CALL_LEVELS)]
    assert m.comp_weights_SL[0].tolist() == [2.0] * MAX_CALL_LEVELS
    assert m.call_level[0].tolist() == [MAX_CALL_LEVELS - 1 - k // 2 for k in range(2 * MAX_CALL_LEVELS)]
    with pytest.raises(ValueError, match=r"per_call_us must have one entry per site \(1\); got 2"):
        m.set_call_levels([[], []])
    with pytest.raises(ValueError, match=r"per-call compute must be finite and >= 0 us; got \[1\.0, nan\]"):
        m.set_call_levels([[1.0, math.nan]])


def _measured(truth: CostModel, per_call, configs):
    """Samples of ``truth`` with one (t_comm, t_comp, t_region) per call, noise-free."""
    out = []
    for it, cfg in enumerate(configs, start=1):
        t_comm, s, region = (float(x) for x in truth.evaluate(0, *truth.encode(0, cfg)))
        tc = t_comm / len(per_call)
        calls = tuple((tc, c, float(region_time_us(tc, c, s * k))) for c, k in zip(per_call, truth.slow_SL[0]))
        out.append(Sample(site_id=truth.sites[0].site_id, config=cfg, t_comm_us=t_comm, t_comp_us=float(sum(per_call)),
                          t_region_us=region, iteration=it, calls=calls))
    return out


def test_fit_recovers_a_slowdown_that_differs_per_call():
    # a backward window slows three times as much per byte moved as a forward one
    tc = float(_model([1.0, 2.0]).evaluate(0, *_model([1.0, 2.0]).encode(0, CommConfig()))[0]) / 4
    per_call = [2 * tc, 2 * tc, 6 * tc, 6 * tc]  # every call compute-bound: s is seen on each
    truth = _model(per_call)
    truth.a_S[:], truth.b_S[:] = 2.0, 1.5
    truth.slow_SL[0, :4] = [1.0, 1.0, 3.0, 3.0]
    configs = [CommConfig()] + [CommConfig(n_channels=n) for n in (1, 2, 4, 8, 16)]
    prof = Profile(backend="nccl", cluster="a40-pcie-ib200", iteration_us=1e6, sites=truth.sites,
                   samples=_measured(truth, per_call, configs))
    fitted = fit_cost_model(prof, truth.cluster)
    k = fitted.slow_SL[0, :4]  # one level per call (sorted by compute): forward, forward, backward, backward
    assert k[2] / k[0] == pytest.approx(3.0, rel=0.05) and k[3] / k[1] == pytest.approx(3.0, rel=0.05)
    for cfg in (CommConfig(n_channels=6), CommConfig(n_channels=12)):
        assert fitted.t_region_us(truth.sites[0], cfg) == pytest.approx(truth.t_region_us(truth.sites[0], cfg), rel=0.01)
    assert fitted.mape < 0.5


def test_recorder_gives_each_call_its_serialized_compute():
    s = site(calls=2)
    rec = ProfileRecorder(backend="nccl", cluster_name="h100-sxm-ib400", fingerprint={})

    def m(it, calls, comp=math.nan):
        smp = Sample(site_id=s.site_id, config=CommConfig(), t_comm_us=sum(c[0] for c in calls), t_comp_us=comp,
                     t_region_us=sum(c[2] for c in calls), iteration=it, calls=calls)
        return IterationMeasurement(iteration=it, iteration_us=1e3, sites=[s], samples=[smp])

    rec.record_default(m(1, ((10.0, math.nan, 12.0), (10.0, math.nan, 40.0))))
    rec.record_serialized(m(2, ((10.0, 1.0, 11.0), (10.0, 35.0, 45.0)), comp=36.0))
    rec.record_default(m(3, ((10.0, math.nan, 12.0),)))  # a call missing: no per-call times
    got = rec.build_profile().samples
    assert got[0].calls == ((10.0, 1.0, 12.0), (10.0, 35.0, 40.0)) and got[0].t_comp_us == 36.0
    assert got[1].calls == () and got[1].t_comp_us == 36.0
