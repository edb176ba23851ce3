"""The GPU scripts work the first time they meet a GPU: ``check.sh --rehearse`` and
``megatron_lm_check.sh --rehearse`` run every step's command line here with stand-ins for the GPU
parts, write every file the real run writes in the format the next step reads (the contention CSV
goes through ``lagom calibrate contention`` and gives back the constants it was made with; the
timing step drives lagom's own ``enable_comm_timing`` / ``work_duration_us`` against a stand-in with
torch's API), refuse step budgets longer than their limits, totals of 540 s or more and lines
Megatron-LM would stop on; ``check.sh`` checks its Python's imports before the first step and leaves a
``summary.md`` of every finished step when it is killed; every script answers ``--help`` with its
usage and exit 0. (Output folders: ``tests/cli/test_output_folders.py``.)"""

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"
SCRIPTS = sorted(p for p in GPU.iterdir() if p.suffix in (".sh", ".py"))


def _run(cmd, **kw):
    env = {**os.environ, "PYTHON": sys.executable, **kw.pop("env", {})}
    env.pop("MEGATRON_LM_DIR", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_S, env=env, cwd=ROOT, **kw)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_gpu_script_answers_help(script):
    cmd = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, str(script)]
    proc = _run([*cmd, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower() and not proc.stdout.lstrip().startswith("{"), proc.stdout[:300]


STEPS = (
    "imports",
    "environment",
    "contention probe",
    "lagom calibrate contention",
    "build tuner plugin",
    "NCCL pool + tuner plugin",
    "plugin status, options, timing",
)
"""check.sh's steps in the order they run, as summary.md names them (the contention probe first of the measurements)."""


def _results(summary: str) -> dict[str, str]:
    """Step title -> result, from summary.md's table."""
    return dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|", summary, re.M)[1:])


def _declared(text: str) -> dict[str, int]:
    """check.sh's time constants and step limits (seconds)."""
    consts = {
        k: int(v)
        for k, v in re.findall(r"^(TOTAL_S|IMPORTS_S|SUMMARY_S|STARTUP_S|CONTENTION_BUDGET_S)=(\d+)", text, re.M)
    }
    limits = {
        k: int(v) for k, v in re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A LIMIT=\((.*)\)", text).group(1))
    }
    return {**consts, **{f"limit_{k}": v for k, v in limits.items()}}


def test_check_rehearsal_writes_what_the_next_steps_read(tmp_path):
    from lagom_megatron.sim.calibrate import COLUMNS, fit, read_rows

    sys.path.insert(0, str(GPU))
    try:
        import contention_probe
        from contention_probe import COMPUTE_KERNELS, REHEARSAL_KAPPA, sweep_points
    finally:
        sys.path.pop(0)
    assert contention_probe.COLUMNS is COLUMNS  # the probe writes the columns the calibration reads
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _run(["bash", str(GPU / "check.sh"), "--rehearse", str(out)])
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.md").read_text()
    results = _results(summary)
    assert list(results) == [*STEPS, "rehearsal outputs"] and set(results.values()) == {"ok"}, results
    from lagom_megatron.nccl.plugin_launch import NEWEST_TUNER_ABI

    # ncclTunerPlugin_v3 .. the newest lagom declares: five with v7
    assert f"| build tuner plugin | ok | {NEWEST_TUNER_ABI - 2} ABI structs exported |" in summary
    total = _declared((GPU / "check.sh").read_text())["TOTAL_S"]
    took = re.search(r"^Total: (\d+) s \(limit TOTAL_S = (\d+) s\)\.$", summary, re.M)
    assert int(took.group(2)) == total < 540 and int(took.group(1)) <= wall + 1
    assert "What one GPU cannot show: NCCL refuses two ranks on one device" in summary
    assert "runs each collective as a local copy without consulting the tuner" in summary
    for name in ("nccl", "plugin_probe"):
        result = json.loads((out / f"{name}.json").read_text())
        assert result["status"] == "rehearsed" and all(result["rehearsal_checks"].values()), result
    probe = json.loads((out / "plugin_probe.json").read_text())
    assert probe["timing"] == {"before_enable_us": None, "groups_accepted": 1, "after_enable_us": 250.0}
    assert {"timing_off_before_enable", "timing_enabled_on_group", "work_get_duration"} <= set(
        probe["rehearsal_checks"]
    )
    rows = read_rows(out / "contention" / "contention.csv")
    assert len(rows) == len(sweep_points()) * len(COMPUTE_KERNELS)
    fitted = yaml.safe_load((out / "contention" / "contention.fit.yaml").read_text())
    assert fitted["kappa_mem"] == pytest.approx(REHEARSAL_KAPPA["kappa_mem"], rel=1e-6)
    assert fitted["kappa_compute"] == pytest.approx(REHEARSAL_KAPPA["kappa_compute"], rel=1e-6)
    assert fit(rows).kappa_mem == pytest.approx(fitted["kappa_mem"])
    with open(out / "contention" / "contention.csv") as f:
        assert next(csv.reader(f))[0] == "gpu" and "rehearsal stand-in" in f.read()
    assert not list(out.glob(".summary.md*"))  # the temporary file of the last rewrite was renamed


def test_check_limits_fit_under_nine_minutes_and_budgets_fit_their_limits(tmp_path):
    text = (GPU / "check.sh").read_text()
    d = _declared(text)
    limits = {k[len("limit_") :]: v for k, v in d.items() if k.startswith("limit_")}
    assert set(limits) == {"environment", "contention", "calibrate", "build", "nccl", "probe"}
    assert d["IMPORTS_S"] + sum(limits.values()) + d["SUMMARY_S"] <= d["TOTAL_S"] < 540
    assert d["CONTENTION_BUDGET_S"] + d["STARTUP_S"] <= limits["contention"]
    assert f"at most TOTAL_S = {d['TOTAL_S']} s" in text  # the header declares the total the script checks
    budget = d["CONTENTION_BUDGET_S"]
    too_long = tmp_path / "check.sh"  # a budget past its limit is refused before anything runs
    too_long.write_text(text.replace(f"CONTENTION_BUDGET_S={budget}", f"CONTENTION_BUDGET_S={limits['contention']}"))
    proc = _run(["bash", str(too_long), "--rehearse", str(tmp_path / "out")])
    assert proc.returncode == 2
    assert (
        f"step contention: budget {limits['contention']} s + start-up {d['STARTUP_S']} s exceeds its limit"
        in proc.stderr
    )
    over = tmp_path / "over.sh"  # so is a total that leaves no rerun in a 15-minute slot
    over.write_text(text.replace(f"TOTAL_S={d['TOTAL_S']}", "TOTAL_S=600"))
    proc = _run(["bash", str(over), "--rehearse", str(tmp_path / "out")])
    assert proc.returncode == 2 and "TOTAL_S = 600 s must hold them and stay under 540 s" in proc.stderr
    assert not (tmp_path / "out").exists()


def _python_wrapper(tmp_path: Path, body: str) -> Path:
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\n{body}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_check_names_a_missing_import_before_the_first_step(tmp_path):
    blocker = tmp_path / "blocker" / "yaml"  # PyYAML that fails to import, ahead of the real one
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('stand-in: no PyYAML here')\n")
    wrapper = _python_wrapper(tmp_path, f'export PYTHONPATH="{blocker.parent}:$PYTHONPATH"')
    out = tmp_path / "out"
    proc = _run(["bash", str(GPU / "check.sh"), "--rehearse", str(out)], env={"PYTHON": str(wrapper)})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"{GPU / 'check.sh'}: no Python has what the steps import ({wrapper}: missing PyYAML (ImportError)); "
        "give one with PYTHON=... (pip install torch numpy PyYAML)"
    ]
    results = _results((out / "summary.md").read_text())
    assert results["imports"] == "FAILED" and {results[s] for s in STEPS[1:]} == {"not run"}
    assert sorted(p.name for p in out.iterdir()) == ["summary.md"]  # no step ran


def test_a_killed_check_leaves_the_summary_of_every_finished_step(tmp_path):
    """A stand-in Python copies summary.md each time check.sh starts a step's Python, and kills check.sh when the
    last step starts: each copy shows one more finished step, and the killed run leaves its summary."""
    out, snaps, pidfile = tmp_path / "out", tmp_path / "snaps", tmp_path / "pid"
    snaps.mkdir()
    wrapper = _python_wrapper(
        tmp_path,
        f'[ -f "{out}/summary.md" ] && cp "{out}/summary.md" "{snaps}/$(date +%s%N).md"\n'
        f'case "$*" in *plugin_probe.py*) kill -KILL "$(cat {pidfile})"; exit 1 ;; esac',
    )
    env = {**os.environ, "PYTHON": str(wrapper)}
    env.pop("MEGATRON_LM_DIR", None)
    with subprocess.Popen(
        ["bash", str(GPU / "check.sh"), "--rehearse", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        pidfile.write_text(str(proc.pid))
        proc.communicate(timeout=COMMAND_S)
    assert proc.returncode == -9
    summary = (out / "summary.md").read_text()
    results = _results(summary)
    assert [s for s in STEPS if results[s] == "ok"] == list(STEPS[:-1]) and results[STEPS[-1]] == "not run"
    assert re.search(r"^So far: \d+ s \(limit TOTAL_S = \d+ s\)\.$", summary, re.M)
    finished = []
    for snap in sorted(snaps.iterdir()):
        done = [s for s, r in _results(snap.read_text()).items() if r != "not run"]
        if not finished or done != finished[-1]:
            finished.append(done)
    # written after the import check, then after each step: environment, contention, calibrate, build, NCCL
    assert finished == [list(STEPS[: n + 1]) for n in range(len(STEPS) - 1)]


def test_megatron_lm_rehearsal_checks_the_line_for_every_release(tmp_path):
    proc = _run(["bash", str(GPU / "megatron_lm_check.sh"), "--rehearse", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doctor = (tmp_path / "out" / "doctor.log").read_text()
    assert doctor.count("lagom doctor: command line: 0 error(s)") == 3
    assert "- result: PASS" in (tmp_path / "out" / "summary.md").read_text()
    # the line as it was before --eval-interval: every release would stop on it, and so does the rehearsal
    text = (GPU / "megatron_lm_check.sh").read_text()
    old = tmp_path / "megatron_lm_check.sh"
    old.write_text(text.replace("  --eval-interval 1000 --eval-iters 1\n", ""))
    proc = _run(["bash", str(old), "--rehearse", str(tmp_path / "old")])
    assert proc.returncode == 1
    log = (tmp_path / "old" / "doctor.log").read_text()
    for line in ("training.py:3307", "training.py:3547", "training.py:4136"):
        assert line in log
