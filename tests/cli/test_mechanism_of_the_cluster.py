"""A plan is labelled with the mechanism that can apply it on its cluster: NCCL 2.21.5
(``a100-ib100``) loads no lagom tuner plugin (ABI v3 is NCCL 2.22+), so its plans are communicator
plans, have no tuner table to export, and a plan labelled ``tuner`` for it is refused. They were
labelled ``tuner`` and their table exported."""

from __future__ import annotations

import json

from lagom_megatron.cli.main import main
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.plan import Plan
from lagom_megatron.nccl.rules import check_mechanism, default_mechanism


def test_the_default_mechanism_follows_the_nccl_version():
    assert default_mechanism(ClusterSpec.load("a100-ib100")) == "communicator"  # NCCL 2.21.5
    assert default_mechanism(ClusterSpec.load("h100-sxm-ib400")) == "tuner"  # NCCL 2.27.5
    check_mechanism("communicator", ClusterSpec.load("a100-ib100"))
    check_mechanism("tuner", ClusterSpec.load("h200-sxm"))


def _error(capsys) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_a_plan_for_nccl_2_21_is_a_communicator_plan_end_to_end(tmp_path, capsys):
    plan, profile = tmp_path / "plan.json", tmp_path / "profile.json"
    assert main(["simulate", "--preset", "llama2-7b-a100x32-ib100", "--seed", "1", "--plan-out", str(plan),
                 "--profile-out", str(profile)]) == 0
    assert Plan.load(plan).mechanism == "communicator"
    capsys.readouterr()
    assert main(["plan", "validate", str(plan)]) == 0
    capsys.readouterr()
    assert main(["plan", "export", str(plan), "--format", "nccl-tuner-csv", "--allow-rejected"]) == 2
    assert _error(capsys) == (f"lagom plan: error: {plan}: a plan of mechanism 'communicator' has no tuner table "
                              "(NCCL 2.21.5 on 'a100-ib100' loads no lagom tuner plugin); export it with --format "
                              "megatron-yaml or --format env")
    assert main(["plan", "export", str(plan), "--format", "megatron-yaml", "--allow-rejected"]) == 0
    assert "min_ctas" in capsys.readouterr().out
    assert main(["search", "--profile", str(profile), "-o", str(tmp_path / "again.json")]) == 0
    assert Plan.load(tmp_path / "again.json").mechanism == "communicator"
    capsys.readouterr()
    assert main(["search", "--profile", str(profile), "--mechanism", "tuner", "-o", str(tmp_path / "t.json")]) == 2
    assert _error(capsys) == ("lagom search: error: mechanism 'tuner' needs NCCL 2.22 or newer (lagom's tuner plugin, "
                              "ABI v3); cluster 'a100-ib100' has NCCL 2.21.5: use mechanism 'communicator' or 'env'")
    labelled = json.loads(plan.read_text())
    labelled["mechanism"] = "tuner"  # what the earlier search wrote for this cluster
    (tmp_path / "tuner.json").write_text(json.dumps(labelled))
    assert main(["plan", "validate", str(tmp_path / "tuner.json")]) == 2
    assert _error(capsys).startswith(f"lagom plan: error: {tmp_path / 'tuner.json'}: mechanism 'tuner' needs NCCL 2.22")
