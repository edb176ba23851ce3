"""Exporters: Megatron's communicator YAML, NCCL's example tuner table, process-scope env."""

from __future__ import annotations

import pytest
import yaml

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.engine.search import search
from lagom_megatron.nccl.export import TUNER_COLUMNS, TUNER_EXTENDED_COLUMNS, export_plan, parse_tuner_csv, tuner_rows
from tests.timeouts import COMMAND_S

from ..engine.factory import build, site


def _mixed_plan(method="priority", mechanism=None):
    sites = [
        site(),
        site(site_id="tp.ar[0]", op="all_reduce", nbytes=2**16),
        site(site_id="dp.rs[0]", op="reduce_scatter", nbytes=2**26, group="dp", group_size=16, n_nodes=2),
        site(site_id="pp.send[0]", op="send", nbytes=2**22, group="pp", group_size=2, n_nodes=2),
    ]
    return search(build(sites=sites, comp_ratio=[3.0, 0.5, 2.0, 1.0], mechanism=mechanism), method=method).plan


def _entry(config, *, group="tp", op="all_gather", nbytes=1024):
    return PlanEntry(
        config=config,
        predicted_t_comm_us=1.0,
        predicted_t_region_us=1.0,
        group=group,
        op=op,
        nbytes=nbytes,
        group_size=8,
        n_nodes=1,
    )


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


def test_megatron_yaml_names_the_groups_on_high_priority_streams():
    # megatron-core 0.16.1 parallel_state.py:164 reads is_high_priority_stream per group into
    # ProcessGroupNCCL.Options: the key --high-priority-stream-groups sets (:770-773)
    plan = Plan(
        entries={
            "dp.ag[0]": _entry(CommConfig(high_priority_stream=True), group="dp"),
            "dp.ag[1]": _entry(CommConfig(n_channels=4, high_priority_stream=True), group="dp"),
            "tp.ag[0]": _entry(CommConfig(n_channels=8)),
        }
    )
    data = yaml.safe_load(export_plan(plan, "megatron-yaml"))
    assert data == {
        "dp": {"min_ctas": 1, "max_ctas": 4, "is_high_priority_stream": True},
        "tp": {"min_ctas": 1, "max_ctas": 8},
    }
    only = Plan(entries={"pp.send[0]": _entry(CommConfig(high_priority_stream=True), group="pp", op="send")})
    assert yaml.safe_load(export_plan(only, "megatron-yaml")) == {"pp": {"is_high_priority_stream": True}}
    # the tuner table has no stream priority: a priority alone gives no row
    assert tuner_rows(plan, extended=True)[0].sites == ("dp.ag[1]",) and len(tuner_rows(plan, extended=True)) == 2


def _explicit_plan():
    return Plan(
        entries={
            "tp.ag[0]": _entry(CommConfig(algorithm="Ring", protocol="LL", n_channels=4), nbytes=2**20),
            "tp.ar[0]": _entry(
                CommConfig(algorithm="Tree", protocol="Simple", n_channels=8), op="all_reduce", nbytes=2**16
            ),
            "dp.rs[0]": PlanEntry(
                config=CommConfig(algorithm="PAT", protocol="Simple", n_channels=2),
                predicted_t_comm_us=1.0,
                predicted_t_region_us=1.0,
                group="dp",
                op="reduce_scatter",
                nbytes=2**26,
                group_size=16,
                n_nodes=2,
            ),
            "pp.send[0]": _entry(CommConfig(n_channels=2), group="pp", op="send"),
        }
    )


def test_tuner_csv_matches_nccl_example_plugin_columns():
    plan = _explicit_plan()
    text = export_plan(plan, "nccl-tuner-csv")
    assert "# " + ",".join(TUNER_COLUMNS) in text
    rows = parse_tuner_csv(text)
    assert len(rows) == 3 and all(len([v for v in r.values() if v is not None]) == 10 for r in rows)
    by_type = {r["collective_type"]: r for r in rows}
    assert set(by_type) == {"allgather", "allreduce", "reducescatter"}  # no send/recv rows
    assert [by_type["allgather"][k] for k in TUNER_COLUMNS] == [
        "allgather",
        "1048576",
        "1048576",
        "ring",
        "ll",
        "4",
        "-1",
        "8",
        "-1",
        "-1",
    ]
    assert [by_type["reducescatter"][k] for k in TUNER_COLUMNS] == [
        "reducescatter",
        "67108864",
        "67108864",
        "pat",
        "simple",
        "2",
        "-1",
        "16",
        "-1",
        "-1",
    ]
    assert "-1" not in (
        by_type["allreduce"]["algorithm"],
        by_type["allreduce"]["protocol"],
        by_type["allreduce"]["channels"],
    )


