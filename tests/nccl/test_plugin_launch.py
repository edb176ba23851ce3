"""nccl/plugin_launch.py: the library located or built for the launch, and the variables every
rank gets (the SLURM side is in tests/launch/test_slurm_scripts.py)."""

import os
import shutil

import pytest

from lagom_megatron.nccl.plugin_launch import enable_in_process, launch_env, locate_or_build, plugin_dir

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")


def test_built_once_then_reused_and_rebuilt_when_stale(tmp_path):
    env = {"LAGOM_TUNER_DIR": str(tmp_path / "lib")}
    assert plugin_dir(env) == (tmp_path / "lib").resolve()
    lib = locate_or_build(env)
    assert lib.is_absolute() and lib.is_file() and lib.parent == (tmp_path / "lib").resolve()
    built = lib.stat().st_mtime_ns
    assert locate_or_build(env) == lib and lib.stat().st_mtime_ns == built, "an up-to-date library is reused"
    os.utime(lib, (0, 0))  # older than every source: rebuilt
    assert locate_or_build(env) == lib and lib.stat().st_mtime > 0


def test_in_process_variables(tmp_path):
    env = {"LAGOM_TUNER_DIR": str(tmp_path)}
    assert enable_in_process(env, nccl_version="2.27.5") is None
    assert env["NCCL_TUNER_PLUGIN"] == str(tmp_path.resolve() / "libnccl-tuner-lagom.so")
    assert env["LAGOM_TUNER_CONFIG"] == ""
    assert env["NCCL_PROFILER_PLUGIN"] == env["NCCL_TUNER_PLUGIN"], "the same library is NCCL's profiler plugin"
    mine = {"NCCL_TUNER_PLUGIN": "/opt/other/libnccl-tuner-x.so", "LAGOM_TUNER_CONFIG": "/runs/t.csv"}
    assert launch_env(mine) == ({}, None), "a user's own values are kept (and no profiler of lagom's is named)"
    theirs = {"LAGOM_TUNER_DIR": str(tmp_path), "NCCL_PROFILER_PLUGIN": "/opt/site/libnccl-profiler-x.so"}
    values, _ = launch_env(theirs, nccl_version="2.27.5")
    assert "NCCL_PROFILER_PLUGIN" not in values and values["NCCL_TUNER_PLUGIN"].endswith("libnccl-tuner-lagom.so"), (
        "a user's own profiler plugin is never replaced"
    )
    values, _ = launch_env({"NCCL_TUNER_PLUGIN": env["NCCL_TUNER_PLUGIN"]})
    assert values == {"NCCL_PROFILER_PLUGIN": env["NCCL_TUNER_PLUGIN"], "LAGOM_TUNER_CONFIG": ""}
    values, note = launch_env({"LAGOM_TUNER_DIR": str(tmp_path)}, nccl_version="2.21.5")
    assert values == {} and note == (
        "lagom: note: NCCL 2.21.5 cannot load lagom's tuner plugin (2.22+); lagom "
        "applies CTA bounds only (docs/nccl.md)"
    )
