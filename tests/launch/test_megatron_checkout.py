"""``MEGATRON_LM_DIR`` that names no Megatron-LM checkout skips the tests that need one, naming the value and why
(they failed with an assertion or an import error instead)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.launch.megatron_checkout import CHECKOUT_FILES, megatron_lm_checkout
from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[2]


def test_what_is_and_is_not_a_checkout(tmp_path):
    assert megatron_lm_checkout({}) == (
        None,
        "MEGATRON_LM_DIR is not set: it names a Megatron-LM checkout with one of patches/ applied",
    )
    missing = str(tmp_path / "nowhere")
    assert megatron_lm_checkout({"MEGATRON_LM_DIR": missing}) == (
        None,
        f"MEGATRON_LM_DIR={missing!r} is not a folder: give a Megatron-LM checkout, or unset it",
    )
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert megatron_lm_checkout({"MEGATRON_LM_DIR": str(tmp_path)}) == (
        None,
        f"MEGATRON_LM_DIR={str(tmp_path)!r} is not a Megatron-LM checkout (it has no megatron/core, "
        "megatron/training): give one, or unset it",
    )
    for name in CHECKOUT_FILES[1:]:
        (tmp_path / name).mkdir(parents=True)
    assert megatron_lm_checkout({"MEGATRON_LM_DIR": str(tmp_path)}) == (tmp_path.resolve(), "")


def test_the_tests_that_need_a_checkout_skip_with_the_reason(tmp_path):
    env = {"MEGATRON_LM_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/launch/test_megatron_lm_real_loop.py",
            "tests/launch/test_megatron_patches.py::test_the_checkout_holds_exactly_one_of_the_patches",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reason = f"MEGATRON_LM_DIR={str(tmp_path)!r} is not a Megatron-LM checkout (it has no pretrain_gpt.py"
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2 and all(reason in line for line in skipped), proc.stdout
    assert "3 skipped" in proc.stdout
    assert list(tmp_path.iterdir()) == []
