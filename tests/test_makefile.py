"""`make install` checks the Python version before creating .venv, repairs a broken .venv, installs a CPU
torch first and never a CUDA one unasked, and keeps a torch already there (fake interpreters stand in
for python and pip, answering pip's dry runs with the reports the test lays out: nothing is downloaded)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[1]

FAKE = r"""#!/bin/bash
# a python that says it is VERSION; `-m venv DIR` copies itself there; `-m pip` is logged; a dry run prints
# the tree's index.json (cpu-index.json with --index-url; no file: pip finds nothing), an install of
# torch==V leaves V in the venv's torch-version, which importlib.metadata then reads; pip's report is read
# by the real python
tree="$(dirname "$0")/../.."
if [[ "$1" == "-m" && "$2" == "venv" ]]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
if [[ "$1" == "-m" && "$2" == "pip" ]]; then
  echo "$*" >> "$tree/pip.log"
  if [[ "$*" == *--dry-run* ]]; then
    report="$tree/index.json"; [[ "$*" == *--index-url* ]] && report="$tree/cpu-index.json"
    [[ -f "$report" ]] || exit 1
    cat "$report"; exit 0
  fi
  for a in "$@"; do [[ "$a" == torch==* ]] && echo "${a#torch==}" > "$(dirname "$0")/../torch-version"; done
  exit 0
fi
case "$*" in
  *importlib.metadata*) cat "$(dirname "$0")/../torch-version" 2>/dev/null; exit $? ;;
  *json.load*) exec @REAL@ "$@" ;;
  *platform*) echo "@VERSION@"; exit 0 ;;
  *version_info*) [[ "@VERSION@" == 3.1[1-9]* ]]; exit $? ;;
esac
exit 0
"""


def _report(*names: str) -> str:
    """pip's ``--report`` of a dry run that would install these distributions (the fields make reads)."""
    return json.dumps({"version": "1", "install": [{"metadata": {"name": n, "version": "1.0"}} for n in names]})


CPU_TORCH = _report("torch", "sympy", "filelock")
"""What torch==2.13.0 resolves to from a CPU index (or PyPI on macOS): no CUDA libraries."""
CUDA_TORCH = _report("torch", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "cuda-toolkit", "triton", "sympy")
"""What it resolves to from PyPI on Linux (names as pip reports them for torch 2.13.0 there)."""
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_CALLS = ["-m pip install -q --upgrade pip", "-m pip install -q --dry-run --report - torch==2.13.0"]


def _tree(tmp_path: Path, index: str | None = CPU_TORCH, cpu_index: str | None = None) -> Path:
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for name, report in (("index.json", index), ("cpu-index.json", cpu_index)):
        if report is not None:
            (tmp_path / name).write_text(report)
    return tmp_path


def _fake(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE.replace("@VERSION@", version).replace("@REAL@", sys.executable))
    path.chmod(0o755)
    return path


