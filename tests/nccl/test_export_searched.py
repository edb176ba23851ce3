"""A searched plan always exports as the tuner table the apply path writes: the search ties the
sites NCCL's tuner plugin cannot tell apart with the same key (``rules.tuner_call_key``) that
``export.tuner_rows`` uses to refuse conflicting rows, so the export can never raise at apply time.
The plan comes from the simulated gpt3-13b cluster through the real ``Tuner`` (what
``lagom simulate --preset gpt3-13b-h100x64`` runs)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lagom_megatron.config.presets import load_preset
from lagom_megatron.engine.knobs import P2P_OPS, CommConfig
from lagom_megatron.nccl.export import TUNER_COLLECTIVE, export_plan, parse_tuner_csv, tuner_rows
from lagom_megatron.nccl.rules import NcclRules, tuner_call_key
from lagom_megatron.sim.backend import SimulatedCluster, run_lifecycle


@pytest.fixture(scope="module")
def plan():
    sim = SimulatedCluster(load_preset("gpt3-13b-h100x64"), seed=3)
    return run_lifecycle(sim, verify_iters=1, after_iters=0).tuner.plan


def test_the_search_and_the_exporter_share_one_key():
    rules = NcclRules(SimulatedCluster(load_preset("gpt3-13b-h100x64")).cluster, backend="sim")
    assert (
        rules.call_key(group="tp", op="reduce_scatter", nbytes=1 << 20)
        == tuner_call_key(group="tp", op="reduce_scatter", nbytes=1 << 20)
        == ("tp", "reduce_scatter", 1 << 20)
    )
    assert dataclasses.replace(rules, mechanism="communicator").call_key(group="tp", op="all_reduce", nbytes=8) is None


def test_simulated_gpt3_13b_plan_exports_in_extended_mode(plan):
    assert plan.mechanism == "tuner" and len(plan.entries) == 121
    # sites NCCL cannot tell apart hold one config, whether the search tied them afterwards
    # (plan.stats["tied_sites"]) or gave them one decision from the start (shared parameters)
    rows = tuner_rows(plan, extended=True)  # raises on a conflict: the test fails there
    table = parse_tuner_csv(export_plan(plan, "nccl-tuner-csv", extended=True))
    assert [tuple(r.values()) for r in table] == [r.cells for r in rows]
    # every tunable site is in exactly one row, and that row says what the plan holds for it
    in_rows = [s for r in rows for s in r.sites]
    tuned = [sid for sid, e in plan.entries.items() if e.op in TUNER_COLLECTIVE and not e.config.is_default()]
    assert sorted(in_rows) == sorted(tuned) and len(tuned) > 100
    for row in rows:
        cfgs = {plan.entries[s].config for s in row.sites}
        assert len(cfgs) == 1, row
        (c,) = cfgs
        assert row.cells[5] == str(c.n_channels if c.n_channels is not None else -1)
        assert row.cells[10] == str(c.chunk_size if c.chunk_size is not None else -1)
        assert row.cells[11] == plan.entries[row.sites[0]].group


def test_an_untied_plan_is_refused(plan):
    """The same plan with one tied site given another channel count: the exporter refuses it,
    so the test above would catch a search that stopped tying."""
    rows = [r for r in tuner_rows(plan, extended=True) if len(r.sites) > 1]
    sid = rows[0].sites[1]
    e = plan.entries[sid]
    other = 2 if e.config.n_channels != 2 else 4
    broken = dataclasses.replace(
        plan,
        entries={
            **plan.entries,
            sid: dataclasses.replace(e, config=CommConfig(**{**e.config.to_dict(), "n_channels": other})),
        },
    )
    with pytest.raises(ValueError, match=re.escape(f"sites {rows[0].sites[0]} and {sid} are the same collective")):
        tuner_rows(broken, extended=True)


def test_budget_fit_bounds_each_groups_entries_by_its_own_channels(plan, capsys):
    """Plugin entries get the CTA bounds of their own group's sites (the largest channel count
    among that group's tuned sites), not one plan-wide bound; the budget fit then keeps exactly the
    groups whose entry fits the default budget (512 MiB), in the estimate of ``estimate_entry_bytes``."""
    from lagom_megatron.megatron.control.apply import Applier
    from lagom_megatron.megatron.hooks.sites import GroupNames
    from lagom_megatron.megatron.pool.comm_pool import CommPool
    from lagom_megatron.nccl.pool import NcclPoolBackend, estimate_entry_bytes

    # the searched plan, with tp's tuned collectives at a channel count of their own: the groups' bounds then
    # differ whatever the search chose, and one plan-wide bound would be wrong for one of them
    dp_channels = max(e.config.n_channels or 0 for e in plan.entries.values() if e.group == "dp")
    tp_channels = 4 if dp_channels != 4 else 6
    plan = dataclasses.replace(
        plan,
        entries={
            sid: dataclasses.replace(e, config=dataclasses.replace(e.config, n_channels=tp_channels))
            if e.group == "tp" and e.op not in P2P_OPS and not e.config.is_default()
            else e
            for sid, e in plan.entries.items()
        },
    )
    tuned = [e for e in plan.entries.values() if not e.config.is_default()]
    collective = [e for e in tuned if e.op not in P2P_OPS]
    own = {}
    for e in collective:
        own[e.group] = max(own.get(e.group, 0), e.config.n_channels or 0)
    assert set(own) == {"tp", "dp"} and own["tp"] != own["dp"]
    pool = CommPool(NcclPoolBackend(use_tuner_plugin=True), GroupNames(local_world_size=8))
    fitted = Applier(pool=pool, router=None, files=None, cluster=None).fit_plan_to_budget(plan)
    assert pool.backend.cta_bounds == own
    assert pool.backend.estimate_bytes(CommConfig(n_channels=4), group="tp") == estimate_entry_bytes(own["tp"])
    # a tuned pipeline send/recv runs on an entry bounded at its own channel count (NCCL's P2P rule)
    p2p = {}
    for e in tuned:
        if e.op in P2P_OPS:
            p2p.setdefault(e.group, set()).add(e.config)
    assert pool.backend.p2p_configs == p2p
    for group, configs in p2p.items():
        for c in configs:
            assert pool.backend.estimate_bytes(c, group=group) == estimate_entry_bytes(c.n_channels)
    fits = {g for g, n in own.items() if estimate_entry_bytes(n) <= pool.budget_bytes}
    kept = {e.group for e in fitted.entries.values() if not e.config.is_default() and e.op not in P2P_OPS}
    assert kept == fits and fits
    dropped = sum(1 for e in collective if e.group not in fits)
    assert fitted.stats.get("sites_dropped_for_budget", 0) >= dropped


def test_the_search_respects_a_small_pool_budget():
    """With a budget of 160 MiB (80 MiB per group for tp and dp: 8 channels' ring buffers fit,
    9 do not), the search holds no channel count whose plugin entry would pass its group's share,
    and the budget fit then has nothing to drop: the plan searched is the plan applied."""
    from lagom_megatron.megatron.control.apply import Applier
    from lagom_megatron.megatron.hooks.sites import GroupNames
    from lagom_megatron.megatron.pool.comm_pool import CommPool
    from lagom_megatron.nccl.pool import RING_BUFFER_BYTES, NcclPoolBackend, channel_cap, estimate_entry_bytes

    budget = 160 * 2**20
    # three groups share it (tp, dp and the pipeline's send/recv, whose channels are bounded too)
    assert channel_cap(budget // 3) == 5 and 5 * RING_BUFFER_BYTES <= budget // 3 < 6 * RING_BUFFER_BYTES
    sim = SimulatedCluster(load_preset("gpt3-13b-h100x64"), seed=3)
    small = run_lifecycle(sim, verify_iters=1, after_iters=0, pool_budget_bytes=budget).tuner.plan
    tuned = [e for e in small.entries.values() if not e.config.is_default()]
    assert len(tuned) > 30  # still a tuned plan
    # every tuned site names its channels: one that moved only its chunk would keep NCCL's own 16-32 channels in its
    # pool entry, over the cap (NCCL 2.30.7 makes chunk a knob); such sites take the cap or go back to defaults
    assert all(e.config.n_channels is not None for e in tuned)
    assert small.stats["sites_reset_over_channel_cap"] > 0
    channels = {e.config.n_channels for e in tuned}
    assert max(channels) <= 5
    assert all(estimate_entry_bytes(n) <= budget // 3 for n in channels)
    pool = CommPool(NcclPoolBackend(use_tuner_plugin=True), GroupNames(local_world_size=8), budget_bytes=budget)
    fitted = Applier(pool=pool, router=None, files=None, cluster=None).fit_plan_to_budget(small)
    assert fitted is small and "sites_dropped_for_budget" not in fitted.stats


def test_the_budget_caps_the_channel_domain_per_mechanism():
    """``NcclRules`` with a budget: the channel domain stops at ``channel_cap`` of the groups' equal
    share (plugin and communicator mechanisms), NVLS heads count, ``env`` has no pool and no cap."""
    from lagom_megatron.engine.profile import CollectiveSite
    from lagom_megatron.nccl.pool import NVLS_BYTES_PER_CHANNEL_HEAD, RING_BUFFER_BYTES, channel_cap, group_share

    cluster = SimulatedCluster(load_preset("gpt3-13b-h100x64")).cluster
    budget = 40 * RING_BUFFER_BYTES
    rules = NcclRules(cluster, backend="sim", pool_budget_bytes=budget)
    assert rules.domains(op="all_reduce")["n_channels"][-1] == 32  # the whole budget: 40 channels fit, grid stops at 32
    sites = [
        CollectiveSite(site_id=f"{g}.x[0]", group=g, op=op, nbytes=1 << 20, dtype="bf16", group_size=8, n_nodes=1)
        for g, op in (("tp", "all_reduce"), ("dp", "reduce_scatter"), ("pp", "send"))
    ]
    shared = rules.for_sites(sites)
    # send/recv channels are bounded through the pp group's entries (NCCL's P2P rule): pp shares the budget
    assert shared.budget_groups == ("dp", "pp", "tp")
    assert shared.domains(op="send")["n_channels"] == (1, 2, 4, 8)  # powers of two up to the share's 13 channels
    assert group_share(budget, shared.budget_groups) == 40 * RING_BUFFER_BYTES // 3 and shared.channel_cap() == 13
    assert max(shared.domains(op="all_reduce")["n_channels"]) == 12
    cp = CollectiveSite(site_id="cp.x[0]", group="cp", op="all_gather", nbytes=1 << 20, dtype="bf16", group_size=2)
    comm = dataclasses.replace(rules, mechanism="communicator").for_sites(sites + [cp])
    assert comm.budget_groups == ("cp", "dp", "pp", "tp") and comm.channel_cap() == 10  # 40 / 4 channels' worth each
    assert max(comm.domains(op="all_gather")["n_channels"]) == 8
    two = rules.for_sites(sites[:2])
    nvls = dataclasses.replace(two, nvls_heads=8)
    per = RING_BUFFER_BYTES + 8 * NVLS_BYTES_PER_CHANNEL_HEAD
    assert nvls.channel_cap() == (20 * RING_BUFFER_BYTES) // per == channel_cap(20 * RING_BUFFER_BYTES, nvls_heads=8)
    assert dataclasses.replace(rules, mechanism="env").domains(op="all_reduce")["n_channels"][-1] == 64
    tiny = dataclasses.replace(rules, pool_budget_bytes=RING_BUFFER_BYTES - 1)
    assert tiny.channel_cap() == 0 and tiny.domains(op="all_reduce")["n_channels"] == (None,)
    assert rules.for_sites(sites) is not rules and NcclRules(cluster).for_sites(sites) == NcclRules(cluster)
