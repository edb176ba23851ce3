"""`make install` checks the Python version before creating .venv and repairs a broken .venv
(fake interpreters stand in for python and pip: nothing is downloaded)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[1]

FAKE = r"""#!/bin/bash
# a python that says it is VERSION; `-m venv DIR` copies itself there; `-m pip` is logged
if [[ "$1" == "-m" && "$2" == "venv" ]]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
if [[ "$1" == "-m" && "$2" == "pip" ]]; then echo "$*" >> "$(dirname "$0")/../../pip.log"; exit 0; fi
case "$*" in
  *platform*) echo "@VERSION@"; exit 0 ;;
  *version_info*) [[ "@VERSION@" == 3.1[1-9]* ]]; exit $? ;;
esac
exit 0
"""


def _tree(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def _fake(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE.replace("@VERSION@", version))
    path.chmod(0o755)
    return path


def _make(tree: Path, python: Path):
    return subprocess.run(
        ["make", "install", f"PYTHON={python}", "VENV=venv"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_old_python_is_refused_before_anything_is_installed(tmp_path):
    tree = _tree(tmp_path)
    proc = _make(tree, _fake(tmp_path / "py310", "3.10.13"))
    assert proc.returncode != 0
    assert "is Python 3.10.13; lagom-megatron needs Python >= 3.11 (pyproject.toml)" in proc.stderr, proc.stderr
    assert not (tree / "venv").exists() and not (tree / "pip.log").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_venv_of_another_python_is_named_and_recreated(tmp_path):
    tree = _tree(tmp_path)
    _fake(tree / "venv" / "bin" / "python", "3.10.13")  # what an earlier `make PYTHON=python3.10` left
    proc = _make(tree, _fake(tmp_path / "py311", "3.11.7"))
    assert proc.returncode == 0, proc.stderr
    assert (
        "make: venv is broken or made with another Python (3.10.13); removing it and creating it again" in proc.stderr
    )
    assert (tree / "venv" / ".lagom-installed").exists()
    assert "3.11.7" in (tree / "venv" / "bin" / "python").read_text()
    pip = (tree / "pip.log").read_text().splitlines()
    assert pip == ["-m pip install -q --upgrade pip", "-m pip install -q torch==2.13.0", "-m pip install -q -e .[test]"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("python", ["no-such-python-here", "/bin/false"])
def test_a_python_that_does_not_run_is_named_as_such(tmp_path, python):
    tree = _tree(tmp_path)
    proc = _make(tree, python)
    assert proc.returncode != 0
    assert (
        f"make: {python} does not run (not found, or not a Python); lagom-megatron needs Python >= 3.11" in proc.stderr
    ), proc.stderr
    assert not (tree / "venv").exists()
