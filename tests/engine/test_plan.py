"""Plan files: round trip, digest, fingerprint checks, corrupted files."""

from __future__ import annotations

import json

import pytest

from lagom_megatron.config.plan_files import load_plan
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import PLAN_SCHEMA_VERSION, Plan, PlanEntry, diff_plans
from lagom_megatron.engine.search import search

from .factory import build, site


def _plan():
    problem = build(sites=[site(), site(site_id="tp.ag[1]", nbytes=2**20)], comp_ratio=[3.0, 0.5])
    return search(problem, method="priority").plan


def test_schema_version_is_frozen():
    assert PLAN_SCHEMA_VERSION == 1, "changing the plan format needs a new version and a migration note"


def test_round_trip_and_atomic_write(tmp_path):
    plan = _plan()
    path = tmp_path / "sub" / "plan.json"
    plan.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temporary file left behind
    loaded = load_plan(path)
    assert loaded.entries == plan.entries
    assert loaded.fingerprint == plan.fingerprint and loaded.env == plan.env and loaded.method == "priority"
    assert loaded.digest() == plan.digest()
    assert json.loads(path.read_text())["schema_version"] == PLAN_SCHEMA_VERSION


def test_digest_covers_configs_but_not_statistics():
    plan = _plan()
    assert len(plan.digest()) == 64
    assert plan.with_stats(wall_time_s=123.0).digest() == plan.digest()
    changed = Plan(**{**plan.__dict__, "entries": dict(plan.entries)})
    e = changed.entries["tp.ag[0]"]
    changed.entries["tp.ag[0]"] = PlanEntry(
        **{**{k: getattr(e, k) for k in e.__slots__}, "config": CommConfig(n_channels=3)}
    )
    assert changed.digest() != plan.digest()
    assert diff_plans(plan, changed) == [f"tp.ag[0]: {e.config.to_dict()} -> {{'n_channels': 3}}"]


def test_registered_groups_round_trip_and_enter_the_digest(tmp_path):
    plan = _plan()
    assert "registered_groups" not in plan.to_dict()  # absent when empty: plans written before keep their digest
    registered = Plan(**{**plan.__dict__, "registered_groups": ("tp",)})
    assert registered.digest() != plan.digest()
    registered.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.registered_groups == ("tp",) and loaded.digest() == registered.digest()


def test_fingerprint_mismatch_names_the_fields():
    plan = _plan()
    expected = dict(plan.fingerprint)
    assert plan.fingerprint_mismatch(expected) == []
    expected.update(world_size=32, cluster="a100-ib100", extra="x")
    assert plan.fingerprint_mismatch(expected) == ["cluster", "extra", "world_size"]
    # Fields the run does not state (here the NCCL and lagom versions the search added) are not compared.
    assert "nccl_version" in plan.fingerprint
    assert plan.fingerprint_mismatch({"world_size": 16}) == []
    with pytest.raises(ValueError, match=r"\(cluster, extra, world_size differ\).*world_size: plan has 16, run has 32"):
        plan.check_fingerprint(expected)


def test_truncated_json_names_file_and_position(tmp_path):
    path = tmp_path / "plan.json"
    _plan().save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError) as info:
        load_plan(path)
    message = str(info.value)
    assert str(path) in message and "invalid JSON at line" in message and "column" in message


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        load_plan("/nonexistent/plan.json")


def test_diff_lists_only_real_differences_and_names_missing_keys():
    plan = _plan()
    base = {k: v for k, v in plan.fingerprint.items() if k != "ddp_bucket_size"}
    a = Plan(
        **{
            **plan.__dict__,
            "fingerprint": {**base, "ddp_bucket_size": None, "seq_length": 128},
            "env": {"NCCL_ALGO": "Ring"},
        }
    )
    b = Plan(
        **{
            **plan.__dict__,
            "fingerprint": {k: v for k, v in base.items() if k != "seq_length"},
            "env": {"NCCL_PROTO": "Simple"},
        }
    )
    # ddp_bucket_size: None on one side, absent on the other: both "not stated", not a difference.
    assert diff_plans(a, b) == [
        "fingerprint.seq_length: 128 -> (missing)",
        "env.NCCL_ALGO: 'Ring' -> (missing)",
        "env.NCCL_PROTO: (missing) -> 'Simple'",
    ]
    assert diff_plans(b, a)[0] == "fingerprint.seq_length: (missing) -> 128"
    assert diff_plans(a, a) == []
    assert b.fingerprint_mismatch({"ddp_bucket_size": None}) == []
    with pytest.raises(ValueError, match=r"seq_length: plan has \(missing\), run has 128"):
        b.check_fingerprint({"seq_length": 128})


def test_rejected_follows_the_tuners_verdict():
    from lagom_megatron.engine.steps import Phase

    plan = Plan(entries={})
    assert not plan.rejected and not plan.with_stats(verification=Phase.APPLIED.value).rejected
    assert plan.with_stats(verification=Phase.FELL_BACK.value).rejected
