"""A plan's registered buffers in the report and in ``RunFiles.plan_to_reuse`` (read only, nothing moved)."""

from __future__ import annotations

import types

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.megatron.outputs.report import registered_this_launch, registration_text, render_markdown
from lagom_megatron.megatron.outputs.run_files import RunFiles

NEXT = "- registered buffers for dp (--use-nccl-ub): applied from the next launch that reuses this plan"
NOW = "- registered buffers for dp (--use-nccl-ub): registered at this launch"


def _plan(**fingerprint):
    entry = PlanEntry(
        config=CommConfig(), predicted_t_comm_us=40.0, predicted_t_region_us=50.0, group="dp", op="reduce_scatter"
    )
    return Plan(entries={"dp.rs[0]": entry}, fingerprint=dict(fingerprint), registered_groups=("dp",))


def test_the_report_says_when_the_buffers_are_registered():
    summary = {"phase": "applied", "registered_groups": ["dp"]}
    assert NEXT in render_markdown([], {**summary, "registered_this_launch": False}).splitlines()
    assert NOW in render_markdown([], {**summary, "registered_this_launch": True}).splitlines()
    text = render_markdown([], {"phase": "applied"})
    assert "registered buffers" not in text


def test_this_launch_registered_when_the_registry_found_nccl_ub_pools():
    registry = types.SimpleNamespace(registered_pools={"dp": [(object(), True)]})
    assert registered_this_launch(types.SimpleNamespace(registry=registry)) is True
    assert registered_this_launch(types.SimpleNamespace(registry=types.SimpleNamespace(registered_pools={}))) is False
    assert registered_this_launch(types.SimpleNamespace()) is False  # set up never ran
    assert (
        registration_text(("dp", "dp_cp"), True)
        == "registered buffers for dp, dp_cp (--use-nccl-ub): registered at this launch"
    )


def test_plan_to_reuse_reads_and_moves_nothing(tmp_path):
    path = tmp_path / "plan.json"
    _plan(world_size=8, backend="nccl").save(path)
    files = RunFiles(plan_path=str(path))
    assert files.plan_to_reuse({"world_size": 8}).registered_groups == ("dp",)
    assert files.plan_to_reuse({"world_size": 16}) is None
    path.write_text("{")
    plan, error, tag = files.read_plan()
    assert plan is None and tag.startswith("corrupt-") and error
    assert files.plan_to_reuse({"world_size": 8}) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
