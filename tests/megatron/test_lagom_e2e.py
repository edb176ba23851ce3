"""``--lagom`` end to end on 4 gloo processes: sites, phases, files, identical losses, plan reuse,
digest mismatch, hook removal.

Two torchrun launches (tests/megatron/lagom_harness.py runs several trainings per launch):

* TP=2 x DP=2 (sequence parallel, distributed optimizer, overlapped grad reduce and param gather):
  defaults, ``--lagom`` (searches and writes plan, profile, report), ``--lagom`` again with the
  saved plan (applied from the first iteration, no profiling);
* PP=2 x DP=2 (1F1B, overlapped grad reduce): defaults, ``--lagom`` with rank 1's plan copy
  perturbed (``LAGOM_INJECT_DIGEST_FAULT=1``): tuning aborted, defaults kept, training continues;
  then ``--lagom`` again without the fault (the plan is applied in the verification iterations).

Same seed, same data: every run's losses must equal its layout's default run bit for bit (the
groups are of size 2, so chunked reductions add in the same order).
"""

import json
import math
import re
from pathlib import Path

import pytest

from lagom_megatron.config.plan_files import load_plan, load_profile
from lagom_megatron.engine.plan import Plan
from lagom_megatron.nccl.env_file import read_env_file, validate_process_env
from tests.megatron.harness_launch import launch_harness
from tests.timeouts import LAUNCH_S

pytestmark = pytest.mark.distributed

ITERS = 12
COMMON = [
    "--mock-data",
    "--train-iters",
    str(ITERS),
    "--log-interval",
    "1",
    "--lagom-warmup-iters",
    "1",
    "--lagom-verify-iters",
    "2",
]


def _launch(tmp_path: Path, name: str, runs: list[dict]) -> tuple[dict, dict[str, str]]:
    return launch_harness(tmp_path, name, runs, nproc=4, timeout_s=LAUNCH_S)


def _check_hooks_removed(result: dict, *, lagom: bool) -> None:
    assert not result["not_restored"], f"patched names left behind: {result['not_restored']}"
    assert not result["installed_after"], "patches.installed() is still set after training"
    if lagom:
        assert result["patched_during"] >= 9, f"got {result['patched_during']} patched entry points during training"
    else:
        assert result["patched_during"] == 0


def _check_report_against_log(md: str, log: str, saved: Plan) -> set[str]:
    """The markdown report's figures are the ones of the verdict line in the run's log (one statistic,
    the paired gain, and its bound); each time column of the per-site table adds up (sites + rest)
    to its iteration figure, and the measured columns' iteration row is the table's medians.
    Returns the site ids of the table."""
    m = re.search(
        r"lagom: phase (applied|fell_back) \| (?:measured [\d.]+ -> [\d.]+ ms \| )?gain (-?[\d.]+ ms "
        r"\(mean of (\d+) paired differences, defaults - plan\), needed > [\d.]+ ms \(the larger of its 95% "
        r"bound [\d.]+ ms and the minimum gain [\d.]+ ms\))",
        log,
    )
    assert m, log
    phase, figures, n = m.groups()
    assert md.startswith(f"# lagom report: {phase}\n") and phase == saved.stats["verification"]
    assert f"- plan digest: {saved.digest()[:12]}" in md
    medians = re.search(rf"\| measured median \({n} / {n} iterations[^|]*\| ([\d.]+) \| ([\d.]+) \|", md)
    assert medians, md
    default_ms, plan_ms = medians.groups()
    assert f"- gain (defaults - plan): {figures}\n- rule: " in md, md  # the verdict line's own figures
    totals = {}
    for line in md.splitlines():
        t = re.match(r"\| \*\*(.+?)\*\* \|", line)
        if t:
            totals[t.group(1)] = [float(x) for x in line.strip("| ").split(" | ")[-4:]]
    for col in range(4):
        assert math.isclose(
            totals["sum of the sites"][col] + totals["rest of the iteration"][col],
            totals["iteration"][col],
            abs_tol=0.011,
        ), totals
    assert totals["iteration"][:2] == pytest.approx([float(default_ms), float(plan_ms)], abs=0.051), totals
    rows = [line.split(" | ") for line in md.splitlines() if re.match(r"\| (dp|tp|pp)\.", line)]
    tuned = [r for r in rows if r[7] == "yes"]
    assert all(r[6] != "n_channels=2" for r in tuned)  # gloo's default thread count is not a change
    return {r[0].lstrip("| ") for r in rows}


