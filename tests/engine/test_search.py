"""Priority search vs the baselines on the cost model (the issue's "Must show" list)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from lagom_megatron.engine.bench import SMALL_DOMAINS
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.priority import STATIC_CAPS
from lagom_megatron.engine.problem import SEARCH_KNOBS
from lagom_megatron.engine.search import METHODS, search

from .factory import build, site, synthetic


def _entry(result, site_id="tp.ag[0]"):
    return result.plan.entries[site_id]


def test_compute_bound_region_priority_uses_fewer_channels_than_autoccl():
    # A 64 MiB all-gather beside compute three times longer than the collective: hidden anyway.
    problem = build(sites=[site()], comp_ratio=3.0)
    pri, auto = search(problem, method="priority"), search(problem, method="autoccl")
    p, a = _entry(pri), _entry(auto)
    assert p.config.n_channels < a.config.n_channels, f"got {p.config.n_channels} but should be < {a.config.n_channels}"
    # Fewer channels make the collective slower but the region faster.
    assert p.predicted_t_comm_us > a.predicted_t_comm_us
    assert p.predicted_t_region_us < a.predicted_t_region_us
    # Independent check of the region times from the model's own sub-models.
    m = problem.model
    for e in (p, a):
        t_comm, s = m.t_comm_us("tp.ag[0]", e.config), m.slowdown("tp.ag[0]", e.config)
        want = max(t_comm, m.t_comp_us_S[0] + t_comm * s / (1 + s))
        assert e.predicted_t_region_us == pytest.approx(want, rel=1e-4)
    assert pri.stats["predicted_iteration_us"] < auto.stats["predicted_iteration_us"]


def test_communication_bound_region_priority_keeps_the_collective_fast():
    problem = build(sites=[site()], comp_ratio=0.1)
    p, a = _entry(search(problem, method="priority")), _entry(search(problem, method="autoccl"))
    assert p.predicted_t_comm_us <= 1.01 * a.predicted_t_comm_us
    assert p.predicted_t_region_us == pytest.approx(p.predicted_t_comm_us)  # comm-bound: region = T_comm
    assert p.config.n_channels >= 16


def test_model_evaluations_grow_linearly_with_sites():
    base = synthetic(n_sites=40, seed=7)
    counts = {}
    for copies in (1, 2, 4, 8):
        sites = [
            type(s)(**{**{k: getattr(s, k) for k in s.__slots__}, "site_id": f"{s.site_id}#{c}"})
            for c in range(copies)
            for s in base.sites
        ]
        problem = build(
            sites=sites,
            comp_ratio=np.tile(base.model.t_comp_us_S / _default_comm(base), copies),
            a=np.tile(base.model.a_S, copies),
            b=np.tile(base.model.b_S, copies),
        )
        counts[copies] = search(problem, method="priority").stats["model_evaluations"]
        # Bound per site: 1 default evaluation + 3 rounds of (domain + current) per knob, plus for
        # each shared knob governing it: per candidate value one such pass and one evaluation; plus
        # the static candidates (nccl-default, cap 2/4/8): each evaluated, refined by 3 rounds, evaluated.
        one_pass = sum(problem.vals[k].shape[1] + 1 for k in SEARCH_KNOBS)
        shared = sum(
            np.count_nonzero(~np.isnan(problem.vals[k][g[0]])) * (one_pass + 1) for k, _, g in problem.shared_units()
        )
        statics = 1 + len(STATIC_CAPS)
        assert counts[copies] <= (1 + 3 * one_pass + shared + 1 + 2 * statics + statics * 3 * one_pass) * len(sites)
    for copies in (2, 4, 8):
        ratio = counts[copies] / counts[1]
        assert copies * 0.9 <= ratio <= copies * 1.1, f"got x{ratio:.2f} evaluations for x{copies} sites"


def _default_comm(problem):
    st = problem.default_state()
    return problem.evaluate(st)[0]


def test_communicator_scope_knob_gets_one_value_for_all_its_sites():
    sites = [
        site(site_id=f"dp.rs[{i}]", op="reduce_scatter", nbytes=64 * 2**20, group="dp", group_size=16, n_nodes=2)
        for i in range(4)
    ]
    sites += [site(site_id=f"tp.ag[{i}]", nbytes=(8 + 16 * i) * 2**20) for i in range(4)]
    problem = build(sites=sites, comp_ratio=[0.2, 1.0, 2.0, 4.0] * 2, mechanism="communicator")
    assert problem.scope["n_channels"] == "communicator"
    plan = search(problem, method="priority").plan
    default_nc = problem.default_state().nc
    # a site left at NCCL's choice (config None) runs its default channel count
    nc = {s.site_id: plan.entries[s.site_id].config.n_channels or default_nc[i] for i, s in enumerate(sites)}
    for group in ("dp", "tp"):
        # NCCL caps each call at min(its own choice, maxCTAs): one cap per communicator.
        cap = max(nc[s.site_id] for s in sites if s.group == group)
        for i, s in enumerate(sites):
            if s.group == group:
                assert nc[s.site_id] == min(default_nc[i], cap)
    assert len({nc[s.site_id] for s in sites if s.group == "dp"}) == 1
    # The process-scope thread count is one value for the whole job.
    assert len({e.config.n_threads for e in plan.entries.values() if e.config.n_threads is not None}) <= 1


def test_gloo_threads_are_one_value_per_communicator():
    sites = [
        site(site_id=f"dp.ar[{i}]", op="all_reduce", nbytes=(4 + 8 * i) * 2**20, group="dp", group_size=2)
        for i in range(3)
    ] + [site(site_id="tp.ag[0]", nbytes=8 * 2**20, group="tp", group_size=2)]
    problem = build(sites=sites, cluster="cpu-gloo", comp_ratio=[0.3, 1.0, 3.0, 1.0])
    plan = search(problem, method="priority").plan
    assert len({plan.entries[f"dp.ar[{i}]"].config.n_channels for i in range(3)}) == 1
    assert all(e.config.algorithm is None and e.config.n_threads is None for e in plan.entries.values())


@pytest.mark.parametrize("seed", range(8))
def test_priority_is_within_one_percent_of_exhaustive(seed):
    problem = synthetic(n_sites=2 + seed % 2, seed=1000 + seed, domain_override=SMALL_DOMAINS)
    p = search(problem, method="priority").stats["predicted_iteration_us"]
    e = search(problem, method="exhaustive").stats["predicted_iteration_us"]
    assert e <= p * (1 + 1e-9), "exhaustive must never lose to priority"
    assert p <= e * 1.01, f"got {p:.1f} us but should be within 1% of {e:.1f} us"


def test_exhaustive_refuses_large_instances():
    problem = synthetic(n_sites=12, seed=3)
    with pytest.raises(
        ValueError, match=r"exhaustive search needs [\d,]+ joint configurations, above the limit of 2,000,000"
    ):
        search(problem, method="exhaustive")


def test_searchers_do_not_mutate_the_problem():
    problem = synthetic(n_sites=30, seed=5)
    before = copy.deepcopy((problem.vals, problem.domains_S, problem.model.t_comp_us_S, problem.model.a_S))
    default = problem.default_state()
    for method in ("priority", "autoccl", "nccl-default"):
        search(problem, method=method)
    after = (problem.vals, problem.domains_S, problem.model.t_comp_us_S, problem.model.a_S)
    np.testing.assert_array_equal(before[0]["n_channels"], after[0]["n_channels"])
    assert before[1] == after[1]
    np.testing.assert_array_equal(before[2], after[2])
    np.testing.assert_array_equal(default.nc, problem.default_state().nc)


def test_nccl_default_plan_changes_nothing():
    problem = synthetic(n_sites=10, seed=2)
    res = search(problem, method="nccl-default")
    assert all(e.config == CommConfig() for e in res.plan.entries.values())
    assert res.stats["predicted_iteration_us"] == pytest.approx(res.stats["default_iteration_us"])
    assert res.stats["model_evaluations"] == 0


def test_stats_and_iteration_prediction():
    problem = build(sites=[site(), site(site_id="tp.ag[1]", nbytes=2**20)], comp_ratio=[3.0, 1.0], iteration_us=5000.0)
    res = search(problem, method="priority")
    for key in ("model_evaluations", "wall_time_s", "predicted_iteration_us", "default_iteration_us", "n_sites"):
        assert key in res.stats
    entries = res.plan.entries.values()
    want = (
        5000.0 - sum(e.predicted_default_t_region_us for e in entries) + sum(e.predicted_t_region_us for e in entries)
    )
    assert res.stats["predicted_iteration_us"] == pytest.approx(want, abs=0.01)
    assert res.stats["n_sites"] == 2 and res.stats["default_iteration_us"] == 5000.0


def test_unknown_method():
    with pytest.raises(ValueError, match=r"method must be one of .*'priority'.*got 'greedy'"):
        search(build(), method="greedy")
    assert set(METHODS) == {"priority", "autoccl", "exhaustive", "nccl-default"}


@pytest.mark.parametrize(
    "cluster, mechanism",
    [
        ("h100-sxm-ib400", None),
        ("a100-ib100", None),
        ("h200-sxm", None),
        ("h100-sxm-ib400", "communicator"),
        ("h100-sxm-ib400", "env"),
    ],
)
def test_every_planned_config_passes_nccl_validation(cluster, mechanism):
    from lagom_megatron.nccl.env_vars import validate_env
    from lagom_megatron.nccl.rules import validate_config

    problem = synthetic(n_sites=60, seed=11, cluster=cluster, mechanism=mechanism)
    for method in ("priority", "autoccl"):
        plan = search(problem, method=method).plan
        # the default: lagom's plugin where NCCL loads it (2.22+), CTA bounds per communicator on NCCL 2.21
        assert plan.mechanism == (mechanism or ("communicator" if cluster == "a100-ib100" else "tuner"))
        for e in plan.entries.values():
            validate_config(
                e.config,
                op=e.op,
                cluster=problem.cluster,
                mechanism=plan.mechanism,
                n_nodes=e.n_nodes,
                group_size=e.group_size,
            )
        validate_env(plan.env)
    if cluster == "h200-sxm":  # tuner plugin v6: chunk sizes are searched per call
        assert any(e.config.chunk_size for e in search(problem, method="priority").plan.entries.values())


def test_gloo_plans_pass_validation():
    sites = [
        site(site_id=f"dp.ar[{i}]", op="all_reduce", nbytes=(1 + 4 * i) * 2**20, group="dp", group_size=2)
        for i in range(4)
    ]
    problem = build(sites=sites, cluster="cpu-gloo", comp_ratio=[0.3, 1.0, 2.0, 4.0])
    for method in ("priority", "autoccl", "exhaustive"):
        for e in search(problem, method=method).plan.entries.values():
            problem.rules.validate(e.config, op=e.op, group_size=2)


@pytest.mark.parametrize("cluster", ["h100-sxm-ib400", "cpu-gloo"])
def test_degenerate_sites_give_finite_plans(cluster):
    sites = [
        site(site_id="empty", nbytes=0),
        site(site_id="alone", group_size=1),
        site(site_id="tiny", nbytes=256),
        site(site_id="pp", op="recv", nbytes=2**20, group="pp", group_size=2, n_nodes=2),
    ]
    problem = build(sites=sites, cluster=cluster, comp_ratio=1.0, domain_override=SMALL_DOMAINS)
    for method in ("priority", "autoccl", "exhaustive"):
        # the receive across nodes brings 6 channels-per-peer settings: 2,332,800 joint configurations; the preset's
        # NCCL 2.30.7 (tuner ABI v6, getChunkSize: v2.30.7 src/include/plugin/tuner/tuner_v6.h:66-80) adds 3 chunk
        # sizes to each of the 3 collectives: x 27 = 62,985,600 (exhaustive solves each tie set alone: milliseconds)
        res = search(problem, method=method, **({"limit": 63_000_000} if method == "exhaustive" else {}))
        assert np.isfinite(res.stats["predicted_iteration_us"])
        assert all(np.isfinite(e.predicted_t_region_us) for e in res.plan.entries.values())


def test_sites_left_in_the_default_state_get_nccls_own_choice():
    problem = build(sites=[site(site_id="tp.ag[0]"), site(site_id="tp.ag[1]", nbytes=2**20)])
    st = problem.default_state()
    plan = problem.make_plan(st, method="test", stats={})
    assert all(e.config == CommConfig() for e in plan.entries.values()), plan.entries
    st.nc[1] = 1.0 if st.nc[1] != 1.0 else 2.0  # one site moved off the default: only it gets values
    plan = problem.make_plan(st, method="test", stats={})
    assert plan.entries["tp.ag[0]"].config == CommConfig()
    assert plan.entries["tp.ag[1]"].config.n_channels == int(st.nc[1])


def test_methods_are_the_registered_searchers():
    """``METHODS`` (what the CLI and the tuner accept) names exactly the searchers that exist."""
    from lagom_megatron.engine.problem import SEARCHERS

    assert set(METHODS) == set(SEARCHERS) == {"priority", "autoccl", "exhaustive", "nccl-default"}
