"""A high-priority stream as a communicator-scope knob: the dispatch wait the warm-up's probe measures
(``cost_terms.dispatch_waits``), the cost model's wait term and queue credit, and the per-group decision
(``stream_priority``) that puts the knob on every site of the group in the plan."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lagom_megatron.engine import cost_terms, stream_priority
from lagom_megatron.engine.fit import fit_cost_model
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.profile import Profile, Sample

from .factory import build, site

HP = CommConfig(high_priority_stream=True)


def _profile(problem, wait_us, *, noise=0.0, seed=0):
    """Samples of ``problem``'s model whose collectives at normal priority also wait ``wait_us`` (per
    site, us per iteration) for SMs; the high-priority probe runs without it."""
    rng = np.random.default_rng(seed)
    m = problem.model
    samples = []
    for it, cfg in enumerate([CommConfig()] + problem.rules.probe_configs(), start=1):
        for i, s in enumerate(m.sites):
            c = problem.rules.applicable(cfg, op=s.op)
            t_comm, _, t_region = (float(x) for x in m.evaluate(i, *m.encode(i, c)))
            w = 0.0 if c.high_priority_stream else wait_us[i]
            e = 1.0 + noise * rng.standard_normal()
            samples.append(
                Sample(
                    site_id=s.site_id,
                    config=c,
                    t_comm_us=(t_comm + w) * e,
                    t_comp_us=float(m.t_comp_us_S[i]),
                    t_region_us=max(t_region, t_comm + w) * e,
                    iteration=it,
                )
            )
    return Profile(
        backend=problem.backend,
        cluster=problem.cluster.name,
        iteration_us=10_000.0,
        sites=list(m.sites),
        samples=samples,
        fingerprint={},
    )


def _queue(comp_ratio):
    """A data-parallel queue: two gathers with windows, two reduce-scatters with none (FSDP's backward)."""
    sites = [site(site_id=f"dp.ag[{k}]", group="dp", nbytes=(64 + k) << 20) for k in range(2)]
    sites += [site(site_id=f"dp.rs[{k}]", op="reduce_scatter", group="dp", nbytes=(64 + k) << 20) for k in range(2)]
    return build(sites=sites, comp_ratio=[comp_ratio, comp_ratio, 0.0, 0.0])


def test_the_probe_measures_the_dispatch_wait_per_shape():
    problem = _queue(1.5)
    t_def = problem.evaluate(problem.default_state())[0]
    wait = np.array([0.2, 0.2, 0.0, 0.0]) * t_def  # the gathers wait 20% of their time, the reduce-scatters not
    fitted = fit_cost_model(_profile(problem, wait, noise=0.01), problem.cluster)
    assert fitted.wait_S[:2] == pytest.approx(wait[:2], rel=0.1)
    assert fitted.wait_S[2:].tolist() == [0.0, 0.0]  # within the noise: no wait
    # the model's T_comm is torch's duration: the wait at normal priority, none on a high-priority stream
    assert fitted.t_comm_us("dp.ag[0]", CommConfig()) - fitted.t_comm_us("dp.ag[0]", HP) == pytest.approx(
        wait[0], rel=0.1
    )
    # without the probe there is nothing to measure it against
    no_probe = _profile(problem, wait)
    no_probe.samples = [s for s in no_probe.samples if not s.config.high_priority_stream]
    assert fit_cost_model(no_probe, problem.cluster).wait_S is None
    assert (
        cost_terms.dispatch_waits(
            problem.sites, {s.site_id: [] for s in problem.sites}, np.zeros(4, int), noise_rel=0.02
        ).tolist()
        == [0.0] * 4
    )


def _with_wait(problem, wait):
    m = problem.model
    m.wait_S = np.asarray(wait, dtype=float)
    m.mark_queues()
    return problem


def test_a_critical_queue_gains_the_wait_and_one_with_slack_does_not():
    # compute-bound gathers (window 1.5 x their collective) but the queue as a whole outlasts its
    # windows' compute (two reduce-scatters with none): every us a gather waits delays the queue
    critical = _with_wait(_queue(1.5), [300.0, 300.0, 0.0, 0.0])
    assert critical.model.queue_excess_S.sum() > 600.0 and not critical.model.queue_free_S.any()
    st = critical.default_state()
    assert stream_priority.decide(critical, st) == {0, 1, 2, 3}  # the whole group, reduce-scatters too
    plan = critical.make_plan(st, method="test", stats={})
    assert all(e.config == HP for e in plan.entries.values())
    # the gain is the waits the queue loses, never more (a gather whose compute waited for it and the
    # queue behind it are one delay, not two), less what its windows' compute then takes back
    gain = plan.stats["default_iteration_us"] - plan.stats["predicted_iteration_us"]
    assert 450.0 < gain <= 600.0 + 1e-6
    assert critical.model.hp_S is None  # the decision leaves the model at the groups' own streams
    # windows with room for the queue (compute 5 x each collective): the wait hides behind compute
    slack = _with_wait(_queue(5.0), [300.0, 300.0, 0.0, 0.0])
    assert slack.model.queue_free_S.sum() > 0 and stream_priority.decide(slack, slack.default_state()) == set()
    assert all(
        e.config == CommConfig() for e in slack.make_plan(slack.default_state(), method="t", stats={}).entries.values()
    )


def test_no_wait_no_knob_and_the_env_mechanism_has_none():
    problem = _with_wait(_queue(1.5), [0.0, 0.0, 0.0, 0.0])
    assert stream_priority.decide(problem, problem.default_state()) == set()
    env = build(sites=[site()], mechanism="env")
    assert env.rules.scope("high_priority_stream") is None and stream_priority.units(env) == []
    tuner = build(sites=[site(), site(site_id="pp.send", op="send", group="pp", group_size=2)])
    assert [d["high_priority_stream"] for d in tuner.domains_S] == [(None, True), (None, True)]
    assert [k for k, _ in stream_priority.units(tuner)] == ["comm:tp", "comm:pp"]


def test_the_wait_is_compute_free_in_the_region():
    """A dispatch wait delays the collective's end but slows no compute: a communication-bound window
    grows by the wait; a compute-bound one whose collective still ends within it does not."""
    for ratio, grows in ((0.5, True), (3.0, False)):
        problem = build(sites=[site()], comp_ratio=ratio)
        m = problem.model
        before = m.t_region_us("tp.ag[0]", CommConfig())
        m.wait_S = np.array([100.0])
        after = m.t_region_us("tp.ag[0]", CommConfig())
        assert after - before == (pytest.approx(100.0) if grows else 0.0)
        assert m.t_region_us("tp.ag[0]", HP) == pytest.approx(before)
        assert m.slowdown("tp.ag[0]", CommConfig()) == pytest.approx(m.slowdown("tp.ag[0]", HP))


def test_the_plan_validates_and_keeps_its_other_knobs():
    problem = _with_wait(_queue(1.5), [300.0, 300.0, 0.0, 0.0])
    st = problem.default_state()
    st.nc[0] = 4.0
    plan = problem.make_plan(st, method="test", stats={})
    e = plan.entries["dp.ag[0]"]
    assert e.config.high_priority_stream is True and e.config.n_channels == 4
    for entry in plan.entries.values():
        problem.rules.validate(entry.config, op=entry.op, group_size=entry.group_size)
    with pytest.raises(ValueError, match="high_priority_stream 'yes' is not allowed"):
        problem.rules.validate(replace(HP, high_priority_stream="yes"), op="all_gather")