def test_tp2_dp2_lagom_search_apply_reuse(tmp_path):
    plan = tmp_path / "run" / "plan.json"
    report = tmp_path / "run" / "report.md"
    base = ["--preset", "cpu-tp2-dp2", *COMMON]
    results, logs = _launch(
        tmp_path,
        "tp",
        [
            {"name": "default", "argv": base},
            {"name": "lagom", "argv": [*base, "--lagom", "--lagom-plan", str(plan), "--lagom-report", str(report)]},
            {"name": "reuse", "argv": [*base, "--lagom", "--lagom-plan", str(plan), "--lagom-report", str(report)]},
        ],
    )
    default, tuned, reused = results["default"], results["lagom"], results["reuse"]
    assert len(default["losses"]) == ITERS and all(math.isfinite(x) for x in default["losses"])
    assert tuned["losses"] == default["losses"], f"got {tuned['losses']} but should be {default['losses']}"
    assert reused["losses"] == default["losses"], f"got {reused['losses']} but should be {default['losses']}"
    _check_hooks_removed(default, lagom=False)
    _check_hooks_removed(tuned, lagom=True)
    _check_hooks_removed(reused, lagom=True)

    log = logs["lagom"]
    for phase in ("lagom: phase profiling", "lagom: phase searching", "lagom: phase verifying"):
        assert phase in log, f"{phase!r} missing from the log:\n{log}"
    assert ("lagom: phase applied" in log) or ("lagom: phase fell_back" in log), log
    profile = load_profile(plan.parent / "profile.json")
    ids = {s.site_id for s in profile.sites}
    assert any(i.startswith("dp.grad_reduce_scatter[chunk0.bucket") for i in ids), sorted(ids)
    assert any(i.startswith("dp.param_all_gather[chunk0.bucket") for i in ids), sorted(ids)
    # 4 layers x (QKV, FC1) + output layer: 9 column-parallel linears, each with an async SP all-gather
    # and reduce-scatter in backward, per micro-batch (2 micro-batches: calls_per_iter 2).
    for kind in ("tp.sp_all_gather", "tp.sp_reduce_scatter"):
        sites = [s for s in profile.sites if s.site_id.startswith(kind + "[")]
        assert len(sites) == 9, f"got {len(sites)} {kind} sites but should be 9: {sorted(ids)}"
        assert all(s.calls_per_iter == 2 and s.group == "tp" and s.group_size == 2 for s in sites)
        # micro-batch 2 x seq 128 x hidden 128 fp32 = 131072 bytes gathered per call
        assert all(s.nbytes == 2 * 128 * 128 * 4 for s in sites), [s.nbytes for s in sites]
    assert {s.site_id for s in profile.sites} == {s.site_id for s in profile.samples}
    saved = load_plan(plan)
    assert set(saved.entries) == ids
    # the process-scope knobs go to an env file beside the plan for the launch scripts to source
    assert read_env_file(plan.with_suffix(".env")) == validate_process_env(saved.env)
    md = report.read_text()
    assert _check_report_against_log(md, log, saved) == ids
    assert report.with_suffix(".png").stat().st_size > 1000
    # the training kept going after lagom finished
    assert "iteration       12/      12" in log
    # warmup i/n counts --lagom-warmup-iters (1 here), not every profiling iteration
    assert "warmup 1/1; profiling step 1/" in log and "warmup 2/" not in log, log

    log2 = logs["reuse"]
    assert "profiling and search skipped" in log2, log2
    if saved.stats.get("verification") == "fell_back":  # a plan its verification rejected is not applied again
        assert "lagom: phase fell_back" in log2 and "verification kept the defaults" in log2, log2
    else:
        assert "lagom: phase applied" in log2, log2
    assert "lagom: phase profiling" not in log2 and "lagom: phase searching" not in log2, log2
    # the reuse run wrote its own report; the tuning run's report.md is untouched
    assert report.read_text() == md
    reuse_md = tmp_path / "run" / "report.reused-1.md"
    assert f"lagom: report {reuse_md}" in log2, log2
    text = reuse_md.read_text()
    assert "- run: reused;" in text
    # calls per iteration come from this run's own records: 2 micro-batches, 2 SP all-gathers per layer
    assert re.search(r"\| tp\.sp_all_gather\[0\] \| all_gather \| tp \| 128\.0 KiB \| 2 \|", text), text


