"""Exporters: Megatron's communicator YAML, NCCL's example tuner table, process-scope env."""

from __future__ import annotations

import pytest
import yaml

from lagom_megatron.nccl.export import TUNER_COLUMNS, TUNER_EXTENDED_COLUMNS, export_plan, parse_tuner_csv
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.engine.search import search

from ..engine.factory import build, site


def _mixed_plan(method="priority", mechanism=None):
    sites = [site(), site(site_id="tp.ar[0]", op="all_reduce", nbytes=2**16),
             site(site_id="dp.rs[0]", op="reduce_scatter", nbytes=2**26, group="dp", group_size=16, n_nodes=2),
             site(site_id="pp.send[0]", op="send", nbytes=2**22, group="pp", group_size=2, n_nodes=2)]
    return search(build(sites=sites, comp_ratio=[3.0, 0.5, 2.0, 1.0], mechanism=mechanism), method=method).plan


def _entry(config, *, group="tp", op="all_gather", nbytes=1024):
    return PlanEntry(config=config, predicted_t_comm_us=1.0, predicted_t_region_us=1.0, group=group, op=op, nbytes=nbytes,
                     group_size=8, n_nodes=1)


def test_megatron_yaml_has_both_cta_ends_per_group():
    plan = _mixed_plan()
    data = yaml.safe_load(export_plan(plan, "megatron-yaml"))
    assert set(data) == {"tp", "dp"}  # pp (send/recv) is not CTA-capped through the tuner
    for group, cfg in data.items():
        assert set(cfg) == {"min_ctas", "max_ctas"}
        chosen = [e.config.n_channels for e in plan.entries.values() if e.group == group]
        assert (cfg["min_ctas"], cfg["max_ctas"]) == (1, max(chosen))


def test_megatron_yaml_never_empty_and_checks_ranges():
    plan = Plan(entries={"pp.send[0]": _entry(CommConfig(), group="pp", op="send")})
    text = export_plan(plan, "megatron-yaml")
    assert yaml.safe_load(text) == {}
    bad = Plan(entries={"tp.x": _entry(CommConfig(n_channels=99))})
    with pytest.raises(ValueError, match="max_ctas 99 is not allowed; allowed: integers 1..64"):
        export_plan(bad, "megatron-yaml")


def test_megatron_yaml_communicator_mechanism_writes_the_searched_cap():
    plan = _mixed_plan(mechanism="communicator")
    data = yaml.safe_load(export_plan(plan, "megatron-yaml"))
    for group, cfg in data.items():
        caps = {e.config.n_channels for e in plan.entries.values() if e.group == group}
        assert cfg == {"min_ctas": 1, "max_ctas": max(caps)}


def test_tuner_csv_matches_nccl_example_plugin_columns():
    plan = _mixed_plan()
    text = export_plan(plan, "nccl-tuner-csv")
    assert "# " + ",".join(TUNER_COLUMNS) in text
    rows = parse_tuner_csv(text)
    assert len(rows) == 3 and all(len([v for v in r.values() if v is not None]) == 10 for r in rows)
    by_type = {r["collective_type"]: r for r in rows}
    assert set(by_type) == {"allgather", "allreduce", "reducescatter"}  # no send/recv rows
    ag = plan.entries["tp.ag[0]"]
    row = by_type["allgather"]
    assert (row["min_bytes"], row["max_bytes"]) == (str(ag.nbytes), str(ag.nbytes))
    assert row["channels"] == str(ag.config.n_channels) and (row["nNodes"], row["nRanks"]) == ("1", "8")
    assert row["protocol"] in ("ll", "ll128", "simple", "-1")
    assert row["algorithm"] in ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat", "-1")
    assert (row["numPipeOps"], row["regBuff"]) == ("-1", "-1")


def test_tuner_csv_extended_columns_and_name_mapping():
    plan = Plan(entries={
        "tp.ar": _entry(CommConfig(algorithm="NVLSTree", protocol="LL128", n_channels=4, chunk_size=144000), op="all_reduce"),
        "tp.ar.twin": _entry(CommConfig(algorithm="Ring", protocol="LL", n_channels=2), op="all_reduce"),
        "dp.ag": _entry(CommConfig(algorithm="CollNetDirect", protocol="Simple"), group="dp", nbytes=4096),
    })
    text = export_plan(plan, "nccl-tuner-csv", extended=True)
    rows = parse_tuner_csv(text)
    assert all(len(r) == len(TUNER_EXTENDED_COLUMNS) for r in rows)
    assert [(r["algorithm"], r["protocol"], r["channels"], r["chunkSize"], r["commTag"]) for r in rows] == [
        ("nvls_tree", "ll128", "4", "144000", "tp"), ("collnet_direct", "simple", "-1", "-1", "dp")]
    assert "same (communicator, collective, size) as tp.ar" in text
    with pytest.raises(ValueError, match="expected 10 or 12 columns; got 3"):
        parse_tuner_csv("allreduce,1,2\n")


def test_env_lists_process_scope_knobs_only_and_refuses_unsafe_values():
    plan = _mixed_plan()
    text = export_plan(plan, "env")
    lines = [l for l in text.splitlines() if not l.startswith("#")]
    assert all(l.startswith("export NCCL_") for l in lines)
    assert {l.split("=")[0][len("export "):] for l in lines} <= {"NCCL_NTHREADS"}
    for env, fragment in (({"NCCL_PROTO": "LL128"}, "LL128"), ({"NCCL_ALGO": "NVLS"}, "Ring")):
        with pytest.raises(ValueError, match=fragment):
            export_plan(Plan(entries={}, env=env), "env")


def test_unknown_format_and_gloo_plans():
    with pytest.raises(ValueError, match=r"format must be one of \['megatron-yaml', 'nccl-tuner-csv', 'env'\]; got 'xml'"):
        export_plan(Plan(entries={}), "xml")
    with pytest.raises(ValueError, match="backend 'gloo'"):
        export_plan(Plan(entries={}, backend="gloo"), "nccl-tuner-csv")
