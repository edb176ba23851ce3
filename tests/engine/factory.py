"""The one keyword-only factory of the engine tests (``build``) and its helpers."""

from __future__ import annotations

import numpy as np

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.problem import SearchProblem
from lagom_megatron.engine.profile import CollectiveSite, Profile, Sample
from lagom_megatron.megatron.pool.comm_pool import rules_for


def site(*, site_id="tp.ag[0]", op="all_gather", nbytes=64 * 2**20, group="tp", group_size=8, n_nodes=1, calls=1):
    """One CollectiveSite with test defaults (a 64 MiB tensor-parallel all-gather in one node)."""
    return CollectiveSite(
        site_id=site_id,
        op=op,
        nbytes=nbytes,
        dtype="bfloat16",
        group=group,
        group_size=group_size,
        n_nodes=n_nodes,
        calls_per_iter=calls,
    )


def build(
    *,
    sites=None,
    comp_ratio=1.0,
    cluster="h100-sxm-ib400",
    mechanism=None,
    a=1.0,
    b=1.0,
    alpha=1.0,
    beta=1.0,
    domain_override=None,
    iteration_us=None,
):
    """A SearchProblem whose regions have T_comp = comp_ratio x the default T_comm of each site.

    ``comp_ratio`` is a scalar or one value per site; a/b/alpha/beta are the cost-model
    parameters (scalars or per site). The knob rules are the cluster's backend's under
    ``mechanism`` (NCCL's tuner plugin by default, gloo's on ``cpu-gloo``).
    """
    spec = ClusterSpec.load(cluster)
    rules = rules_for(spec.backend, spec, mechanism)
    sites = list(sites or [site()])
    probe = CostModel.from_priors(sites, np.ones(len(sites)), spec, a=a, b=b, alpha=alpha, beta=beta)
    st = SearchProblem.from_model(probe, rules=rules).default_state()
    t_comm = probe.evaluate(np.arange(len(sites)), st.alg, st.proto, st.nc, st.nt, np.zeros(len(sites)))[0]
    model = CostModel.from_priors(
        sites, t_comm * np.asarray(comp_ratio, dtype=float), spec, a=a, b=b, alpha=alpha, beta=beta
    )
    return SearchProblem.from_model(
        model,
        rules=rules,
        domain_override=domain_override,
        iteration_us=iteration_us,
        fingerprint={"cluster": spec.name, "world_size": 16},
    )


def profile_from(problem, *, noise=0.0, seed=0, probes=None, iteration_us=10_000.0):
    """A Profile measured on ``problem``'s model: one default iteration (1) plus one per probe."""
    rng = np.random.default_rng(seed)
    m = problem.model
    backend = problem.backend
    probes = problem.rules.probe_configs() if probes is None else probes
    samples = []
    for it, cfg in enumerate([CommConfig()] + list(probes), start=1):
        for i, s in enumerate(m.sites):
            c = problem.rules.applicable(cfg, op=s.op)
            t_comm, _, t_region = (float(x) for x in m.evaluate(i, *m.encode(i, c)))
            e1, e2 = (1.0 + noise * rng.standard_normal(2)) if noise else (1.0, 1.0)
            samples.append(
                Sample(
                    site_id=s.site_id,
                    config=c,
                    t_comm_us=t_comm * e1,
                    t_comp_us=float(m.t_comp_us_S[i]),
                    t_region_us=max(t_region * e2, t_comm * e1),
                    iteration=it,
                )
            )
    return Profile(
        backend=backend,
        cluster=problem.cluster.name,
        iteration_us=iteration_us,
        sites=list(m.sites),
        samples=samples,
        fingerprint={"world_size": 16, "model": "tiny-gpt", "backend": backend, "cluster": problem.cluster.name},
    )


def synthetic(*, n_sites, seed, cluster="h100-sxm-ib400", mechanism=None, domain_override=None):
    """``engine.bench.synthetic_problem`` on ``cluster`` under its backend's rules (``mechanism``)."""
    from lagom_megatron.engine.bench import synthetic_problem

    spec = ClusterSpec.load(cluster)
    return synthetic_problem(
        n_sites=n_sites, seed=seed, rules=rules_for(spec.backend, spec, mechanism), domain_override=domain_override
    )
