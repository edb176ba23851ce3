"""The GPU scripts work the first time they meet a GPU: ``check.sh --rehearse`` and
``megatron_lm_check.sh --rehearse`` run every step's command line here with stand-ins for the GPU
parts, write every file the real run writes in the format the next step reads (the contention CSV
goes through ``lagom calibrate contention`` and gives back the constants it was made with), refuse
step budgets longer than their limits and lines Megatron-LM would stop on; every script answers
``--help`` with its usage and exit 0."""

import csv
import json
import os
import re
import subprocess
import sys
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


def test_check_rehearsal_writes_what_the_next_steps_read(tmp_path):
    from lagom_megatron.sim.calibrate import fit, read_rows

    sys.path.insert(0, str(GPU))
    try:
        from contention_probe import COMPUTE_KERNELS, REHEARSAL_KAPPA, sweep_points
    finally:
        sys.path.pop(0)
    out = tmp_path / "out"
    proc = _run(["bash", str(GPU / "check.sh"), "--rehearse", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.md").read_text()
    for step in (
        "environment",
        "build tuner plugin",
        "NCCL pool + tuner plugin",
        "plugin status + capabilities",
        "contention probe",
        "lagom calibrate contention",
        "rehearsal outputs",
    ):
        assert re.search(rf"^\| {re.escape(step)} \| ok \|", summary, re.M), step
    for name in ("nccl", "plugin_probe"):
        result = json.loads((out / f"{name}.json").read_text())
        assert result["status"] == "rehearsed" and all(result["rehearsal_checks"].values()), result
    rows = read_rows(out / "contention" / "contention.csv")
    assert len(rows) == len(sweep_points()) * len(COMPUTE_KERNELS)
    fitted = yaml.safe_load((out / "contention" / "contention.fit.yaml").read_text())
    assert fitted["kappa_mem"] == pytest.approx(REHEARSAL_KAPPA["kappa_mem"], rel=1e-6)
    assert fitted["kappa_compute"] == pytest.approx(REHEARSAL_KAPPA["kappa_compute"], rel=1e-6)
    assert fit(rows).kappa_mem == pytest.approx(fitted["kappa_mem"])
    with open(out / "contention" / "contention.csv") as f:
        assert next(csv.reader(f))[0] == "gpu" and "rehearsal stand-in" in f.read()


def test_check_limits_fit_a_twelve_minute_slot_and_budgets_fit_their_limits(tmp_path):
    text = (GPU / "check.sh").read_text()
    limits = dict(re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A LIMIT=\((.*)\)", text).group(1)))
    total = int(re.search(r"^TOTAL_S=(\d+)$", text, re.M).group(1))
    assert set(limits) == {"environment", "build", "nccl", "probe", "contention", "calibrate"}
    assert sum(map(int, limits.values())) <= total <= 12 * 60 - 30  # the summary and the start-up of the shell
    budget = int(re.search(r"^CONTENTION_BUDGET_S=(\d+)$", text, re.M).group(1))
    startup = int(re.search(r"^STARTUP_S=(\d+)", text, re.M).group(1))
    assert budget + startup <= int(limits["contention"])
    too_long = tmp_path / "check.sh"  # a budget past its limit is refused before anything runs
    too_long.write_text(
        text.replace(f"CONTENTION_BUDGET_S={budget}", f"CONTENTION_BUDGET_S={int(limits['contention'])}")
    )
    proc = _run(["bash", str(too_long), "--rehearse", str(tmp_path / "out")])
    assert proc.returncode == 2
    assert f"step contention: budget {limits['contention']} s + start-up {startup} s exceeds its limit" in proc.stderr


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
