"""The search's pruning changes no plan: descents that rescan only the sites the last pass moved, and reuse a
site's descent where it starts as in an earlier one, give the plans of the full rescans on ``lagom bench search``'s
sites, with fewer model evaluations."""

from __future__ import annotations

import pytest

from lagom_megatron.engine import descent, priority
from lagom_megatron.engine.bench import SMALL_DOMAINS, synthetic_problem
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.search import search
from lagom_megatron.nccl.rules import NcclRules


def _full_rescan(problem, st, idx, knobs, objective, count, rounds, min_gain=0.0):
    for _ in range(rounds):
        changed = False
        for knob in knobs:
            changed |= descent.scan_knob(problem, st, idx, knob, objective, count, min_gain).size > 0
        if not changed:
            return


class _NoMemo:
    def descend(self, problem, st, idx, knobs, objective, count, rounds):
        _full_rescan(problem, st, idx, knobs, objective, count, rounds)


def _plans(problems):
    out = []
    for p in problems:
        r = search(p, method="priority")
        configs = {k: e.config for k, e in r.plan.entries.items()}
        out.append(
            (configs, r.plan.env, r.stats["predicted_iteration_us"], r.stats["candidate"], r.stats["model_evaluations"])
        )
    return out


@pytest.mark.parametrize("cluster", ["h100-sxm-ib400", "a40-pcie-ib200"])
def test_pruned_search_finds_the_plans_of_the_full_one(cluster, monkeypatch):
    rules = NcclRules(ClusterSpec.load(cluster))
    problems = [synthetic_problem(n_sites=n, seed=0, rules=rules) for n in (10, 100, 1000)]
    problems += [
        synthetic_problem(n_sites=2 + k % 2, seed=100_003 + k, rules=rules, domain_override=SMALL_DOMAINS)
        for k in range(20)
    ]
    pruned = _plans(problems)
    monkeypatch.setattr(descent, "descend", _full_rescan)
    monkeypatch.setattr(priority, "descend", _full_rescan)
    monkeypatch.setattr(priority, "DescentMemo", _NoMemo)
    full = _plans(problems)
    assert [p[:4] for p in pruned] == [f[:4] for f in full]
    # the 1,000-site problem: at least a quarter fewer evaluations
    assert pruned[2][4] < 0.75 * full[2][4]
