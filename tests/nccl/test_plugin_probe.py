"""scripts/gpu/plugin_probe.py on CPU: its checks on stand-ins (a plugin status, a fake Work with
torch's _get_duration contract) and its skip without a GPU; check.sh that runs it parses."""

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


def test_timed_duration(probe):
    assert probe.timed_duration_ms(FakeWork(1.25)) == 1.25
    with pytest.raises(RuntimeError, match="timing was enabled"):
        probe.timed_duration_ms(FakeWork(1.0, timing=False))
    with pytest.raises(ValueError, match="gave 0.0 ms"):
        probe.timed_duration_ms(FakeWork(0.0))


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
