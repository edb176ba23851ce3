"""Search cost on seeded synthetic problems (``lagom bench search``): ``scaling_table`` (target 10,000 sites in < 2 s on
one core, linear) and ``optimality`` (target: priority within 1% of exhaustive on >= 95% of small instances)."""

from __future__ import annotations

import time

import numpy as np

from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.knobs import KnobRules
from lagom_megatron.engine.problem import SearchProblem
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.engine.search import search

SMALL_DOMAINS = {"n_channels": (2, 4, 8, 16, 32), "chunk_size": (None, 131072, 524288), "n_threads": (256, 512)}

_KINDS = (
    # (group, op, group_size, n_nodes, log2 bytes low, high)
    ("dp", "reduce_scatter", 16, 2, 22, 28),
    ("dp", "all_gather", 16, 2, 22, 28),
    ("tp", "all_gather", 8, 1, 18, 26),
    ("tp", "reduce_scatter", 8, 1, 18, 26),
    ("tp", "all_reduce", 8, 1, 14, 24),
    ("pp", "send", 2, 2, 18, 24),
)


def synthetic_problem(
    *, n_sites: int, seed: int, rules: KnobRules, domain_override: dict | None = None
) -> SearchProblem:
    """Seeded Megatron-like sites, priors' model: compute = default T_comm, a, b = prior, x log-uniform [0.3, 3]."""
    spec = rules.cluster
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, len(_KINDS), n_sites)
    sites = []
    for j, k in enumerate(kinds):
        group, op, n, nodes, lo, hi = _KINDS[k]
        nbytes = int(2 ** rng.uniform(lo, hi)) // 256 * 256 + 256
        sites.append(
            CollectiveSite(
                site_id=f"{group}.{op}[{j}]",
                op=op,
                nbytes=nbytes,
                dtype="bfloat16",
                group=group,
                group_size=n,
                n_nodes=nodes,
            )
        )
    a = np.exp(rng.uniform(np.log(0.3), np.log(3.0), n_sites))
    b = np.exp(rng.uniform(np.log(0.3), np.log(3.0), n_sites))
    probe = CostModel.from_priors(sites, np.ones(n_sites), spec, a=a, b=b)
    st = SearchProblem.from_model(probe, rules=rules).default_state()
    t_comm = probe.evaluate(np.arange(n_sites), st.alg, st.proto, st.nc, st.nt, np.zeros(n_sites))[0]
    t_comp = t_comm * np.exp(rng.uniform(np.log(0.3), np.log(3.0), n_sites))
    model = CostModel.from_priors(sites, t_comp, spec, a=a, b=b)
    return SearchProblem.from_model(
        model, rules=rules, domain_override=domain_override, fingerprint={"synthetic_seed": seed, "cluster": spec.name}
    )


def scaling_table(sizes=(10, 100, 1000, 10000), *, rules: KnobRules, seed: int = 0) -> list[dict]:
    """Rows of (sites, method, model evaluations, wall time s, predicted speed-up)."""
    rows = []
    for n in sizes:
        problem = synthetic_problem(n_sites=n, seed=seed, rules=rules)
        for method in ("priority", "autoccl"):
            t0 = time.perf_counter()
            res = search(problem, method=method)
            wall = time.perf_counter() - t0
            rows.append(
                {
                    "sites": n,
                    "method": method,
                    "evaluations": res.stats["model_evaluations"],
                    "wall_s": wall,
                    "speedup": res.stats["predicted_speedup"],
                }
            )
    return rows


def optimality(*, rules: KnobRules, instances: int = 200, seed: int = 1, tol: float = 0.01) -> dict:
    """Share of small seeded instances (2-3 sites) with priority within ``tol`` of exhaustive; worst/mean/least gap."""
    within, worst, gaps = 0, 0.0, []
    for k in range(instances):
        n = 2 + k % 2
        problem = synthetic_problem(n_sites=n, seed=seed * 100_003 + k, rules=rules, domain_override=SMALL_DOMAINS)
        p = search(problem, method="priority").stats["predicted_iteration_us"]
        e = search(problem, method="exhaustive").stats["predicted_iteration_us"]
        gap = (p - e) / e
        gaps.append(gap)
        within += gap <= tol
        worst = max(worst, gap)
    return {
        "instances": instances,
        "within": within,
        "share": within / instances,
        "worst_gap": worst,
        "mean_gap": float(np.mean(gaps)),
        "least_gap": float(np.min(gaps)),
    }