def test_pp2_dp2_digest_mismatch_keeps_defaults_and_plan_keeps_losses(tmp_path):
    plan = tmp_path / "run" / "plan.json"
    report = tmp_path / "run" / "report.json"
    base = ["--preset", "cpu-pp2-dp2", *COMMON]
    results, logs = _launch(
        tmp_path,
        "pp",
        [
            {"name": "default", "argv": base},
            {
                "name": "fault",
                "argv": [*base, "--lagom", "--lagom-plan", str(plan), "--lagom-report", str(report)],
                "env": {"LAGOM_INJECT_DIGEST_FAULT": "1"},
            },
            {"name": "lagom", "argv": [*base, "--lagom", "--lagom-plan", str(tmp_path / "ok" / "plan.json")]},
        ],
    )
    default, fault, tuned = results["default"], results["fault"], results["lagom"]
    # the searched plan is applied in the verification iterations: same losses
    assert tuned["losses"] == default["losses"], f"got {tuned['losses']} but should be {default['losses']}"
    assert "lagom: phase verifying (iteration 9, plan)" in logs["lagom"], logs["lagom"]
    assert "pp.send_recv" in load_plan(tmp_path / "ok" / "plan.json").entries
    assert len(fault["losses"]) == ITERS, "training stopped after the aborted tuning"
    assert fault["losses"] == default["losses"], f"got {fault['losses']} but should be {default['losses']}"
    _check_hooks_removed(fault, lagom=True)
    log = logs["fault"]
    assert "plan digest mismatch" in log and "rank 1" in log, log
    assert "phase fell_back" in log, log
    rep = json.loads(report.read_text())
    assert rep["summary"]["phase"] == "fell_back"
    assert "rank agreement failed" in rep["summary"]["reason"]
    ids = {r["site_id"] for r in rep["rows"]}
    assert "pp.send_recv" in ids, sorted(ids)
    # each pipeline stage has its own buckets: stage-local ids
    for stage in (0, 1):
        assert any(i.startswith(f"dp.grad_all_reduce[stage{stage}.chunk0.bucket") for i in ids), sorted(ids)
    assert not plan.exists(), "a plan that failed agreement must not be saved"


def test_tp2_on_two_ranks_has_no_data_parallel_sites(tmp_path):
    """Data parallel 1 (TP 2 on 2 ranks): the DDP buckets' collectives move no data and are never
    sites, so neither the profile nor the plan names one (it did: ``dp.grad_reduce_scatter
    [chunk0.bucket0]`` with ``group_size`` 1)."""
    plan = tmp_path / "run" / "plan.json"
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--lr",
        "3e-3",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        *COMMON,
        "--lagom",
        "--lagom-plan",
        str(plan),
    ]
    results, logs = launch_harness(tmp_path, "dp1", [{"name": "lagom", "argv": argv}], nproc=2, timeout_s=LAUNCH_S)
    _check_hooks_removed(results["lagom"], lagom=True)
    profile = load_profile(plan.parent / "profile.json")
    ids = sorted(s.site_id for s in profile.sites)
    assert ids and all(s.group_size == 2 for s in profile.sites), [(s.site_id, s.group_size) for s in profile.sites]
    assert not [i for i in ids if i.startswith("dp.")], ids
    assert any(i.startswith("tp.sp_all_gather[") for i in ids), ids
    assert sorted(load_plan(plan).entries) == ids
