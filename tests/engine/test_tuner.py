"""The tuning lifecycle state machine, driven by a scripted backend.

The cost model and search are replaced by recording fakes here, so that these tests check the
lifecycle alone (schedule, T_comp from the serialized iteration, verification rule, fall-backs);
tests/sim/ runs the lifecycle against the real engine and the simulator.
"""

from __future__ import annotations

import logging
import math
import sys
import types
from dataclasses import dataclass, field

import pytest

import lagom_megatron.engine as engine_pkg
from lagom_megatron.engine.knobs import DEFAULT, CommConfig
from lagom_megatron.engine.profile import CollectiveSite, Profile, Sample
from lagom_megatron.engine.steps import IterationMeasurement, Phase
from lagom_megatron.engine.tuner import Tuner

PROBES = [CommConfig(n_channels=4), CommConfig(n_channels=8, protocol="Simple")]
SITES = [
    CollectiveSite(
        site_id="dp.grad_reduce_scatter[chunk0.bucket0]",
        op="reduce_scatter",
        nbytes=64 << 20,
        dtype="bf16",
        group="dp",
        group_size=8,
        n_nodes=8,
    ),
    CollectiveSite(
        site_id="tp.sp_all_gather[layer0.fc1]", op="all_gather", nbytes=8 << 20, dtype="bf16", group="tp", group_size=8
    ),
]
T_COMP = {SITES[0].site_id: 900.0, SITES[1].site_id: 120.0}


@dataclass(frozen=True)
class _Rules:
    """Knob rules of a scripted backend: every knob applies to every op (``engine.knobs.KnobRules``)."""

    backend: str = "sim"
    mechanism: str = "tuner"
    cluster: types.SimpleNamespace = field(default_factory=lambda: types.SimpleNamespace(name="h100-sxm-ib400"))

    def probe_configs(self):
        return list(PROBES)

    def applicable(self, config, *, op):
        return config


@dataclass
class _Entry:
    config: CommConfig


@dataclass
class _Plan:
    entries: dict
    fingerprint: dict = field(default_factory=dict)

    def digest(self) -> str:
        return "fake"

    def for_launch(self, registered_now=()):
        return self  # registers no group

    def pending_groups(self, registered_now=()):
        return ()


@pytest.fixture
def fake_engine(monkeypatch):
    """Installs recording fakes of fit.fit_cost_model and search.search; returns the call log."""
    calls: dict = {"fit": [], "search": [], "plan_config": CommConfig(n_channels=4)}

    class FakeModel:
        mape = 3.5

    def fake_fit(profile, cluster):
        calls["fit"].append((profile, cluster))
        return FakeModel()

    def fake_search(profile, *, rules, method="priority", model=None):
        calls["search"].append({"profile": profile, "cluster": rules.cluster, "method": method, "model": model})
        cfg = calls["plan_config"]
        plan = _Plan(entries={s.site_id: _Entry(cfg) for s in profile.sites}, fingerprint=profile.fingerprint)
        return types.SimpleNamespace(plan=plan, stats={"model_evaluations": 10, "predicted_iteration_us": 9000.0})

    cm = types.ModuleType("lagom_megatron.engine.fit")
    cm.fit_cost_model = fake_fit
    se = types.ModuleType("lagom_megatron.engine.search")
    se.search = fake_search
    monkeypatch.setitem(sys.modules, cm.__name__, cm)
    monkeypatch.setitem(sys.modules, se.__name__, se)
    monkeypatch.setattr(engine_pkg, "fit", cm, raising=False)
    monkeypatch.setattr(engine_pkg, "search", se, raising=False)
    return calls