def test_tuner_csv_refuses_what_nccl_example_plugin_misreads():
    """NCCL's example plugin reads algorithm -1 as ring, protocol -1 as simple, channels -1 as its
    preset of 1 channel, and has no chunk column (plugins/tuner/example/plugin.c, NCCL v2.30.7,
    :81-112, :236, :361): the 10-column export refuses such sites instead of writing them."""
    for config, fragment in (
        (CommConfig(protocol="LL", n_channels=4), "leaves algorithm to NCCL"),
        (CommConfig(algorithm="Ring", n_channels=4), "leaves protocol to NCCL"),
        (CommConfig(algorithm="Ring", protocol="LL"), "leaves channels to NCCL"),
        (CommConfig(algorithm="Ring", protocol="LL", n_channels=4, chunk_size=131072), "sets chunk size 131072"),
    ):
        with pytest.raises(ValueError, match=f"site tp.x {fragment}: NCCL's example tuner plugin"):
            export_plan(Plan(entries={"tp.x": _entry(config)}), "nccl-tuner-csv")
    assert parse_tuner_csv(export_plan(_mixed_plan(), "nccl-tuner-csv", extended=True)), "the extended table takes -1"


def test_tuner_csv_extended_columns_and_name_mapping():
    plan = Plan(
        entries={
            "tp.ar": _entry(
                CommConfig(algorithm="NVLSTree", protocol="LL128", n_channels=4, chunk_size=144000), op="all_reduce"
            ),
            "tp.ar.twin": _entry(
                CommConfig(algorithm="NVLSTree", protocol="LL128", n_channels=4, chunk_size=144000), op="all_reduce"
            ),
            "dp.ag": _entry(CommConfig(algorithm="CollNetDirect", protocol="Simple"), group="dp", nbytes=4096),
        }
    )
    text = export_plan(plan, "nccl-tuner-csv", extended=True)
    rows = parse_tuner_csv(text)
    assert all(len(r) == len(TUNER_EXTENDED_COLUMNS) for r in rows)
    assert [(r["algorithm"], r["protocol"], r["channels"], r["chunkSize"], r["commTag"]) for r in rows] == [
        ("nvls_tree", "ll128", "4", "144000", "tp"),
        ("collnet_direct", "simple", "-1", "-1", "dp"),
    ]
    assert [row.sites for row in tuner_rows(plan, extended=True)] == [("tp.ar", "tp.ar.twin"), ("dp.ag",)]
    assert "# tp.ar tp.ar.twin\n" in text
    with pytest.raises(ValueError, match="expected 10 or 12 columns; got 3"):
        parse_tuner_csv("allreduce,1,2\n")


def test_tuner_csv_refuses_sites_nccl_cannot_tell_apart_with_different_configs():
    plan = Plan(
        entries={
            "tp.rs[0]": _entry(CommConfig(algorithm="Ring", protocol="Simple", n_channels=12), op="reduce_scatter"),
            "tp.rs[1]": _entry(
                CommConfig(algorithm="Ring", protocol="Simple", n_channels=16, chunk_size=262144), op="reduce_scatter"
            ),
        }
    )
    with pytest.raises(
        ValueError,
        match=r"sites tp.rs\[0\] and tp.rs\[1\] are the same collective to a tuner plugin "
        r"\(tag 'tp', reducescatter, 1024 bytes, 8 ranks\)",
    ):
        export_plan(plan, "nccl-tuner-csv", extended=True)
    other_group = Plan(
        entries={
            **plan.entries,
            "tp.rs[1]": _entry(plan.entries["tp.rs[1]"].config, group="tp_cp", op="reduce_scatter"),
        }
    )
    assert len(tuner_rows(other_group, extended=True)) == 2, "another communicator tag is another row"


def test_env_lists_process_scope_knobs_only_and_refuses_unsafe_values():
    plan = _mixed_plan()
    text = export_plan(plan, "env")
    lines = [l for l in text.splitlines() if not l.startswith("#")]
    assert all(l.startswith("export NCCL_") for l in lines)
    assert {l.split("=")[0][len("export ") :] for l in lines} <= {"NCCL_NTHREADS"}
    for env, fragment in (({"NCCL_PROTO": "LL128"}, "LL128"), ({"NCCL_ALGO": "NVLS"}, "Ring")):
        with pytest.raises(ValueError, match=fragment):
            export_plan(Plan(entries={}, env=env), "env")


def test_env_values_are_quoted_and_source_to_the_same_value(tmp_path):
    """`;` in a per-function NCCL_ALGO list must reach the variable, never run as a command."""
    import subprocess

    value = "allreduce:tree,ring;allgather:ring"
    text = export_plan(Plan(entries={}, env={"NCCL_ALGO": value}), "env")
    assert f"export NCCL_ALGO='{value}'" in text
    env_file = tmp_path / "plan.env"
    env_file.write_text(text)
    proc = subprocess.run(
        ["bash", "-c", f"set -a; . {env_file}; env"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        timeout=COMMAND_S,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert [l for l in proc.stdout.splitlines() if l.startswith("NCCL_")] == [f"NCCL_ALGO={value}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.env"], "sourcing created nothing"


def test_unknown_format_and_gloo_plans():
    with pytest.raises(
        ValueError, match=r"format must be one of \['megatron-yaml', 'nccl-tuner-csv', 'env'\]; got 'xml'"
    ):
        export_plan(Plan(entries={}), "xml")
    with pytest.raises(ValueError, match="backend 'gloo'"):
        export_plan(Plan(entries={}, backend="gloo"), "nccl-tuner-csv")
