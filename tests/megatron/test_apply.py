"""The apply path's single-rank pieces: capabilities in the plan's fingerprint survive a save and
load (so a saved plan is reused under the same capabilities and not under others), and the
environment re-check names the variable that changed since the capabilities were agreed."""

import pytest

from lagom_megatron.config.plan_files import load_plan
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.megatron.control.apply import Applier
from lagom_megatron.megatron.hooks.sites import GroupNames
from lagom_megatron.megatron.pool.comm_pool import CommPool
from lagom_megatron.nccl.capabilities import gather_local, perturb
from lagom_megatron.nccl.pool import NcclPoolBackend


def _applier(environ):
    caps = gather_local(
        environ=environ,
        status_reader=lambda: None,
        nccl_version=(2, 27, 5),
        config_fields=("max_ctas", "min_ctas"),
        multicast=True,
        torch_version="2.9.1",
    )
    a = Applier(
        pool=CommPool(NcclPoolBackend(use_tuner_plugin=False), GroupNames(local_world_size=1)),
        router=None,
        files=None,
        cluster=None,
    )
    a.capabilities = caps
    return a


def test_capabilities_in_the_fingerprint_survive_save_and_load(tmp_path):
    a = _applier({"NCCL_ALGO": "Ring"})
    fp = {"model": "tiny", **a.fingerprint_part()}
    assert "host" not in fp["capabilities"] and fp["capabilities"]["overrides"] == [["NCCL_ALGO", "Ring"]]
    entry = PlanEntry(
        config=CommConfig(n_channels=4),
        predicted_t_comm_us=1.0,
        predicted_t_region_us=2.0,
        group="dp",
        op="all_reduce",
        nbytes=1024,
        group_size=2,
    )
    Plan(entries={"dp.x[0]": entry}, fingerprint=fp, backend="nccl").save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.fingerprint_mismatch(fp) == []
    other = {"model": "tiny", "capabilities": {**fp["capabilities"], "plugin_loaded": True}}
    assert loaded.fingerprint_mismatch(other) == ["capabilities"]
    b = _applier({})
    b.capabilities = perturb(b.capabilities, "collnet")
    assert b.fingerprint_part() != a.fingerprint_part()


def test_environment_recheck_names_what_changed(monkeypatch):
    a = _applier({"NCCL_ALGO": "Ring"})
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    for var in ("NCCL_PROTO", "NCCL_NTHREADS", "NCCL_BUFFSIZE", "NCCL_CONF_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")
    a._check_env_unchanged()
    monkeypatch.setenv("NCCL_MAX_CTAS", "4")
    with pytest.raises(ValueError, match=r"NCCL_MAX_CTAS='4' \(was None\)"):
        a._check_env_unchanged()


def test_groups_must_span_the_nodes_nccl_counts(monkeypatch):
    from lagom_megatron.megatron import groups as group_names

    monkeypatch.setattr(group_names, "_group_ranks", lambda g: g.ranks)

    class G:
        def __init__(self, ranks):
            self.ranks = ranks

    groups = GroupNames(local_world_size=2)  # LOCAL_WORLD_SIZE 2: ranks {0,1} and {2,3} per node
    groups.add("tp", G((0, 1)))
    groups.add("dp", G((0, 2)))
    a = Applier(pool=CommPool(NcclPoolBackend(use_tuner_plugin=False), groups), router=None, files=None, cluster=None)
    a._check_nodes(["h0", "h0", "h1", "h1"])  # block placement: what lagom assumed
    with pytest.raises(
        ValueError, match=r"group 'tp' spans 2 node\(s\) as NCCL counts hosts but 1 from LOCAL_WORLD_SIZE=2"
    ):
        a._check_nodes(["h0", "h1", "h0", "h1"])  # round-robin placement