def _measure(step, *, plan_us=9000.0, default_us=10000.0, jitter=0.0):
    """A scripted backend: iteration times by step kind, one sample per site with the assigned config."""
    cfgs = {s.site_id: step.assignment.get(s.site_id, DEFAULT) for s in SITES}
    samples = []
    for s in SITES:
        comp = T_COMP[s.site_id]
        t_comp = comp if step.serialize else math.nan
        samples.append(
            Sample(
                site_id=s.site_id,
                config=cfgs[s.site_id],
                t_comm_us=comp * 0.8,
                t_comp_us=t_comp,
                t_region_us=comp * 1.2,
                iteration=step.iteration,
            )
        )
    uses_plan = step.kind in ("verify-plan", "applied", "settle")
    us = (plan_us if uses_plan else default_us) + jitter * (-1) ** (step.iteration // 2)
    return IterationMeasurement(iteration=step.iteration, iteration_us=us, sites=list(SITES), samples=samples)


def _run(tuner, n, **kw):
    kinds = []
    for it in range(n):
        step = tuner.start_iteration(it)
        kinds.append(step.kind)
        tuner.finish_iteration(_measure(step, **kw))
    return kinds


def _tuner(**cfg):
    cfg = {"warmup_iters": 1, "verify_iters": 3, **cfg}  # the counts these tests were written for
    return Tuner(Tuner.Config(probe_configs=PROBES, **cfg), rules=_Rules(), fingerprint={"model": "m"})


def test_schedule_is_fixed_and_independent_of_sites(fake_engine):
    t = _tuner(warmup_iters=2, verify_iters=2)
    assert t.profiling_iters == 2 + 1 + 1 + len(PROBES)
    kinds = _run(t, 12)
    assert kinds == [
        "warmup",
        "warmup",
        "default",
        "serialized",
        "probe",
        "probe",
        "settle",
        "verify-default",
        "verify-plan",
        "verify-default",
        "verify-plan",
        "applied",
    ]
    assert t.phase is Phase.APPLIED, t.summary()


@pytest.mark.parametrize("verify_iters", [1, 3])
def test_total_iters_is_when_the_verdict_comes(fake_engine, verify_iters):
    t = _tuner(warmup_iters=1, verify_iters=verify_iters)
    assert t.total_iters == 1 + 1 + 1 + len(PROBES) + 1 + 2 * verify_iters
    for it in range(t.total_iters):
        assert not t.done, f"verdict after {it} iterations, expected after {t.total_iters}: {t.summary()}"
        t.finish_iteration(_measure(t.start_iteration(it)))
    assert t.done and t.iterations_finished == t.total_iters


def test_a_given_plan_is_verified_without_profiling(fake_engine):
    t = _tuner(warmup_iters=2, verify_iters=2)
    searched = _tuner(warmup_iters=1, verify_iters=1)
    _run(searched, searched.profiling_iters)
    t.start_from_plan(searched.plan)
    assert t.total_iters == 1 + 2 * 2
    kinds = _run(t, t.total_iters, plan_us=9000.0)
    assert kinds == ["settle", "verify-default", "verify-plan", "verify-default", "verify-plan"]
    assert t.phase is Phase.APPLIED and t.profile is None, t.summary()
    slower = _tuner(verify_iters=1)
    slower.start_from_plan(searched.plan)
    _run(slower, slower.total_iters, plan_us=11000.0)
    assert slower.phase is Phase.FELL_BACK
    with pytest.raises(RuntimeError, match="already ran 3 iteration"):
        slower.start_from_plan(searched.plan)


def test_profile_has_t_comp_from_serialized_iteration_and_only_profile_reaches_search(fake_engine):
    t = _tuner()
    _run(t, t.profiling_iters)
    assert t.phase is Phase.SEARCHED
    (call,) = fake_engine["search"]
    prof = call["profile"]
    assert isinstance(prof, Profile)
    assert call["method"] == "priority" and call["cluster"].name == "h100-sxm-ib400"
    # one default + one sample per probe, per site; the serialized iteration is not a sample
    assert len(prof.samples) == len(SITES) * (1 + len(PROBES))
    for s in prof.samples:
        assert s.t_comp_us == T_COMP[s.site_id], f"got {s.t_comp_us} but should be {T_COMP[s.site_id]}"
    assert {s.config for s in prof.samples} == {DEFAULT, *PROBES}
    assert prof.iteration_us == 10000.0 and prof.fingerprint == {"model": "m"}
    assert prof.backend == "sim" and prof.cluster == "h100-sxm-ib400"


def test_probe_iterations_assign_the_probe_to_every_site(fake_engine):
    t = _tuner()
    seen = []
    for it in range(t.profiling_iters):
        step = t.start_iteration(it)
        if step.kind == "probe":
            seen.append(step.assignment)
            assert t.probe_assignments() == [{s.site_id: p for s in SITES} for p in PROBES]  # known ahead
        t.finish_iteration(_measure(step))
    assert seen == [{s.site_id: p for s in SITES} for p in PROBES]


def test_plan_kept_only_when_gain_exceeds_spread(fake_engine):
    # 1% gain with +-5% jitter: under the half-range rule the spread wins -> defaults kept
    t = _tuner(verify_iters=3, noise_rule="half-range")
    _run(t, t.profiling_iters + 1 + 6 + 1, plan_us=9900.0, jitter=500.0)
    assert t.phase is Phase.FELL_BACK
    assert "needed >" in t.reason and t.assignment() == {}
    # the jitter moves each (defaults, plan) pair together: the paired rule (default) sees the
    # constant 1% gain through it
    t = _tuner(verify_iters=3)
    _run(t, t.profiling_iters + 1 + 6 + 1, plan_us=9900.0, jitter=500.0)
    assert t.phase is Phase.APPLIED, t.reason
    # the same gain without jitter is kept
    t = _tuner(verify_iters=3)
    _run(t, t.profiling_iters + 1 + 6 + 1, plan_us=9900.0)
    assert t.phase is Phase.APPLIED
    assert t.assignment() == {s.site_id: CommConfig(n_channels=4) for s in SITES}
    s = t.summary()
    assert s["measured_default_us"] == 10000.0 and s["measured_plan_us"] == 9900.0
    assert s["speedup"] == pytest.approx(10000 / 9900)


def test_slower_plan_falls_back(fake_engine):
    t = _tuner(verify_iters=1)
    _run(t, t.profiling_iters + 1 + 2, plan_us=11000.0)
    assert t.phase is Phase.FELL_BACK and t.assignment() == {}


def test_agree_hook_result_is_applied_and_failure_falls_back(fake_engine):
    agreed = _Plan(entries={s.site_id: _Entry(CommConfig(n_channels=2)) for s in SITES})
    t = Tuner(Tuner.Config(probe_configs=PROBES), rules=_Rules(backend="nccl"), agree=lambda plan: agreed)
    _run(t, t.profiling_iters + 1)
    assert t.plan is agreed
    assert t.assignment() == {} and t.next_step().kind == "verify-default"

    def refuse(plan):
        raise RuntimeError("plan digest on rank 3 differs from rank 0")

    t = Tuner(Tuner.Config(probe_configs=PROBES), rules=_Rules(backend="nccl"), agree=refuse)
    _run(t, t.profiling_iters)
    assert t.phase is Phase.FELL_BACK
    assert "rank 3" in t.reason


def test_all_default_plan_falls_back(fake_engine):
    fake_engine["plan_config"] = DEFAULT
    t = _tuner()
    _run(t, t.profiling_iters)
    assert t.phase is Phase.FELL_BACK and "kept the defaults for every site" in t.reason


def test_preconditions_name_what_was_seen(fake_engine):
    t = _tuner()
    t.start_iteration(0)
    with pytest.raises(RuntimeError, match="iteration 0 was started and not finished"):
        t.start_iteration(1)
    with pytest.raises(RuntimeError, match=r"finish_iteration\(5\): iteration 0 was started"):
        t.finish_iteration(IterationMeasurement(iteration=5, iteration_us=1.0))
    t.finish_iteration(IterationMeasurement(iteration=0, iteration_us=1.0))
    with pytest.raises(RuntimeError, match="iteration 0 already finished"):
        t.finish_iteration(IterationMeasurement(iteration=0, iteration_us=1.0))
    # a default iteration without sites: nothing to tune, defaults kept (training goes on)
    assert t.finish_iteration(IterationMeasurement(iteration=1, iteration_us=1.0)) is Phase.FELL_BACK
    assert "no collective sites" in t.reason and t.assignment() == {}


def test_site_with_wrong_config_or_missing_probe_sample_keeps_defaults(fake_engine, caplog):
    caplog.set_level(logging.WARNING, logger="lagom.tuner")
    t = _tuner()
    first_probe = True
    for it in range(t.profiling_iters):
        step = t.start_iteration(it)
        m = _measure(step)
        if step.kind == "probe" and first_probe:
            m.samples[0] = Sample(site_id=SITES[0].site_id, config=DEFAULT, t_comm_us=1, t_comp_us=1, t_region_us=1)
            first_probe = False
        elif step.kind == "probe":
            del m.samples[1]
        t.finish_iteration(m)
    excluded = t.summary()["excluded_sites"]
    assert "assigned {'n_channels': 4}, found config {}" in excluded[SITES[0].site_id]
    assert "expected a sample, found none" in excluded[SITES[1].site_id]
    assert SITES[0].site_id in caplog.text
    # nothing left to tune: defaults kept, with the reason
    assert t.phase is Phase.FELL_BACK and "no site left to tune" in t.reason
    assert not fake_engine["search"]


def test_search_exception_falls_back(fake_engine, monkeypatch):
    def boom(*a, **k):
        raise IndexError("site index 7 out of range")

    monkeypatch.setattr(sys.modules["lagom_megatron.engine.search"], "search", boom)
    t = _tuner()
    _run(t, t.profiling_iters)
    assert t.phase is Phase.FELL_BACK and "IndexError: site index 7" in t.reason
    # with a collective agree hook, the failing rank still enters it (with None) so that the
    # other ranks, waiting there, learn of the failure instead of hanging
    seen = []

    def agree(plan):
        seen.append(plan)
        raise RuntimeError("the search failed on rank(s) [1]")

    t = Tuner(Tuner.Config(probe_configs=PROBES), rules=_Rules(), agree=agree)
    _run(t, t.profiling_iters)
    assert seen == [None] and t.phase is Phase.FELL_BACK and "IndexError" in t.reason


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"warmup_iters": 0}, "warmup_iters must be >= 1"),
        ({"verify_iters": 0}, "verify_iters must be >= 1"),
        ({"method": "greedy"}, "method must be one of .*got 'greedy'"),
        ({"min_gain": 1.5}, "min_gain must be in"),
    ],
)
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Tuner.Config(**kw)


def test_bad_measurement_and_backend():
    with pytest.raises(ValueError, match="iteration_us must be a positive"):
        IterationMeasurement(iteration=0, iteration_us=float("nan"))
    with pytest.raises(ValueError, match="backend must be one of"):
        Tuner(Tuner.Config(), rules=_Rules(backend="mpi"))
