"""The seam between the plan table and the pool in plugin mode, single process (gloo world of
one, entry creation replaced by a stand-in that records what ``create_nccl_pool_entry`` gets):
the table each entry is created with is the file ``NcclPoolBackend.load_table`` wrote, its rows
are ``export.tuner_rows(plan, extended=True)`` in order (what ``plan_hit_summary`` indexes the
plugin's counters with), and every entry's communicator tag is ``<row commTag>/...``, which the
plugin's ``tagMatches`` (``plugin/table.c``) accepts, for the Transformer Engine sites (named by
module) as for the others."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.megatron.control.apply import Applier
from lagom_megatron.megatron.hooks.sites import GroupNames
from lagom_megatron.megatron.outputs.run_files import RunFiles
from lagom_megatron.megatron.pool.comm_pool import CommPool
from lagom_megatron.nccl import pool as nccl_pool
from lagom_megatron.nccl.export import parse_tuner_csv, tuner_rows
from lagom_megatron.nccl.plugin_status import PluginStatus


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _entry(group, op, nbytes, config):
    return PlanEntry(
        config=config,
        predicted_t_comm_us=1.0,
        predicted_t_region_us=2.0,
        predicted_default_t_region_us=3.0,
        group=group,
        op=op,
        nbytes=nbytes,
        group_size=1,
        n_nodes=1,
    )


def test_entries_load_the_rows_plan_hit_summary_reads_under_the_rows_tags(world, tmp_path, monkeypatch):
    from lagom_megatron.megatron import groups as group_names

    monkeypatch.setattr(group_names, "_group_ranks", lambda g: (0,))
    groups = GroupNames(local_world_size=1)
    for name in ("tp", "dp_cp", "expt_dp"):
        groups.add(name, type("G", (), {})())
    created = []

    def fake_create(ranks, config, *, tag, use_tuner_plugin, tuner_table=None, inherited=None, **kw):
        created.append({"tag": tag, "plugin": use_tuner_plugin, "table": tuner_table, "config": config})
        return object()

    monkeypatch.setattr(nccl_pool, "create_nccl_pool_entry", fake_create)
    monkeypatch.setattr(nccl_pool, "runtime_nccl_version", lambda: (2, 30, 3))
    # a torch that binds every NCCLConfig field (2.8+), whatever torch runs the test (2.6 binds no cta_policy)
    from lagom_megatron.nccl.options import KNOWN_CONFIG_FIELDS

    monkeypatch.setattr(nccl_pool, "nccl_config_fields", lambda options_cls=None: frozenset(KNOWN_CONFIG_FIELDS))
    inits = {"n": 0}

    def status():
        return PluginStatus(path="lib", abi_version=6, init_count=inits["n"], row_hits=(), table_loaded=True)

    backend = nccl_pool.NcclPoolBackend(use_tuner_plugin=True, status_reader=status)
    pool = CommPool(backend, groups)
    plan = Plan(
        backend="nccl",
        mechanism="tuner",
        entries={
            "tp.sp_all_gather[chunk0.decoder.layers.3.self_attention.linear_qkv]": _entry(
                "tp", "all_gather", 1 << 22, CommConfig(protocol="LL128", n_channels=8)
            ),
            "tp.sp_reduce_scatter[chunk0.decoder.layers.3.self_attention.linear_proj]": _entry(
                "tp", "reduce_scatter", 1 << 22, CommConfig(n_channels=16, chunk_size=262144)
            ),
            "dp_cp.grad_reduce_scatter[chunk0.bucket0]": _entry(
                "dp_cp", "reduce_scatter", 1 << 26, CommConfig(n_channels=4)
            ),
            "expt_dp.grad_reduce_scatter[chunk0.bucket0]": _entry(
                "expt_dp", "reduce_scatter", 1 << 24, CommConfig(algorithm="Ring", cta_policy="EFFICIENCY")
            ),
        },
    )
    files = RunFiles(plan_path=str(tmp_path / "plan.json"))
    a = Applier(pool=pool, router=None, files=files, cluster=None)
    monkeypatch.setattr(backend, "preflight", _counting(backend.preflight, inits))
    assert a.apply_plan(plan) is True, a.error
    table = tmp_path / "tuner_table.rank0.csv"
    rows = tuner_rows(plan, extended=True)
    assert [tuple(r.values()) for r in parse_tuner_csv(table.read_text())] == [r.cells for r in rows]
    assert {c["table"] for c in created} == {str(table)} and all(c["plugin"] for c in created)
    row_tags = {r.cells[11] for r in rows}
    assert row_tags == {"tp", "dp_cp", "expt_dp"}
    for c in created:  # plugin/table.c tagMatches: the row tag, then '/'
        assert c["tag"].split("/")[0] in row_tags and c["tag"].startswith(c["tag"].split("/")[0] + "/"), c["tag"]
    # CTA bounds per group: the largest channel count of the group's sites (none set: NCCL's own)
    assert {c["tag"].split("/")[0]: c["config"].n_channels for c in created} == {"tp": 16, "dp_cp": 4, "expt_dp": None}
    assert sorted(c["tag"].split("/")[0] for c in created) == ["dp_cp", "expt_dp", "tp"]  # one entry per group and key
    # the TE sites' calls are routed to the entry of their group (the router asks group_for)
    te = plan.entries["tp.sp_all_gather[chunk0.decoder.layers.3.self_attention.linear_qkv]"]
    assert pool.group_for(groups.by_name("tp"), te.config) is not None


def _counting(preflight, inits):
    """``preflight`` as is, and one more plugin init per entry (what NCCL does at creation)."""

    def wrapped(config, op=None, group=None):
        preflight(config, op, group)
        inits["n"] += 1

    return wrapped
