"""Every script under ``scripts/`` answers ``--help`` with its usage and exit status 0, and changes
nothing: no file of the source tree is created, removed or modified (``scripts/gpu/`` has tests of
its own)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.timeouts import COMMAND_S, run

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p
    for p in (ROOT / "scripts").rglob("*")
    if p.is_file() and p.suffix in (".py", ".sh", ".sbatch") and "gpu" not in p.relative_to(ROOT).parts
)
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache"}


def _tree() -> dict[str, tuple[int, int]]:
    """Every file of the source tree but virtual environments and caches: path -> (size, mtime ns)."""
    out = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv")]
        for name in files:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            out[os.path.relpath(path, ROOT)] = (st.st_size, st.st_mtime_ns)
    return out


def test_the_scripts_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {
        "scripts/run_demo.py",
        "scripts/pretrain_gpt.py",
        "scripts/make_sample_corpus.py",
        "scripts/test_versions.sh",
        "scripts/slurm/lagom_pretrain.sbatch",
    } <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.relative_to(ROOT).as_posix() for p in SCRIPTS])
def test_help_prints_usage_exits_0_and_changes_nothing(script, tmp_path):
    before = _tree()
    argv = [sys.executable, str(script)] if script.suffix == ".py" else ["bash", str(script)]
    proc = run([*argv, "--help"], timeout=COMMAND_S, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage:" in proc.stdout or "Options:" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    after = _tree()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == [], f"{script.name} --help changed {changed}"
    assert list(tmp_path.iterdir()) == []  # nothing written in the folder it ran from either
