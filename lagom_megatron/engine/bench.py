"""``lagom bench search``: search cost and quality on seeded synthetic problems.

Prints two tables:

1. For 10, 100, 1,000 and 10,000 sites: model evaluations and wall time of ``priority`` and
   ``autoccl`` (DESIGN.md section 8: a plan for 10,000 sites in under 2 s on one core;
   evaluations linear in sites).
2. For ``--instances`` (default 200) seeded small instances: how often ``priority`` is within 1%
   of ``exhaustive``'s optimum on the cost model (target: at least 95%).

Synthetic sites mimic a Megatron iteration: data-parallel reduce-scatter / all-gather buckets
across nodes, tensor-parallel all-gather / reduce-scatter inside a node, a few all-reduces and
pipeline sends, with compute beside each that ranges from much shorter to much longer than the
collective, and per-region slowdown coefficients drawn around the priors.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.problem import SearchProblem
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.engine.search import search

SMALL_DOMAINS = {"n_channels": (2, 4, 8, 16, 32), "chunk_size": (None, 131072, 524288), "n_threads": (256, 512)}
"""Knob domains of the small instances (exhaustive must enumerate their joint product)."""

_KINDS = (
    # (group, op, group_size, n_nodes, log2 bytes low, high)
    ("dp", "reduce_scatter", 16, 2, 22, 28),
    ("dp", "all_gather", 16, 2, 22, 28),
    ("tp", "all_gather", 8, 1, 18, 26),
    ("tp", "reduce_scatter", 8, 1, 18, 26),
    ("tp", "all_reduce", 8, 1, 14, 24),
    ("pp", "send", 2, 2, 18, 24),
)


def synthetic_problem(*, n_sites: int, seed: int, cluster: "ClusterSpec | str" = "h100-sxm-ib400",
                      domain_override: dict | None = None, mechanism: str | None = None) -> SearchProblem:
    """A seeded synthetic SearchProblem of ``n_sites`` sites on ``cluster`` (cost model from priors).

    Compute beside each collective is its default T_comm times a log-uniform factor in [0.3, 3]
    (both regimes occur); slowdown coefficients a, b are log-uniform in [0.3, 3] x prior.
    """
    spec = ClusterSpec.load(cluster)
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, len(_KINDS), n_sites)
    sites = []
    for j, k in enumerate(kinds):
        group, op, n, nodes, lo, hi = _KINDS[k]
        nbytes = int(2 ** rng.uniform(lo, hi)) // 256 * 256 + 256
        sites.append(CollectiveSite(site_id=f"{group}.{op}[{j}]", op=op, nbytes=nbytes, dtype="bf16", group=group,
                                    group_size=n, n_nodes=nodes))
    a = np.exp(rng.uniform(np.log(0.3), np.log(3.0), n_sites))
    b = np.exp(rng.uniform(np.log(0.3), np.log(3.0), n_sites))
    probe = CostModel.from_priors(sites, np.ones(n_sites), spec, a=a, b=b)
    st = SearchProblem.from_model(probe, mechanism=mechanism).default_state()
    t_comm = probe.evaluate(np.arange(n_sites), st.alg, st.proto, st.nc, st.nt, np.zeros(n_sites))[0]
    t_comp = t_comm * np.exp(rng.uniform(np.log(0.3), np.log(3.0), n_sites))
    model = CostModel.from_priors(sites, t_comp, spec, a=a, b=b)
    return SearchProblem.from_model(model, mechanism=mechanism, domain_override=domain_override,
                                    fingerprint={"synthetic_seed": seed, "cluster": spec.name})


def scaling_table(sizes=(10, 100, 1000, 10000), *, seed: int = 0, cluster: str = "h100-sxm-ib400") -> list[dict]:
    """Rows of (sites, method, model evaluations, wall time s, predicted speed-up)."""
    rows = []
    for n in sizes:
        problem = synthetic_problem(n_sites=n, seed=seed, cluster=cluster)
        for method in ("priority", "autoccl"):
            t0 = time.perf_counter()
            res = search(problem, method=method)
            wall = time.perf_counter() - t0
            rows.append({"sites": n, "method": method, "evaluations": res.stats["model_evaluations"],
                         "wall_s": wall, "speedup": res.stats["predicted_speedup"]})
    return rows


def optimality(*, instances: int = 200, seed: int = 1, cluster: str = "h100-sxm-ib400", tol: float = 0.01) -> dict:
    """Share of small seeded instances (2-3 sites) where priority is within ``tol`` of exhaustive."""
    within, worst, gaps = 0, 0.0, []
    for k in range(instances):
        n = 2 + k % 2
        problem = synthetic_problem(n_sites=n, seed=seed * 100_003 + k, cluster=cluster, domain_override=SMALL_DOMAINS)
        p = search(problem, method="priority").stats["predicted_iteration_us"]
        e = search(problem, method="exhaustive").stats["predicted_iteration_us"]
        gap = (p - e) / e
        gaps.append(gap)
        within += gap <= tol
        worst = max(worst, gap)
    return {"instances": instances, "within": within, "share": within / instances, "worst_gap": worst,
            "mean_gap": float(np.mean(gaps))}


def main(argv: list[str] | None = None) -> int:
    """Runs both benchmarks and prints the tables. Returns 0 when both targets are met, else 1."""
    parser = argparse.ArgumentParser(prog="lagom bench search", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10000], help="site counts to time")
    parser.add_argument("--instances", type=int, default=200, help="small instances compared with exhaustive")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cluster", default="h100-sxm-ib400")
    args = parser.parse_args(argv)
    if args.instances < 1 or min(args.sizes) < 1:
        raise ValueError(f"--sizes and --instances must be >= 1; got {args.sizes}, {args.instances}")
    print(f"search scaling on {args.cluster} (seed {args.seed})")
    print(f"{'sites':>7} {'method':>9} {'model evals':>12} {'evals/site':>10} {'wall s':>8} {'pred. speedup':>13}")
    rows = scaling_table(args.sizes, seed=args.seed, cluster=args.cluster)
    for r in rows:
        print(f"{r['sites']:>7} {r['method']:>9} {r['evaluations']:>12,} {r['evaluations'] / r['sites']:>10.1f} "
              f"{r['wall_s']:>8.3f} {r['speedup']:>13.4f}")
    opt = optimality(instances=args.instances, seed=args.seed + 1, cluster=args.cluster)
    print(f"\npriority vs exhaustive on {opt['instances']} seeded instances of 2-3 sites:")
    print(f"  within 1% of the optimum: {opt['within']}/{opt['instances']} = {100 * opt['share']:.1f}%  "
          f"(mean gap {100 * opt['mean_gap']:.3f}%, worst {100 * opt['worst_gap']:.2f}%)")
    big = [r for r in rows if r["method"] == "priority" and r["sites"] == max(args.sizes)]
    ok_time = all(r["wall_s"] < 2.0 for r in big) if max(args.sizes) >= 10000 else True
    ok_opt = opt["share"] >= 0.95
    print(f"\ntargets: {max(args.sizes):,} sites < 2 s: {'met' if ok_time else 'NOT met'}; "
          f">= 95% within 1%: {'met' if ok_opt else 'NOT met'}")
    return 0 if ok_time and ok_opt else 1
