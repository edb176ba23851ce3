"""Output folders a user names: every script that writes there stops on a folder holding what it may not replace,
before it writes, with one line; or it writes beside the user's files at names that are free. A user's file stays
byte for byte in every case (``lagom_megatron.preflight.files.output_folder_problem``, the one rule; the sweep's
own test is in ``test_nccl_sweep.py``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.preflight.files import NEW_FOLDER, first_line_is, output_folder_problem
from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"
USER = b"# REAL H200 RESULTS from yesterday\n\x00\xff binary too\n"
"""A user's file: text and bytes that are not UTF-8, compared byte for byte."""


def _run(cmd, **env):
    full = {**os.environ, "PYTHON": sys.executable, **env}
    full.pop("MEGATRON_LM_DIR", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_S, env=full, cwd=ROOT)


def _users_folder(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(USER)
    return folder


def _kept(folder: Path, *names: str) -> bool:
    return all((folder / n).read_bytes() == USER for n in names)


def test_the_rule(tmp_path, monkeypatch):
    assert output_folder_problem(tmp_path / "new" / "sub") is None
    assert output_folder_problem(_users_folder(tmp_path / "empty")) is None
    full = _users_folder(tmp_path / "full", "b.md", "a.json", ".hidden", "c", "d")
    assert output_folder_problem(full) == f"{full} already holds .hidden, a.json, b.md and 2 more: {NEW_FOLDER}"
    own = full / "run.txt"
    own.write_text("# lagom-sweep op=all_gather\n")
    assert output_folder_problem(full, allowed=first_line_is("# lagom-sweep ")) == (
        f"{full} already holds .hidden, a.json, b.md and 2 more: {NEW_FOLDER}"
    )
    only_own = tmp_path / "own"
    only_own.mkdir()
    (only_own / "run.txt").write_text("# lagom-sweep op=all_gather\n")
    os.mkfifo(only_own / "pipe")  # never opened: a pipe would block the check
    assert output_folder_problem(only_own, allowed=first_line_is("# lagom-sweep ")) == (
        f"{only_own} already holds pipe: {NEW_FOLDER}"
    )
    (only_own / "pipe").unlink()
    assert output_folder_problem(only_own, allowed=first_line_is("# lagom-sweep ")) is None
    afile = full / "b.md"
    assert output_folder_problem(afile) == f"{afile} is a file, not a folder"
    assert _kept(full, "b.md", "a.json", ".hidden", "c", "d")
    # the shell scripts' call: the line on stdout and exit status 1, or nothing and 0
    proc = _run([sys.executable, "-m", "lagom_megatron.preflight.files", str(full)])
    assert (proc.returncode, proc.stdout.strip()) == (1, output_folder_problem(full))
    proc = _run([sys.executable, "-m", "lagom_megatron.preflight.files", str(only_own), "# lagom-sweep ", "advice"])
    assert (proc.returncode, proc.stdout) == (0, "")


def test_check_sh_keeps_an_earlier_runs_results(tmp_path):
    """A rehearsal given the folder of a real run stops before anything runs (it replaced summary.md and nccl.json)."""
    out = _users_folder(tmp_path / "realrun", "summary.md", "nccl.json")
    proc = _run(["bash", str(GPU / "check.sh"), "--rehearse", str(out)])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"{GPU / 'check.sh'}: OUT_DIR {out} already holds nccl.json, summary.md: {NEW_FOLDER}"
    ]
    assert _kept(out, "summary.md", "nccl.json") and sorted(p.name for p in out.iterdir()) == [
        "nccl.json",
        "summary.md",
    ]


def test_megatron_lm_check_keeps_a_users_file(tmp_path):
    out = _users_folder(tmp_path / "out", "notes.md")
    proc = _run(["bash", str(GPU / "megatron_lm_check.sh"), "--rehearse", str(out)])
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"{GPU / 'megatron_lm_check.sh'}: OUT_DIR {out} already holds notes.md: {NEW_FOLDER}"
    ]
    assert _kept(out, "notes.md") and [p.name for p in out.iterdir()] == ["notes.md"]


