"""The suite's time limits (``tests/timeouts.py``): one scale for all of them, and a limit that really
ends a torchrun launch, whose ranks sit in sessions of their own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import timeouts

# A parent that starts a child in a session of its own (as torchrun starts each rank), prints the
# child's pid, then waits for it: the child sleeps until it is killed.
PARENT = (
    "import subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'], start_new_session=True)\n"
    "print(child.pid, flush=True)\n"
    "child.wait()\n"
)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie that its (killed) parent left is reaped by init; its state is Z meanwhile
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_kill_tree_reaches_a_child_in_its_own_session():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    assert child in timeouts.descendants(parent.pid)
    assert not _gone(child)
    timeouts.kill_tree(parent.pid)
    assert parent.wait(timeout=timeouts.COMMAND_S) == -9
    deadline = time.monotonic() + timeouts.COMMAND_S  # a limit, not a speed: the kill lands when the child next runs
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not _gone(child):
        os.kill(child, 9)
        pytest.fail(f"the child {child} in its own session outlived kill_tree")


def test_every_test_limit_is_the_scaled_one(request):
    mark = request.node.get_closest_marker("timeout")
    assert mark.args[0] == pytest.approx(timeouts.TEST_S * timeouts.SCALE)
    assert timeouts.LAUNCH_S == pytest.approx(900 * timeouts.SCALE)
    assert timeouts.COMMAND_S == pytest.approx(300 * timeouts.SCALE)


@pytest.mark.parametrize("text", ["0", "-1", "abc", "inf", "nan"])
def test_a_bad_scale_is_refused_with_its_name(text, monkeypatch):
    monkeypatch.setenv("LAGOM_TEST_TIMEOUT_SCALE", text)
    with pytest.raises(ValueError, match=f"LAGOM_TEST_TIMEOUT_SCALE='{text}' is not a number > 0"):
        timeouts._scale()


def test_run_returns_what_subprocess_run_returns():
    proc = timeouts.run(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        timeout=timeouts.COMMAND_S,
        text=True,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
    with pytest.raises(subprocess.CalledProcessError):
        timeouts.run([sys.executable, "-c", "raise SystemExit(1)"], timeout=timeouts.COMMAND_S, check=True)
