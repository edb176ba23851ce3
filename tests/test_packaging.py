"""lagom-megatron installed like any package: a wheel built from the repository carries the presets,
clusters, models and plugin sources, and from outside the checkout its ``lagom doctor`` and ``lagom
simulate`` work, ``LAGOM_CONFIGS`` still overrides the packaged configs, and torchrun starts a
2-iteration CPU training with ``-m lagom_megatron.training.pretrain_gpt``.

The wheel goes into a fresh virtual environment that sees this environment's site-packages through
a ``.pth`` line (torch, megatron-core and the rest are reused, nothing is downloaded) but not the
checkout: a path line of a ``.pth`` file does not run the ``.pth`` files found there, so the editable
install's finder stays out, and every command runs from a folder outside the checkout.

Installed beside a user's stack, the wheel's requirements keep the torch and megatron-core already there:
pip resolves it (a dry run, offline, without this machine's pip settings) in an environment holding
stand-ins of those versions, with older and newer releases on offer.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.timeouts import COMMAND_S, LAUNCH_S, run

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lagom_megatron"
SOURCES = ("pyproject.toml", "README.md", "lagom_megatron", "configs")
"""What the wheel is built from (a copy, so that the build leaves nothing in the checkout)."""
TINY = [
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
    "--vocab-size",
    "384",
    "--tokenizer-type",
    "ByteLevel",
    "--mock-data",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
    "--log-interval",
    "1",
    "--seed",
    "1234",
]


def test_the_wheel_lists_every_package_and_every_config_folder():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {
        "lagom_megatron." + ".".join(p.relative_to(PACKAGE).parts)
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE
    }
    configs = {f"lagom_megatron.configs.{p.name}" for p in (ROOT / "configs").iterdir() if p.is_dir()}
    assert set(listed) == {"lagom_megatron"} | {f.removesuffix(".__init__.py") for f in folders} | configs


def _setuptools_ok() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """lagom-megatron's wheel, built from a copy of the repository, offline."""
    if not _setuptools_ok():
        pytest.skip("building the wheel offline needs setuptools >= 77 here (torch installs it)")
    tmp = tmp_path_factory.mktemp("build")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
        else:
            shutil.copy2(ROOT / name, src / name)
    built = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        timeout=COMMAND_S,
        text=True,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = (tmp / "dist").glob("lagom_megatron-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """(the fresh environment's python, its bin folder, a folder outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "lagom_megatron/configs/presets/cpu-tp2-dp2.yaml",
        "lagom_megatron/configs/clusters/h100-sxm-ib400.yaml",
        "lagom_megatron/configs/models/tiny-gpt.yaml",
        "lagom_megatron/nccl/plugin/plugin.c",
        "lagom_megatron/nccl/plugin/lagom_tuner.h",
        "lagom_megatron/nccl/plugin/Makefile",
        "lagom_megatron/training/pretrain_gpt.py",
    ):
        assert path in names, f"{path} is not in {wheel.name}"
    venv = tmp / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=COMMAND_S, text=True)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    target = run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=COMMAND_S, text=True
    ).stdout.strip()
    reuse = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(target, "reuse_installed_packages.pth").write_text("\n".join(reuse) + "\n")
    put = run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        timeout=COMMAND_S,
        text=True,
    )
    assert put.returncode == 0, put.stdout + put.stderr
    outside = tmp / "elsewhere"
    outside.mkdir()
    return python, venv / "bin", outside


def _run(argv, outside, env=None, timeout=COMMAND_S):
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "LAGOM_CONFIGS", "LAGOM_CLUSTER", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return run([str(a) for a in argv], timeout=timeout, text=True, cwd=outside, env={**clean, **(env or {})})


def test_the_package_is_the_installed_one_not_the_checkout(installed):
    python, _, outside = installed
    proc = _run(
        [python, "-c", "import lagom_megatron; print(lagom_megatron.__file__, *lagom_megatron.configs_dir(), sep='|')"],
        outside,
    )
    where, configs, origin = proc.stdout.strip().split("|")
    assert str(ROOT) not in where and Path(where).is_relative_to(python.parent.parent), proc.stdout
    assert (origin, Path(configs)) == ("the installed package", Path(where).parent / "configs")


def test_doctor_and_simulate_from_the_installed_package(installed):
    python, bin_dir, outside = installed
    doc = _run([bin_dir / "lagom", "doctor", "--preset", "cpu-tp2-dp2", "--", "--mock-data"], outside)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert doc.stdout.splitlines()[0].startswith(
        "lagom doctor: checking cluster 'cpu-gloo' (gloo, CPU): the cluster of preset 'cpu-tp2-dp2'"
    )
    gpu = _run([bin_dir / "lagom", "doctor", "--preset", "llama3-8b-h100x8"], outside, {"NCCL_NTHREADS": "480"})
    assert gpu.returncode == 1 and "error: [nccl-env] NCCL_NTHREADS=480 is not one of 64, 128, 256, 512" in gpu.stdout
    sim = _run(
        [
            bin_dir / "lagom",
            "simulate",
            "--preset",
            "llama3-8b-h100x8",
            "--seed",
            "1",
            "--plan-out",
            outside / "plan.json",
        ],
        outside,
    )
    assert sim.returncode == 0, sim.stdout + sim.stderr
    assert "SIMULATED" in sim.stdout and (outside / "plan.json").is_file()