def _make(tree: Path, python: Path, *args: str):
    return subprocess.run(
        ["make", "install", f"PYTHON={python}", "VENV=venv", *args],
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
    assert pip == [*INDEX_CALLS, "-m pip install -q torch==2.13.0", "-m pip install -q -e .[test] torch==2.13.0"]


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


NO_CPU_TORCH = (
    "make: no CPU build of torch 2.13.0 for Python 3.12.1 (the package index offers a CUDA build or none, and "
    f"{CPU_INDEX} cannot be reached or has none): install the torch you want into venv "
    "first (venv/bin/pip install ...) and run make again, or run make again with TORCH_CUDA_OK=1 to take the "
    "CUDA build (several GB)"
)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("cpu_index", [None, CUDA_TORCH], ids=["cpu-index-unreachable", "cpu-index-offers-cuda"])
def test_a_cuda_torch_is_never_installed_unasked(tmp_path, cpu_index):
    tree = _tree(tmp_path, index=CUDA_TORCH, cpu_index=cpu_index)
    proc = _make(tree, _fake(tmp_path / "py312", "3.12.1"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-2:-1] == [NO_CPU_TORCH], proc.stderr
    pip = (tree / "pip.log").read_text().splitlines()
    assert pip == [*INDEX_CALLS, "-m pip install -q --dry-run --report - --index-url " + CPU_INDEX + " torch==2.13.0"]
    assert not (tree / "venv" / "torch-version").exists() and not (tree / "venv" / ".lagom-installed").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_pytorch_cpu_index_serves_where_the_package_index_has_cuda_builds_only(tmp_path):
    tree = _tree(tmp_path, index=CUDA_TORCH, cpu_index=CPU_TORCH)
    proc = _make(tree, _fake(tmp_path / "py312", "3.12.1"))
    assert proc.returncode == 0, proc.stderr
    assert (tree / "pip.log").read_text().splitlines()[len(INDEX_CALLS) :] == [
        f"-m pip install -q --dry-run --report - --index-url {CPU_INDEX} torch==2.13.0",
        f"-m pip install -q --index-url {CPU_INDEX} torch==2.13.0",
        "-m pip install -q -e .[test] torch==2.13.0",
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_torch_cuda_ok_takes_the_package_index_build(tmp_path):
    tree = _tree(tmp_path, index=CUDA_TORCH)
    proc = _make(tree, _fake(tmp_path / "py312", "3.12.1"), "TORCH_CUDA_OK=1")
    assert proc.returncode == 0, proc.stderr
    assert (tree / "pip.log").read_text().splitlines() == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q torch==2.13.0",
        "-m pip install -q -e .[test] torch==2.13.0",
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_torch_already_in_the_venv_is_kept(tmp_path):
    """An NGC-style build the user put there first: never replaced, and the project is installed with it held."""
    tree = _tree(tmp_path, index=CUDA_TORCH)
    _fake(tree / "venv" / "bin" / "python", "3.12.1")
    (tree / "venv" / "torch-version").write_text("2.15.0a0+nv25.10\n")
    proc = _make(tree, _fake(tmp_path / "py312", "3.12.1"))
    assert proc.returncode == 0, proc.stderr
    assert "make: keeping torch 2.15.0a0+nv25.10, found in venv" in proc.stdout.splitlines()
    assert (tree / "pip.log").read_text().splitlines() == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q -e .[test] torch==2.15.0a0+nv25.10",
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_test_max_names_an_interpreter_that_does_not_run(tmp_path):
    proc = subprocess.run(
        ["make", "-s", "test-max", f"PYTHON_MAX={tmp_path / 'python3.12'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode != 0
    assert proc.stderr.splitlines()[0] == (
        f"scripts/test_versions.sh: '{tmp_path / 'python3.12'}' does not run (not found, not a Python, or a pyenv "
        "shim with no PYENV_VERSION set); give its full path, e.g. make test-max PYTHON_MAX=/path/to/python3.12 "
        "(megatron-core >= 0.17 needs Python >= 3.12)"
    )
    assert not (tmp_path / "python3.12").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("target", ["test", "demo"])
def test_a_venv_whose_python_was_removed_is_recreated_before_test_or_demo(tmp_path, target):
    """``rm .venv/bin/python; make test`` stopped with Error 127: the stamp was newer than pyproject.toml."""
    tree = _tree(tmp_path)
    python = _fake(tmp_path / "py311", "3.11.7")
    assert _make(tree, python).returncode == 0
    (tree / "venv" / "bin" / "python").unlink()
    (tree / "pip.log").unlink()
    proc = subprocess.run(
        ["make", target, f"PYTHON={python}", "VENV=venv"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        "make: venv is broken or made with another Python (its python does not run); removing it and creating it again"
    )
    assert "3.11.7" in (tree / "venv" / "bin" / "python").read_text()
    assert (tree / "pip.log").read_text().splitlines() == [
        *INDEX_CALLS,
        "-m pip install -q torch==2.13.0",
        "-m pip install -q -e .[test] torch==2.13.0",
    ]
    assert (tree / "Makefile").read_bytes() == (ROOT / "Makefile").read_bytes()  # nothing else touched


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_working_venv_is_not_reinstalled(tmp_path):
    tree = _tree(tmp_path)
    python = _fake(tmp_path / "py311", "3.11.7")
    assert _make(tree, python).returncode == 0
    (tree / "pip.log").unlink()
    proc = subprocess.run(
        ["make", "test", f"PYTHON={python}", "VENV=venv"], cwd=tree, capture_output=True, text=True, timeout=COMMAND_S
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tree / "pip.log").exists() and proc.stderr == ""
