"""``exhaustive`` is the optimum of the space the priority search returns plans from, on the objective
it is judged by (the plan's predicted iteration, ``SearchProblem.make_plan``), so the priority search's
gap to it is never negative: the knobs decided after a search (channels per network peer, a group's
high-priority stream) are enumerated with the rest, sites the mechanism cannot tell apart share one
config, and the priority search's channel-cap candidates stay in every site's domain and in the
knob's scope."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lagom_megatron.engine.bench import SMALL_DOMAINS, optimality, synthetic_problem
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.descent import Counter
from lagom_megatron.engine.priority import capped_channels, group_caps_state
from lagom_megatron.engine.search import search
from lagom_megatron.megatron.pool.comm_pool import rules_for
from lagom_megatron.nccl.rules import NcclRules

from .factory import synthetic


def _with_waits(problem, seed):
    """``problem`` whose sites (about 70% of them) wait up to 30% of their default T_comm for SMs at
    normal priority (``CostModel.wait_S``), so a group's high-priority stream is worth deciding."""
    rng = np.random.default_rng(seed)
    t = problem.evaluate(problem.default_state())[0]
    problem.model.wait_S = rng.uniform(0.0, 0.3, len(problem.sites)) * t * (rng.random(len(problem.sites)) < 0.7)
    problem.model.mark_queues()
    return problem


def _gap(problem):
    p = search(problem, method="priority").stats["predicted_iteration_us"]
    e = search(problem, method="exhaustive")
    return (p - e.stats["predicted_iteration_us"]) / e.stats["predicted_iteration_us"], e.plan


@pytest.mark.parametrize(
    "cluster, mechanism, above, fast, peer",
    [
        ("h100-sxm-ib400", None, 6, 7, 0),
        ("a100-ib100", None, 3, 7, 0),
        ("h200-sxm", None, 7, 7, 0),
        ("h100-sxm-ib400", "communicator", 6, 7, 0),
        ("h100-sxm-ib400", "env", 0, 0, 1),
    ],
)
def test_priority_never_beats_the_optimum(cluster, mechanism, above, fast, peer):
    """16 problems of 2-3 sites per cluster and mechanism, half with dispatch waits: the gap is never
    negative; ``above`` of them have one above 0; in ``fast`` the optimum puts a group on a
    high-priority stream, in ``peer`` it sets the channels per network peer (so both are searched).

    Under ``env`` two problems' optimum (seeds 5,006 and 5,007 with waits, each with a pipeline send
    across nodes) runs 4 channels per network peer where NCCL 2.27.5 runs 2 (v2.27.5 paths.cc:798-867).
    The preset's NCCL 2.30.7 runs 4 itself, max(1 NIC, divUp(50 GB/s, 14)) (v2.30.7
    src/graph/topo.cc:1974-2000; ``engine.p2p.peer_channels``), so seed 5,007's optimum is NCCL's own
    and exhaustive keeps it unset (ties keep NCCL's); seed 5,006's sets 8: one problem sets it."""
    gaps, n_fast, n_peer = [], 0, 0
    for k in range(8):
        for waits in (False, True):
            problem = synthetic(
                n_sites=2 + k % 2, seed=5000 + k, cluster=cluster, mechanism=mechanism, domain_override=SMALL_DOMAINS
            )
            gap, plan = _gap(_with_waits(problem, k) if waits else problem)
            gaps.append(gap)
            n_fast += any(e.config.high_priority_stream for e in plan.entries.values())
            n_peer += "NCCL_NCHANNELS_PER_NET_PEER" in plan.env or any(
                e.config.net_peer_channels for e in plan.entries.values()
            )
    assert min(gaps) >= -1e-9, [round(g, 6) for g in gaps]
    assert max(gaps) < 0.06  # and priority stays close to it
    assert (sum(g > 1e-9 for g in gaps), n_fast, n_peer) == (above, fast, peer)


def test_the_bench_instances_have_no_negative_gap():
    rules = NcclRules(ClusterSpec.load("h100-sxm-ib400"))
    opt = optimality(rules=rules, instances=40, seed=1)
    assert opt["least_gap"] >= -1e-9 and opt["mean_gap"] >= 0.0
    assert opt["within"] >= 38


def test_channels_per_net_peer_are_chosen_with_the_rest():
    """Bench instance 7 (seed 100,010): a pipeline send across nodes. The priority plan's channels per
    network peer are decided on its final state; the optimum enumerates them with the other channel
    counts. Exhaustive used to decide them after its own search too and predicted more than priority
    (the bench's negative gaps). At the per-CTA prior of NCCL's graph (15 / 10 GB/s) both take 16.
    The instance was recorded on NCCL 2.27.5 (2 channels per network peer of its own), so it names
    that version; on the preset's 2.30.7 both still take 16 and priority is never below the optimum."""
    spec = dataclasses.replace(ClusterSpec.load("h100-sxm-ib400"), nccl_version="2.27.5")
    rules = rules_for(spec.backend, spec, None)
    problem = synthetic_problem(n_sites=3, seed=100_010, rules=rules, domain_override=SMALL_DOMAINS)
    p = search(problem, method="priority")
    e = search(problem, method="exhaustive")
    assert p.plan.env["NCCL_NCHANNELS_PER_NET_PEER"] == "16" and p.stats["predicted_iteration_us"] == 273.222
    assert e.plan.env["NCCL_NCHANNELS_PER_NET_PEER"] == "16" and e.stats["predicted_iteration_us"] == 272.621
    problem = synthetic(n_sites=3, seed=100_010, domain_override=SMALL_DOMAINS)
    p = search(problem, method="priority")
    e = search(problem, method="exhaustive")
    assert p.plan.env["NCCL_NCHANNELS_PER_NET_PEER"] == e.plan.env["NCCL_NCHANNELS_PER_NET_PEER"] == "16"
    assert p.stats["predicted_iteration_us"] >= e.stats["predicted_iteration_us"]


def test_channel_caps_stay_in_the_domain_and_the_scope():
    # bench instance 122: NCCL picks 20 channels for the all-reduce, whose narrowed domain starts at 2;
    # a per-group cap of 1 used to give it 1 channel, outside its domain
    problem = synthetic(n_sites=2, seed=100_125, domain_override=SMALL_DOMAINS)
    default = problem.default_state()
    assert default.nc.tolist() == [16.0, 20.0] and problem.domains_S[1]["n_channels"] == (2, 4, 8, 16, 32)
    assert group_caps_state(problem, default.nc.copy(), Counter()).nc.tolist() == [16.0, 2.0]
    idx = np.array([0, 1])
    assert capped_channels(problem, idx, default.nc[idx], 1.0).tolist() == [2.0, 2.0]
    assert capped_channels(problem, idx, default.nc[idx], 12.0).tolist() == [8.0, 8.0]
    assert capped_channels(problem, idx, default.nc[idx], 64.0).tolist() == [16.0, 20.0]  # NCCL's own stands
    # the env mechanism sets one channel count per process: no cap per group (instance 5,009 used to
    # plan 4 channels for the data-parallel gather and 32 for the others, undeployable)
    env = synthetic(n_sites=3, seed=5009, mechanism="env", domain_override=SMALL_DOMAINS)
    d = env.default_state()
    assert env.scope["n_channels"] == "process" and d.nc.tolist() == [32.0, 16.0, 32.0]
    assert group_caps_state(env, d.nc.copy(), Counter()).nc.tolist() == [32.0, 16.0, 32.0]
    assert search(env, method="priority").stats["predicted_iteration_us"] == 341.673
    assert search(env, method="exhaustive").stats["predicted_iteration_us"] == 341.673
