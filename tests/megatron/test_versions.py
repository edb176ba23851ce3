"""Tested torch / megatron-core ranges: pyproject.toml and the Makefile agree with versions.py, the
installed versions are read from the code Python would import (a checkout shadows pip's copy),
and an untested version stops the run with one message naming it and the range."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lagom_megatron.megatron.hooks import versions
from lagom_megatron.megatron.hooks.versions import (
    TESTED_MEGATRON_CORE,
    TESTED_TORCH,
    UntestedVersionError,
    check_versions,
    in_range,
    installed_megatron_core,
    installed_torch,
    release,
)
from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[2]


def test_release_numbers():
    assert release("2.13.0+cpu") == (2, 13, 0)
    assert release("2.8.0a0+5228986c39.nv25.06") == (2, 8, 0)
    assert release("0.18.2rc0") == (0, 18, 2)
    with pytest.raises(ValueError, match="not a version number: 'abc'"):
        release("abc")


def test_in_range_bounds():
    assert in_range("0.16.1", TESTED_MEGATRON_CORE) and in_range("0.18.2", TESTED_MEGATRON_CORE)
    assert not in_range("0.16.0", TESTED_MEGATRON_CORE)
    assert not in_range("0.19.0", TESTED_MEGATRON_CORE) and not in_range("0.20.0", TESTED_MEGATRON_CORE)
    assert in_range("2.6.0", TESTED_TORCH) and in_range("2.14.1+cu130", TESTED_TORCH)
    assert not in_range("2.5.1", TESTED_TORCH) and not in_range("2.15.0", TESTED_TORCH)


def test_pyproject_declares_the_tested_ranges():
    deps = re.findall(r'"(torch|megatron-core)([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert dict(deps) == {
        "torch": f">={TESTED_TORCH[0]},<{TESTED_TORCH[1]}",
        "megatron-core": f">={TESTED_MEGATRON_CORE[0]},<{TESTED_MEGATRON_CORE[1]}",
    }


def test_makefile_matrix_runs_both_ends_of_the_ranges():
    text = (ROOT / "Makefile").read_text()
    lowest = re.search(r"^test-min:\n\tscripts/test_versions.sh \S+ \S+ (\S+) (\S+)$", text, re.M)
    highest = re.search(r"^test-max:\n\tscripts/test_versions.sh \S+ \S+ (\S+) (\S+)$", text, re.M)
    assert lowest and highest
    assert lowest.groups() == (TESTED_TORCH[0], TESTED_MEGATRON_CORE[0])
    torch_max, mcore_max = highest.groups()
    assert in_range(torch_max, TESTED_TORCH) and in_range(mcore_max, TESTED_MEGATRON_CORE)
    assert release(torch_max)[:2] == (release(TESTED_TORCH[1])[0], release(TESTED_TORCH[1])[1] - 1)
    assert release(mcore_max)[:2] == (release(TESTED_MEGATRON_CORE[1])[0], release(TESTED_MEGATRON_CORE[1])[1] - 1)
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "test_versions.sh")]).returncode == 0


def test_installed_versions_are_those_imported():
    import megatron.core
    import torch

    mc = installed_megatron_core()
    assert mc is not None and mc.version == megatron.core.__version__.split("+")[0]
    assert Path(mc.path) == Path(megatron.core.__file__).parent
    assert not mc.checkout  # the test environments install megatron-core with pip
    t = installed_torch()
    assert t is not None and t.version == torch.__version__


def _fake_checkout(root: Path, minor: int) -> Path:
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("raise ImportError('never imported by the version check')\n")
    (core / "package_info.py").write_text(
        textwrap.dedent(f"""\
        MAJOR = 0
        MINOR = {minor}
        PATCH = 0
        PRE_RELEASE = 'rc1'
        """)
    )
    return root


def test_a_checkout_on_the_path_is_what_counts(tmp_path):
    # A Megatron-LM checkout on PYTHONPATH shadows the pip-installed megatron-core: its
    # package_info.py names the version, and the checkout is flagged as one.
    _fake_checkout(tmp_path, 20)
    code = (
        "from lagom_megatron.megatron.hooks.versions import installed_megatron_core, untested_versions;"
        "v = installed_megatron_core(); print(v.version, v.checkout, v.path); print(untested_versions())"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    first, second = out.splitlines()
    assert first == f"0.20.0rc1 True {tmp_path / 'megatron' / 'core'}"
    assert (
        f"megatron-core 0.20.0rc1 (checkout at {tmp_path / 'megatron' / 'core'}) is outside the tested range "
        f">={TESTED_MEGATRON_CORE[0]},<{TESTED_MEGATRON_CORE[1]}" in second
    )


def test_untested_version_stops_with_one_message(monkeypatch):
    fake = versions.InstalledVersion("megatron-core", "0.19.2", "/site-packages/megatron/core", False)
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: fake)
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UntestedVersionError) as err:
        check_versions()
    message = str(err.value)
    assert message.startswith(
        f"megatron-core 0.19.2 is outside the tested range >={TESTED_MEGATRON_CORE[0]},<{TESTED_MEGATRON_CORE[1]}."
    )
    assert "--lagom-allow-untested-versions" in message and versions.ALLOW_UNTESTED_ENV in message
    warnings = check_versions(allow_untested=True)
    assert warnings == [
        f"megatron-core 0.19.2 is outside the tested range >={TESTED_MEGATRON_CORE[0]},"
        f"<{TESTED_MEGATRON_CORE[1]} (running anyway: untested versions allowed)"
    ]
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    assert check_versions() == warnings


def test_installed_versions_pass_the_check():
    assert check_versions() == []


def test_fingerprint_records_the_imported_version(monkeypatch):
    from types import SimpleNamespace

    from lagom_megatron.megatron.outputs.run_files import run_fingerprint

    fake = versions.InstalledVersion("megatron-core", "0.17.1", "/checkout/megatron/core", True)
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: fake)
    fp = run_fingerprint(SimpleNamespace(padded_vocab_size=640), backend="gloo", cluster="cpu")
    assert fp["megatron_core"] == "0.17.1" and fp["padded_vocab_size"] == 640
    assert fp["data_parallel_sharding_strategy"] is None  # not stated without Megatron-FSDP


def test_fingerprint_tells_megatron_fsdp_strategies_apart():
    """A plan tuned with one sharding strategy names other sites than another's (sim/workload_fsdp.py)."""
    from types import SimpleNamespace

    from lagom_megatron.engine.plan import Plan
    from lagom_megatron.megatron.outputs.run_files import run_fingerprint

    def fp(**kw):
        return run_fingerprint(SimpleNamespace(use_megatron_fsdp=True, **kw), backend="nccl", cluster="a40-pcie-ib200")

    full, none = (
        fp(data_parallel_sharding_strategy="optim_grads_params"),
        fp(data_parallel_sharding_strategy="no_shard"),
    )
    assert full["data_parallel_sharding_strategy"] == "optim_grads_params"
    plan = Plan(entries={}, fingerprint=full)
    assert plan.fingerprint_mismatch(none) == ["data_parallel_sharding_strategy"]
    assert plan.fingerprint_mismatch(full) == []


def test_script_refuses_an_untested_megatron_core(tmp_path):
    _fake_checkout(tmp_path, 20)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    env.pop(versions.ALLOW_UNTESTED_ENV, None)
    argv = [
        sys.executable,
        str(ROOT / "scripts" / "pretrain_gpt.py"),
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "1",
        "--train-iters",
        "1",
        "--lr",
        "1e-3",
        "--mock-data",
    ]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=COMMAND_S)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("pretrain_gpt.py: error: megatron-core 0.20.0rc1 (checkout at ")
    )
