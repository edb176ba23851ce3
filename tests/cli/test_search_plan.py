"""The `lagom search` and `lagom plan` commands, run in-process through the CLI entry point."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from lagom_megatron.cli.bench import search_main as bench_main
from lagom_megatron.cli.main import main
from lagom_megatron.config.plan_files import load_plan

from ..engine.factory import build, profile_from, site


def _profile(tmp_path, **fingerprint):
    sites = [site(), site(site_id="dp.rs[0]", op="reduce_scatter", group="dp", group_size=16, n_nodes=2)]
    prof = profile_from(build(sites=sites, comp_ratio=[3.0, 0.5]))
    prof.fingerprint.update(fingerprint)
    path = tmp_path / "profile.json"
    prof.save(path)
    return path


def test_search_then_show_validate_export_diff(tmp_path, capsys):
    prof = _profile(tmp_path)
    plan_path, auto_path = tmp_path / "plan.json", tmp_path / "auto.json"
    assert main(["search", "--profile", str(prof), "-o", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "priority: 2 sites" in out and "MAPE" in out
    plan = load_plan(plan_path)
    assert plan.fingerprint["cluster"] == "h100-sxm-ib400" and plan.method == "priority"
    assert main(["plan", "show", str(plan_path)]) == 0
    assert "tp.ag[0]" in capsys.readouterr().out
    assert main(["plan", "validate", str(plan_path), "--profile", str(prof)]) == 0
    assert "valid (2 entries" in capsys.readouterr().out
    yml = tmp_path / "nccl.yaml"
    assert main(["plan", "export", str(plan_path), "--format", "megatron-yaml", "-o", str(yml)]) == 0
    # one entry per group the plan tunes (here dp's reduce-scatter; tp's gather keeps NCCL's defaults)
    tuned_groups = {e.group for e in plan.entries.values() if not e.config.is_default()}
    assert set(yaml.safe_load(yml.read_text())) == tuned_groups and tuned_groups
    assert main(["plan", "export", str(plan_path), "--format", "nccl-tuner-csv", "--extended"]) == 0
    assert "chunkSize,commTag" in capsys.readouterr().out
    assert main(["search", "--profile", str(prof), "--method", "autoccl", "-o", str(auto_path)]) == 0
    capsys.readouterr()
    assert main(["plan", "diff", str(plan_path), str(plan_path)]) == 0
    assert main(["plan", "diff", str(plan_path), str(auto_path)]) == 1
    assert "method: priority -> autoccl" in capsys.readouterr().out


def test_validate_reports_fingerprint_mismatch(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["search", "--profile", str(_profile(tmp_path)), "-o", str(plan_path)]) == 0
    other = _profile(tmp_path, world_size=64)
    assert main(["plan", "validate", str(plan_path), "--profile", str(other)]) == 1
    assert "fingerprint mismatch: world_size: plan 16, profile 64" in capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert main(["search", "--profile", str(tmp_path / "missing.json"), "-o", str(tmp_path / "p.json")]) == 2
    assert (
        main(["search", "--profile", str(_profile(tmp_path)), "--method", "greedy", "-o", str(tmp_path / "p.json")])
        == 2
    )
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"schema_version": 1, "entries": {}})[:-3])
    assert main(["plan", "show", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("lagom ") for line in err)
    assert "argument --method: invalid choice: 'greedy'" in err[1] and "invalid JSON at line 1" in err[2]


def test_bench_prints_both_tables(capsys):
    assert bench_main(["--sizes", "10", "30", "--instances", "4"]) == 0
    out = capsys.readouterr().out
    assert "model evals" in out and "priority vs exhaustive on 4 seeded instances" in out
    assert "within 1% of the optimum: 4/4" in out
    gaps = re.search(r"\(mean gap ([0-9.]+)%, worst ([0-9.]+)%, least (-?[0-9.]+)%\)", out)
    assert gaps is not None, out
    mean, worst, least = map(float, gaps.groups())
    assert least >= 0.0  # priority never below the optimum (it searches a subset of exhaustive's space)
    assert mean < 0.01 and worst < 0.01  # and within a hundredth of a percent of it here


def test_diff_and_validate_show_a_missing_fingerprint_key(tmp_path, capsys):
    plan_path, other_path = tmp_path / "plan.json", tmp_path / "other.json"
    assert main(["search", "--profile", str(_profile(tmp_path, ddp_bucket_size=None)), "-o", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    del data["fingerprint"]["ddp_bucket_size"]  # an older plan without the key: the same run
    other_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["plan", "diff", str(plan_path), str(other_path)]) == 0
    assert capsys.readouterr().out.strip() == "plans are identical (verification: never verified)"
    prof = _profile(tmp_path, ddp_bucket_size=40_000_000)
    assert main(["plan", "validate", str(other_path), "--profile", str(prof)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "fingerprint mismatch: ddp_bucket_size: plan (missing), profile 40000000"
    ]


def _simulated_profile(tmp_path, capsys, preset: str, cluster: str):
    path = tmp_path / f"{preset}.{cluster}.json"
    assert main(["simulate", "--preset", preset, "--cluster", cluster, "--show", "0", "--profile-out", str(path)]) == 0
    capsys.readouterr()
    return path


def test_search_refuses_an_exhaustive_search_of_per_call_knobs_as_simulate_does(tmp_path, capsys):
    # NCCL 2.27 with the tuner plugin sets knobs per call: every site (64 data-parallel collectives and
    # 32 context-parallel ring exchanges, bounded by their entries' CTAs) doubles the space at least
    prof = _simulated_profile(tmp_path, capsys, "llama3-8b-h100x8", "h100-sxm-ib400")
    expected = (
        "--method exhaustive: 96 tunable sites need at least 2^96 joint configurations, above the limit "
        "of 2,000,000; use --method priority (or autoccl)"
    )
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(prof), "-o", str(out), "--method", "exhaustive"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"lagom search: error: {expected}" and captured.out == ""
    assert not out.exists()
    assert (
        main(["simulate", "--preset", "llama3-8b-h100x8", "--cluster", "h100-sxm-ib400", "--method", "exhaustive"]) == 2
    )
    assert capsys.readouterr().err.strip() == f"lagom simulate: error: {expected}"


def test_exhaustive_search_of_more_than_64_sites_with_shared_knobs_runs(tmp_path, capsys):
    # NCCL 2.21 (a100-ib100) loads no lagom plugin: the communicator mechanism sets CTA bounds per
    # communicator (the algorithm and protocol need 2.24's per-function NCCL_ALGO) and NCCL_NTHREADS
    # per process, 192 distinct joint configurations over 96 sites (the data-parallel group's 9 CTA
    # bounds, of which 24 and 32 both leave NCCL's 24, times its 4 thread counts, times 6 CTA bounds
    # of the context-parallel one); the searcher once built a 96-dimensional array numpy refuses (64
    # at most). Each site is evaluated under the settings of the knobs of its own group alone:
    # 64 x 32 + 32 x 6 = 2,240 evaluations
    prof = _simulated_profile(tmp_path, capsys, "llama3-8b-h100x8", "a100-ib100")
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(prof), "-o", str(out), "--method", "exhaustive"]) == 0
    assert capsys.readouterr().out.startswith("exhaustive: 96 sites, 2,240 model evaluations")
    plan = load_plan(out)
    assert plan.method == "exhaustive" and len(plan.entries) == 96 and plan.stats["joint_configs"] == 192
    assert plan.mechanism == "communicator"
    assert main(["search", "--profile", str(prof), "-o", str(tmp_path / "prio.json")]) == 0
    capsys.readouterr()
    prio = load_plan(tmp_path / "prio.json")
    assert plan.stats["predicted_iteration_us"] <= prio.stats["predicted_iteration_us"] * (1 + 1e-9)


def test_a_profile_given_as_a_plan_and_a_plan_given_as_a_profile_are_named_as_such(tmp_path, capsys):
    prof = _profile(tmp_path)
    plan = tmp_path / "plan.json"
    assert main(["search", "--profile", str(prof), "-o", str(plan)]) == 0
    capsys.readouterr()
    for argv, command in [
        (["plan", "show", str(prof)], "lagom plan show"),
        (["plan", "diff", str(plan), str(prof)], "lagom plan diff"),
        (["plan", "export", str(prof), "--format", "env"], "lagom plan export"),
    ]:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.err.strip() == (
            f"lagom plan: error: {prof} looks like a profile (it has samples, no entries); "
            f"{command} reads plans (a profile is searched with lagom search --profile)"
        )
        assert captured.out == ""
    for argv, command in [
        (["search", "--profile", str(plan), "-o", str(tmp_path / "new.json")], "lagom search --profile"),
        (["plan", "validate", str(plan), "--profile", str(plan)], "lagom plan validate --profile"),
    ]:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip() == (
            f"lagom {argv[0]}: error: {plan} looks like a plan (it has entries, no samples); {command} reads profiles "
            "(a plan is read by lagom plan show | diff | validate | export)"
        )
    assert not (tmp_path / "new.json").exists()
    # a file that is neither keeps the schema's own line
    (tmp_path / "odd.json").write_text('{"entries": {}, "samples": []}')
    assert main(["plan", "show", str(tmp_path / "odd.json")]) == 2
    assert (
        capsys.readouterr().err.strip() == f"lagom plan: error: {tmp_path / 'odd.json'}: schema_version: Field required"
    )


def test_validate_refuses_a_verification_state_lagom_never_writes(tmp_path, capsys):
    """``verification: "rejected"`` (a user's way to keep a plan off) was ``valid`` and then applied unmeasured."""
    prof = _profile(tmp_path)
    plan_path = tmp_path / "plan.json"
    assert main(["search", "--profile", str(prof), "-o", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    data["stats"]["verification"] = "rejected"
    plan_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["plan", "validate", str(plan_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"lagom plan: error: {plan_path}: stats.verification must be one of ['applied', 'fell_back'] or absent "
        "(never verified: a run measures it before applying it); got 'rejected', which a run would apply unmeasured"
    )
    assert json.loads(plan_path.read_text()) == data


def _plan_with_env(tmp_path, capsys, cluster: str, env: dict[str, str]):
    prof = profile_from(build(cluster=cluster, sites=[site(group_size=2)]), iteration_us=1e6)
    prof.save(tmp_path / "profile.json")
    plan_path = tmp_path / "plan.json"
    assert main(["search", "--profile", str(tmp_path / "profile.json"), "-o", str(plan_path)]) == 0
    data = json.loads(plan_path.read_text())
    data["env"] = env
    plan_path.write_text(json.dumps(data))
    capsys.readouterr()
    return plan_path, data


@pytest.mark.parametrize(
    "cluster, env, expected",
    [
        (
            "h100-sxm-ib400",
            {"NCCL_DEBUG": "INFO; rm -rf ~"},
            "env: NCCL_DEBUG='INFO; rm -rf ~' is not one of VERSION, WARN, INFO, ABORT, TRACE; NCCL ignores",
        ),
        ("h100-sxm-ib400", {"NCCL_DEBUG": "INFOO"}, "env: NCCL_DEBUG='INFOO' is not one of VERSION, WARN, INFO"),
        ("h100-sxm-ib400", {"LD_PRELOAD": "x.so"}, "env: 'LD_PRELOAD' is not an NCCL variable; allowed: NCCL_*"),
        (
            "cpu-gloo",
            {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"},
            "env: NCCL_ALGO, NCCL_PROTO: a gloo plan sets no variable (gloo reads no NCCL_* variable; its knob is "
            "the worker threads of each group); allowed: an empty env",
        ),
    ],
    ids=["nccl-debug-injection", "nccl-debug-typo", "not-nccl", "gloo-with-nccl-env"],
)
def test_validate_and_export_refuse_a_plan_env_no_launch_may_get(tmp_path, capsys, cluster, env, expected):
    plan_path, data = _plan_with_env(tmp_path, capsys, cluster, env)
    assert main(["plan", "validate", str(plan_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lagom plan: error: {plan_path}: {expected}"), err
    out = tmp_path / "plan.env"
    assert main(["plan", "export", str(plan_path), "--format", "env", "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"lagom plan: error: {plan_path}: {expected}")
    assert not out.exists() and json.loads(plan_path.read_text()) == data


def test_validate_accepts_the_env_lagom_writes(tmp_path, capsys):
    plan_path, _ = _plan_with_env(
        tmp_path,
        capsys,
        "h100-sxm-ib400",
        {"NCCL_NTHREADS": "256", "NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "8", "NCCL_NCHANNELS_PER_NET_PEER": "2"},
    )
    assert main(["plan", "validate", str(plan_path)]) == 0
    assert "valid (1 entries" in capsys.readouterr().out


@pytest.mark.parametrize(
    "fingerprint, why",
    [
        ({}, "it has no fingerprint"),
        (
            {"backend": "nccl", "cluster": "h100-sxm-ib400", "world_size": 16, "lagom_version": "0.1.0"},
            "its fingerprint lacks torch, megatron_core, which every run sets",
        ),
        (
            {"backend": "sim", "cluster": "h100-sxm-ib400", "world_size": 16, "torch": "2.13.0", "megatron_core": "x"},
            "its fingerprint's backend is 'sim' (a simulated run), not nccl or gloo",
        ),
    ],
    ids=["none", "cut", "simulated"],
)
def test_validate_says_a_training_run_will_not_reuse_a_plan_without_a_run_s_fingerprint(
    tmp_path, capsys, fingerprint, why
):
    from lagom_megatron.megatron.outputs.run_files import RUN_KEYS

    plan_path, data = _plan_with_env(tmp_path, capsys, "h100-sxm-ib400", {})
    data["fingerprint"] = fingerprint
    plan_path.write_text(json.dumps(data))
    assert main(["plan", "validate", str(plan_path), "--cluster", "h100-sxm-ib400"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{plan_path}: valid (1 entries")
    assert captured.err.strip().splitlines() == [
        f"note: a training run will not reuse {plan_path}: {why}; given as --lagom-plan, the run moves it aside "
        "and searches a new plan (lagom plan export gives its values to a launch)"
    ]
    run_like = {"backend": "gloo", "cluster": "cpu-gloo", "world_size": 4, "torch": "2.13.0", "megatron_core": "0.16.1"}
    assert set(run_like) == set(RUN_KEYS)
    data["fingerprint"] = {**fingerprint, **run_like, "backend": "nccl", "cluster": "h100-sxm-ib400"}
    plan_path.write_text(json.dumps(data))
    assert main(["plan", "validate", str(plan_path)]) == 0
    assert "note:" not in capsys.readouterr().err


def test_run_fingerprint_sets_every_run_key(monkeypatch):
    from types import SimpleNamespace

    from lagom_megatron.megatron.outputs.run_files import RUN_KEYS, run_fingerprint

    monkeypatch.setenv("WORLD_SIZE", "4")
    fp = run_fingerprint(SimpleNamespace(), backend="gloo", cluster="cpu-gloo")
    assert {k: fp[k] for k in RUN_KEYS[:3]} == {"world_size": 4, "backend": "gloo", "cluster": "cpu-gloo"}
    assert all(fp[k] for k in RUN_KEYS)


def test_show_says_when_a_plans_registered_buffers_apply(tmp_path, capsys):
    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.engine.plan import Plan, PlanEntry

    entry = PlanEntry(
        config=CommConfig(), predicted_t_comm_us=40.0, predicted_t_region_us=50.0, group="dp", op="reduce_scatter"
    )
    path = tmp_path / "plan.json"
    Plan(entries={"dp.rs[0]": entry}, registered_groups=("dp",)).save(path)
    assert main(["plan", "show", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "registered buffers for dp (--use-nccl-ub): applied from the next launch that reuses this plan" in lines
    Plan(entries={"dp.rs[0]": entry}).save(path)
    assert main(["plan", "show", str(path)]) == 0
    assert "registered buffers" not in capsys.readouterr().out


def test_simulate_follows_a_registering_plan_into_its_next_launch(tmp_path, capsys):
    # GPT-3 2.7B FSDP on one H100 node (NCCL 2.30.7): the model registers dp's buffers, whose all-gathers then run on
    # copy engines; this launch can apply none of it, the next one (buffers registered) verifies it whole
    plan_path = tmp_path / "plan.json"
    argv = ["simulate", "--preset", "gpt3-2.7b-a40x8-fsdp", "--cluster", "h100-sxm-ib400", "--show", "0"]
    assert main([*argv, "--plan-out", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "nothing to apply at this launch: the plan registers the buffers of dp (--use-nccl-ub)" in out
    assert "next launch, reusing the plan with the buffers of dp registered (--use-nccl-ub):" in out
    plan = load_plan(plan_path)
    assert plan.registered_groups == ("dp",)
    assert plan.stats["verification"] is None and plan.stats["verification_unregistered"] == "fell_back"
    zero = [e for e in plan.entries.values() if e.config.cta_policy == "ZERO"]
    assert zero and all(e.op == "all_gather" and e.group == "dp" for e in zero)
    assert main(["plan", "show", str(plan_path)]) == 0
    assert "registered buffers for dp (--use-nccl-ub): applied from the next launch" in capsys.readouterr().out