@pytest.mark.parametrize(
    "script, outputs",
    [("nccl_check.py", ("nccl.json", "filestore")), ("plugin_probe.py", ("plugin_probe.json", "probe_filestore"))],
)
def test_the_check_steps_write_beside_a_users_files_never_over_them(script, outputs, tmp_path):
    out = _users_folder(tmp_path / "out", outputs[0], "notes.md")
    proc = _run([sys.executable, str(GPU / script), str(out), "--rehearse"])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1] == (
        f"{script}: error: OUT_DIR {out} already holds {outputs[0]}: give a folder without "
        f"{', '.join(outputs)} (an existing file is never replaced)"
    )
    assert _kept(out, outputs[0], "notes.md")
    (out / outputs[0]).unlink()
    proc = _run([sys.executable, str(GPU / script), str(out), "--rehearse"])  # no plugin given: checks fail
    assert proc.returncode == 1 and json.loads((out / outputs[0]).read_text())["status"] == "rehearsed"
    assert _kept(out, "notes.md")


def test_contention_probe_never_replaces_a_file(tmp_path):
    folder = _users_folder(tmp_path / "d", "probe.csv", "notes.md")
    proc = _run([sys.executable, str(GPU / "contention_probe.py"), "--rehearse", "--out", str(folder / "probe.csv")])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"contention_probe.py: error: --out {str(folder / 'probe.csv')!r} exists: give a new file name "
        "(an existing file is never replaced)"
    )
    proc = _run([sys.executable, str(GPU / "contention_probe.py"), "--rehearse", "--out", str(folder / "new.csv")])
    assert proc.returncode == 0, proc.stderr
    assert _kept(folder, "probe.csv", "notes.md") and sorted(p.name for p in folder.iterdir()) == [
        "new.csv",
        "notes.md",
        "probe.csv",
    ]


@pytest.fixture
def demo(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("run_demo", ROOT / "scripts" / "run_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    return module


def test_the_demo_removes_only_what_an_earlier_demo_wrote(demo, tmp_path, capsys):
    tp, pp = (tmp_path / "runs" / "demo" / p for p in demo.PRESETS)
    # an earlier demo's files in the first folder, a user's file beside an earlier demo's in the second
    tp.mkdir(parents=True)
    (tp / "plan.json").write_text("{}")
    (tp / "report.md").write_text("r")
    demo.record(tp, set())
    pp.mkdir()
    (pp / "plan.json").write_text("{}")
    demo.record(pp, set())
    (pp / "my_notes.md").write_bytes(USER)
    assert (pp / demo.DEMO_FILES).read_text() == "plan.json\n"
    assert demo.main([]) == 2  # before building the corpus or removing anything
    assert capsys.readouterr().err.splitlines() == [
        f"run_demo: {pp} already holds my_notes.md: the demo removes only what an earlier demo wrote there; "
        "move the rest elsewhere, then run it again"
    ]
    assert _kept(pp, "my_notes.md") and sorted(p.name for p in tp.iterdir()) == [
        demo.DEMO_FILES,
        "plan.json",
        "report.md",
    ]
    assert not (tmp_path / "data").exists()
    assert demo.folder_problem(tp) is None
    demo.clear(tp)
    assert list(tp.iterdir()) == []
    (pp / "my_notes.md").unlink()
    assert demo.folder_problem(pp) is None


def test_calibrate_writes_beside_a_users_files_never_over_them(tmp_path, capsys):
    from tests.cli.test_calibrate_bandwidth import _sweep

    sweep = _users_folder(_sweep(tmp_path / "sweep", ops=("all_gather",)), "a40-pcie-ib100.calibrated.yaml", "notes.md")
    argv = ["calibrate", "bandwidth", str(sweep), "--cluster", "a40-pcie-ib100"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"lagom calibrate: error: output {sweep / 'a40-pcie-ib100.calibrated.yaml'}: exists and is not a cluster "
        "file lagom calibrate bandwidth wrote; pass --force to replace it, or give another file name"
    )
    (sweep / "a40-pcie-ib100.calibrated.yaml").rename(tmp_path / "kept.yaml")
    assert main(argv) == 0  # beside the user's notes, at the name that is now free
    assert _kept(sweep, "notes.md") and (tmp_path / "kept.yaml").read_bytes() == USER
    assert "calibrated by `lagom calibrate bandwidth`" in (sweep / "a40-pcie-ib100.calibrated.yaml").read_text()
