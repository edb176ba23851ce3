"""A plan is labelled with the mechanism that can apply it on its cluster: NCCL 2.21.5
(``a100-ib100``) loads no lagom tuner plugin (ABI v3 is NCCL 2.22+), so its plans are communicator
plans, have no tuner table to export, and a plan labelled ``tuner`` for it is refused. They were
labelled ``tuner`` and their table exported."""

from __future__ import annotations

import json

from lagom_megatron.cli.main import main
from lagom_megatron.config.plan_files import load_plan
from lagom_megatron.engine.cluster import ClusterSpec
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
    assert (
        main(
            [
                "simulate",
                "--preset",
                "llama2-7b-a100x32-ib100",
                "--seed",
                "1",
                "--plan-out",
                str(plan),
                "--profile-out",
                str(profile),
            ]
        )
        == 0
    )
    assert load_plan(plan).mechanism == "communicator"
    capsys.readouterr()
    assert main(["plan", "validate", str(plan)]) == 0
    capsys.readouterr()
    assert main(["plan", "export", str(plan), "--format", "nccl-tuner-csv", "--allow-rejected"]) == 2
    assert _error(capsys) == (
        f"lagom plan: error: {plan}: a plan of mechanism 'communicator' has no tuner table "
        "(NCCL 2.21.5 on 'a100-ib100' loads no lagom tuner plugin); export it with --format "
        "megatron-yaml or --format env"
    )
    assert main(["plan", "export", str(plan), "--format", "megatron-yaml", "--allow-rejected"]) == 0
    assert "min_ctas" in capsys.readouterr().out
    assert main(["search", "--profile", str(profile), "-o", str(tmp_path / "again.json")]) == 0
    assert load_plan(tmp_path / "again.json").mechanism == "communicator"
    capsys.readouterr()
    assert main(["search", "--profile", str(profile), "--mechanism", "tuner", "-o", str(tmp_path / "t.json")]) == 2
    assert _error(capsys) == (
        "lagom search: error: mechanism 'tuner' needs NCCL 2.22 or newer (lagom's tuner plugin, "
        "ABI v3); cluster 'a100-ib100' has NCCL 2.21.5: use mechanism 'communicator' or 'env'"
    )
    labelled = json.loads(plan.read_text())
    labelled["mechanism"] = "tuner"  # what the earlier search wrote for this cluster
    (tmp_path / "tuner.json").write_text(json.dumps(labelled))
    assert main(["plan", "validate", str(tmp_path / "tuner.json")]) == 2
    assert _error(capsys).startswith(f"lagom plan: error: {tmp_path / 'tuner.json'}: mechanism 'tuner' needs NCCL 2.22")


def test_export_names_only_formats_that_work_for_the_plan(tmp_path, capsys):
    """A gloo plan exports only as env (megatron-yaml is for NCCL plans); a tuner plan whose sites
    leave knobs to NCCL names the CLI flag that holds them, not export_plan's keyword."""
    from pathlib import Path

    gloo = tmp_path / "gloo.json"
    profile = Path(__file__).resolve().parents[1] / "engine" / "data" / "gloo_tp2_dp2_profile.json"
    assert main(["search", "--profile", str(profile), "-o", str(gloo)]) == 0
    capsys.readouterr()
    for fmt in ("nccl-tuner-csv", "megatron-yaml"):
        assert main(["plan", "export", str(gloo), "--format", fmt]) == 2
        assert _error(capsys) == (
            f"lagom plan: error: {gloo}: a gloo plan has no {fmt} form (it sets no NCCL knob); "
            "export it with --format env, or give the plan itself to the training run "
            "(--lagom-plan)"
        )
    assert main(["plan", "export", str(gloo), "--format", "env"]) == 0  # the format the message gives works
    assert capsys.readouterr().out.startswith("# process-scope NCCL settings of a lagom plan")

    fsdp = tmp_path / "fsdp.json"
    assert main(["simulate", "--preset", "llama2-7b-a40x16-fsdp", "--show", "0", "--plan-out", str(fsdp)]) == 0
    capsys.readouterr()
    assert main(["plan", "export", str(fsdp), "--format", "nccl-tuner-csv", "--allow-rejected"]) == 2
    err = _error(capsys)
    assert err.startswith(f"lagom plan: error: {fsdp}: site ") and " leaves " in err, err
    assert err.endswith("(export with --extended for lagom's plugin)") and "extended=True" not in err, err
    assert main(["plan", "export", str(fsdp), "--format", "nccl-tuner-csv", "--allow-rejected", "--extended"]) == 0


def test_search_keeps_to_the_profile_s_cluster(tmp_path, capsys):
    """A profile measured on a100-ib100 searched with --cluster h100-sxm-ib400 wrote a plan saying
    a100-ib100, NCCL 2.27.5 and mechanism tuner, which plan validate then refused. Another
    cluster is refused, naming both; a copy of the profile's cluster with other bandwidths (a
    calibrated one) is searched, and validate and export agree with the plan it writes."""
    import yaml

    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["simulate", "--preset", "llama2-7b-a100x32-ib100", "--show", "0", "--profile-out", str(profile)]) == 0
    capsys.readouterr()
    assert main(["search", "--profile", str(profile), "--cluster", "h100-sxm-ib400", "-o", str(plan)]) == 2
    assert _error(capsys) == (
        f"lagom search: error: --cluster 'h100-sxm-ib400' is not the cluster profile {profile} "
        "was measured on ('a100-ib100': gpu 'A100-SXM4-80GB', not 'H100-SXM5-80GB'); a plan is "
        "searched from a profile of its own cluster: drop --cluster, or profile 'h100-sxm-ib400'"
    )
    assert not plan.exists()

    spec = ClusterSpec.load("a100-ib100").to_dict()
    calibrated = tmp_path / "a100-ib100.calibrated.yaml"
    calibrated.write_text(
        yaml.safe_dump(
            {k: v for k, v in spec.items() if v is not None}
            | {"name": "a100-ib100.calibrated", "net_gbps_per_gpu": 11.0}
        )
    )
    assert main(["search", "--profile", str(profile), "--cluster", str(calibrated), "-o", str(plan)]) == 0
    searched = load_plan(plan)
    assert (searched.fingerprint["cluster"], searched.fingerprint["nccl_version"], searched.mechanism) == (
        "a100-ib100",
        "2.21.5",
        "communicator",
    )
    capsys.readouterr()
    assert main(["plan", "validate", str(plan)]) == 0
    assert main(["plan", "export", str(plan), "--format", "megatron-yaml"]) == 0

    other_nccl = tmp_path / "newer.yaml"
    other_nccl.write_text(
        yaml.safe_dump({k: v for k, v in spec.items() if v is not None} | {"name": "newer", "nccl_version": "2.27.5"})
    )
    capsys.readouterr()
    assert main(["search", "--profile", str(profile), "--cluster", str(other_nccl), "-o", str(plan)]) == 2
    assert "('a100-ib100': nccl_version '2.21.5', not '2.27.5')" in _error(capsys)
    # a profile of a cluster not known here is searched on the file that describes it
    data = json.loads(profile.read_text())
    data["cluster"] = data["fingerprint"]["cluster"] = "our-a100s"
    (tmp_path / "ours.json").write_text(json.dumps(data))
    assert (
        main(["search", "--profile", str(tmp_path / "ours.json"), "--cluster", str(calibrated), "-o", str(plan)]) == 0
    )
    assert load_plan(plan).fingerprint["cluster"] == "our-a100s"
