"""Tested torch / megatron-core ranges: pyproject.toml's lower bounds and the Makefile agree with versions.py, the
installed versions are read from the code Python would import (a checkout shadows pip's copy),
and an untested version stops the run with one message naming it and the range."""

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

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
    # tested: megatron-core 0.16.1 to core_v0.19.x (package_info 0.19.1, wheel 0.19.2) and main (0.20.0)
    for tested in ("0.16.1", "0.18.2", "0.19.1", "0.19.2", "0.20.0", "0.20.0rc1"):
        assert in_range(tested, TESTED_MEGATRON_CORE), tested
    assert not in_range("0.16.0", TESTED_MEGATRON_CORE) and not in_range("0.21.0", TESTED_MEGATRON_CORE)
    assert in_range("2.6.0", TESTED_TORCH) and in_range("2.14.1+cu130", TESTED_TORCH)
    assert in_range("2.15.0+cu132", TESTED_TORCH) and in_range("2.15.0a0+nv25.10", TESTED_TORCH)
    assert not in_range("2.5.1", TESTED_TORCH) and not in_range("2.16.0", TESTED_TORCH)


def test_pyproject_has_the_tested_lower_bounds_and_no_upper_bound():
    """pip keeps the torch, megatron-core and transformer-engine a user's stack holds (never downgrades them);
    the check when a run starts is the one guard above the lower bounds, which are versions.py's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [Requirement(r) for r in project["dependencies"]]
    listed += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    specifiers = {r.name: {(s.operator, s.version) for s in r.specifier} for r in listed}
    assert specifiers["torch"] == {(">=", TESTED_TORCH[0])}
    assert specifiers["megatron-core"] == {(">=", TESTED_MEGATRON_CORE[0])}
    assert specifiers["transformer-engine"] == set()


def test_makefile_matrix_runs_both_ends_of_the_ranges():
    text = (ROOT / "Makefile").read_text()
    lowest = re.search(r"^test-min:\n\tscripts/test_versions.sh \S+ \S+ (\S+) (\S+)$", text, re.M)
    highest = re.search(r"^test-max:\n\tscripts/test_versions.sh \S+ \S+ (\S+) (\S+)$", text, re.M)
    assert lowest and highest
    assert lowest.groups() == (TESTED_TORCH[0], TESTED_MEGATRON_CORE[0])
    torch_max, mcore_max = highest.groups()
    assert in_range(torch_max, TESTED_TORCH) and in_range(mcore_max, TESTED_MEGATRON_CORE)
    assert release(torch_max)[:2] == (release(TESTED_TORCH[1])[0], release(TESTED_TORCH[1])[1] - 1)
    # test-max takes the newest megatron-core wheel (0.19.x); the bound's last minor (0.20) is Megatron-LM main's,
    # tested from a checkout by tests/launch/test_megatron_lm_real_loop.py (docs/training.md, Tested versions)
    high = release(TESTED_MEGATRON_CORE[1])
    assert release(mcore_max)[:2] == (high[0], high[1] - 2)
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
    _fake_checkout(tmp_path, 21)
    code = (
        "from lagom_megatron.megatron.hooks.versions import installed_megatron_core, untested_versions;"
        "v = installed_megatron_core(); print(v.version, v.checkout, v.path); print(untested_versions())"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    first, second = out.splitlines()
    assert first == f"0.21.0rc1 True {tmp_path / 'megatron' / 'core'}"
    assert (
        f"megatron-core 0.21.0rc1 (checkout at {tmp_path / 'megatron' / 'core'}) is outside the tested range "
        f">={TESTED_MEGATRON_CORE[0]},<{TESTED_MEGATRON_CORE[1]}" in second
    )


def test_untested_version_stops_with_one_message(monkeypatch):
    fake = versions.InstalledVersion("megatron-core", "0.21.0", "/site-packages/megatron/core", False)
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: fake)
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UntestedVersionError) as err:
        check_versions()
    message = str(err.value)
    assert message.startswith(
        f"megatron-core 0.21.0 is outside the tested range >={TESTED_MEGATRON_CORE[0]},<{TESTED_MEGATRON_CORE[1]}."
    )
    assert "--lagom-allow-untested-versions" in message and versions.ALLOW_UNTESTED_ENV in message
    warnings = check_versions(allow_untested=True)
    assert warnings == [
        f"megatron-core 0.21.0 is outside the tested range >={TESTED_MEGATRON_CORE[0]},"
        f"<{TESTED_MEGATRON_CORE[1]} (running anyway: untested versions allowed)"
    ]
    assert check_versions(refuse=False) == [  # a Megatron-LM run without --lagom
        f"megatron-core 0.21.0 is outside the tested range >={TESTED_MEGATRON_CORE[0]},"
        f"<{TESTED_MEGATRON_CORE[1]} (running anyway without --lagom; with --lagom, pass "
        f"--lagom-allow-untested-versions (or set {versions.ALLOW_UNTESTED_ENV}=1))"
    ]
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    assert check_versions() == warnings == check_versions(refuse=False)


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
    """lagom's own loop refuses with or without --lagom (this line has none): the loop is lagom's code."""
    _fake_checkout(tmp_path, 21)
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
        proc.stderr.strip().splitlines()[-1].startswith("pretrain_gpt.py: error: megatron-core 0.21.0rc1 (checkout at ")
    )
