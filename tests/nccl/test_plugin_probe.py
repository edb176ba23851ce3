"""scripts/gpu/plugin_probe.py on CPU: its checks on stand-ins (a plugin status; a fake group and Work with
torch's _enable_collectives_timing / _get_duration contract, driven through lagom's own timing calls) and its skip
without a GPU; check.sh that runs it parses."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lagom_megatron.nccl.plugin_status import PluginStatus
from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("plugin_probe", ROOT / "scripts" / "gpu" / "plugin_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_status_checks(probe):
    good = PluginStatus(
        path="/p/libnccl-tuner-lagom.so", abi_version=6, init_count=2, row_hits=(0, 0), table_loaded=True
    )
    assert probe.status_checks(good) == dict.fromkeys(
        ("plugin_loaded", "plugin_abi", "plugin_initialised", "table_loaded", "table_ok"), True
    )
    assert not any(probe.status_checks(None).values())
    not_init = PluginStatus(path="p", abi_version=0, init_count=0, row_hits=(), table_loaded=False, table_failures=1)
    assert probe.status_checks(not_init) == {
        "plugin_loaded": True,
        "plugin_abi": False,
        "plugin_initialised": False,
        "table_loaded": False,
        "table_ok": False,
    }


class FakeWork:
    """Stands in for torch's WorkNCCL: _get_duration raises until the work completed, and raises
    when timing is off (torch WorkNCCL::getDuration's TORCH_CHECKs)."""

    def __init__(self, ms, timing=True):
        self.ms, self.timing, self.done = ms, timing, False

    def wait(self):
        self.done = True
        return True

    def _get_duration(self):
        if not self.timing:
            raise RuntimeError("getDuration only works if timing was enabled")
        if not self.done:
            raise RuntimeError("getDuration only works after the work has completed")
        return self.ms


class FakeGroup:
    """Stands in for a ProcessGroup: ``_enable_collectives_timing`` (torch ``ProcessGroupNCCL::enableCollectivesTiming``)
    turns timing on for the works issued after it, as torch's flag is read when a WorkNCCL is created."""

    def __init__(self, timing=False):
        self.timing, self.enabled = timing, 0

    def _enable_collectives_timing(self):
        self.enabled += 1
        self.timing = True

    def issue(self):
        work = FakeWork(1.25, timing=self.timing)
        work.wait()
        return work


def test_timing_is_turned_on_as_lagom_does(probe):
    group = FakeGroup()
    times, checks = probe.timing_as_lagom(group, group.issue)
    assert times == {"before_enable_us": None, "groups_accepted": 1, "after_enable_us": 1250.0}
    assert all(checks.values()) and group.enabled == 1
    # timing already on before the call (TORCH_NCCL_ENABLE_TIMING=1 left in the environment): not lagom's path
    times, checks = probe.timing_as_lagom(FakeGroup(timing=True), FakeGroup(timing=True).issue)
    assert times["before_enable_us"] == 1250.0 and checks["timing_off_before_enable"] is False
    # a group without the method and works without _get_duration: nothing accepted, no duration
    times, checks = probe.timing_as_lagom(object(), object)
    assert times == {"before_enable_us": None, "groups_accepted": 0, "after_enable_us": None}
    assert checks == {"timing_off_before_enable": True, "timing_enabled_on_group": False, "work_get_duration": False}


def test_probe_skips_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: check.sh runs the probe for real")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu" / "plugin_probe.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "plugin_probe.json").read_text())
    assert result["status"] == "skipped" and result["reason"] == "no CUDA device or torch without NCCL"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_check_script_parses():
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu" / "check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