def test_lagom_configs_still_overrides_the_packaged_configs(installed, tmp_path):
    _, bin_dir, outside = installed
    for kind in ("clusters", "models", "presets"):
        (tmp_path / kind).mkdir()
    shutil.copy2(ROOT / "configs" / "clusters" / "cpu-gloo.yaml", tmp_path / "clusters")
    shutil.copy2(ROOT / "configs" / "models" / "tiny-gpt.yaml", tmp_path / "models")
    text = (ROOT / "configs" / "presets" / "cpu-tp2-dp2.yaml").read_text()
    (tmp_path / "presets" / "mine.yaml").write_text(text)
    env = {"LAGOM_CONFIGS": str(tmp_path)}
    mine = _run([bin_dir / "lagom", "doctor", "--preset", "mine", "--", "--mock-data"], outside, env)
    assert mine.returncode == 0 and "the cluster of preset 'mine'" in mine.stdout, mine.stdout + mine.stderr
    packaged = _run([bin_dir / "lagom", "doctor", "--preset", "llama3-8b-h100x8"], outside, env)
    assert packaged.returncode == 2
    assert packaged.stderr.strip() == (
        f"lagom doctor: error: unknown preset 'llama3-8b-h100x8'; available (from LAGOM_CONFIGS={tmp_path}): mine"
    )


@pytest.mark.distributed
def test_torchrun_starts_training_from_the_installed_module(installed):
    python, _, outside = installed
    proc = _run(
        [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "-m",
            "lagom_megatron.training.pretrain_gpt",
            *TINY,
        ],
        outside,
        {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        timeout=LAUNCH_S,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    iterations = [line for line in proc.stdout.splitlines() if " iteration " in line and "lm loss:" in line]
    assert len(iterations) == 2 and "iteration        2/       2" in iterations[-1], proc.stdout[-2000:]
    assert sorted(p.name for p in outside.iterdir()) in ([], ["plan.json"])  # nothing else written where it ran


OFFERED = {"torch": ("2.14.1", "2.16.0"), "megatron-core": ("0.18.2", "0.21.0")}
"""Beside lagom's wheel: releases below the stack's (an upper bound under it would take them) and above."""


def _pip_alone() -> dict[str, str]:
    """This environment without the user's, the site's or the machine's pip settings (config files,
    ``PIP_CONSTRAINT``, ``PIP_FIND_LINKS``, ...): a resolution then follows lagom's metadata alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _metadata(name: str, version: str) -> str:
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"


def _standin_wheel(folder: Path, name: str, version: str) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{dist}.dist-info/METADATA": _metadata(name, version),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{dist}.dist-info/RECORD"])
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def _installed_standin(purelib: Path, name: str, version: str) -> None:
    info = purelib / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(_metadata(name, version))
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _requirements(wheel: Path) -> list[Requirement]:
    """The wheel's own requirements (not its extras')."""
    with zipfile.ZipFile(wheel) as whl:
        meta = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    listed = [Requirement(line.split(":", 1)[1]) for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    return [r for r in listed if r.marker is None or r.marker.evaluate({"extra": ""})]


@pytest.mark.parametrize(
    "held",
    [{"torch": "2.15.0", "megatron-core": "0.19.2"}, {"torch": "2.15.0a0+nv25.10", "megatron-core": "0.20.0"}],
    ids=["pypi-wheels", "ngc-container-megatron-lm-main"],
)
def test_pip_keeps_the_torch_and_megatron_core_of_the_users_stack(wheel, tmp_path, held):
    venv = tmp_path / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=COMMAND_S, text=True)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    purelib = run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=COMMAND_S, text=True
    ).stdout.strip()
    for req in _requirements(wheel):  # each at the stack's version, else at its lowest allowed
        lowest = [s.version for s in req.specifier if s.operator == ">="]
        _installed_standin(Path(purelib), req.name, held.get(req.name) or lowest[0])
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy2(wheel, links)
    for name, versions in OFFERED.items():
        for version in versions:
            _standin_wheel(links, name, version)

    def resolve(*extra: str) -> dict[str, str]:
        report = tmp_path / "report.json"
        argv = [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "-q", "--no-index"]
        argv += ["--find-links", str(links), "--report", str(report), "lagom-megatron", *extra]
        proc = run(argv, timeout=COMMAND_S, text=True, env=_pip_alone())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return {d["metadata"]["name"]: d["metadata"]["version"] for d in json.loads(report.read_text())["install"]}

    lagom = {"lagom-megatron": wheel.name.split("-")[1]}
    assert resolve() == lagom
    # the stand-ins can be replaced: under the upper bounds pyproject.toml had before, pip takes the releases below
    assert resolve("torch<2.15", "megatron-core<0.19") == {**lagom, "torch": "2.14.1", "megatron-core": "0.18.2"}
