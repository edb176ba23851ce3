"""The suite's wall-clock limits, all scaled by one setting: ``LAGOM_TEST_TIMEOUT_SCALE``.

No test asserts how fast anything ran (speed is the benchmarks' business, under ``scripts/`` and
``lagom bench``). Limits exist only so that a hung subprocess ends the suite instead of blocking
it: each is many times what the work takes on idle cores (a 4-iteration tiny training takes about
6 s there; the reviewed loaded machine took over 120 s), and ``LAGOM_TEST_TIMEOUT_SCALE`` (a number
> 0, default 1) multiplies every one of them, pytest-timeout's per-test limit included
(``tests/conftest.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any


def _scale() -> float:
    text = os.environ.get("LAGOM_TEST_TIMEOUT_SCALE", "1")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"LAGOM_TEST_TIMEOUT_SCALE={text!r} is not a number > 0 (the factor on every test time limit)")
    return value


SCALE = _scale()
"""The factor on every limit below (``LAGOM_TEST_TIMEOUT_SCALE``)."""

COMMAND_S = 300.0 * SCALE
"""A ``lagom`` or script subprocess that does no training (seconds)."""

LAUNCH_S = 900.0 * SCALE
"""One torchrun launch: starting the ranks and a short training, or several in one launch (seconds)."""

TEST_S = 1800.0
"""pytest-timeout's per-test limit before scaling (``pyproject.toml`` sets the same; setup included)."""


class SlowMachine(subprocess.TimeoutExpired):
    """A subprocess ran past its limit; the message says how to raise the limits."""

    def __str__(self) -> str:
        return (
            f"{super().__str__()}; the limits scale with LAGOM_TEST_TIMEOUT_SCALE (now {SCALE:g}): "
            "raise it on a slow or busy machine"
        )


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux ``/proc/<pid>/task/<tid>/children``), children first."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL to ``pid``, its process group and every descendant: torchrun starts each rank in a
    session of its own (torch ``elastic/multiprocessing/subprocess_handler/subprocess_handler.py``,
    ``start_new_session``), so the group of ``pid`` alone does not reach the ranks."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(
    argv: list, *, timeout: float, capture_output: bool = True, check: bool = False, **kwargs
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, timeout=timeout, capture_output=True, ...)`` in a session of its own,
    killed whole when the limit passes or the test is interrupted: torchrun's ranks are its children
    and hold the output pipes, so killing torchrun alone would leave ``subprocess.run`` waiting for
    them to finish (the limit would limit nothing) and leave them running after the test.

    Raises:
        SlowMachine: (a ``subprocess.TimeoutExpired``) past ``timeout`` seconds; the message
            names ``LAGOM_TEST_TIMEOUT_SCALE``, which raises every limit.
        subprocess.CalledProcessError: ``check`` and a non-zero exit status.
    """
    if capture_output:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    with subprocess.Popen(argv, start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as exc:  # the limit, or pytest-timeout / Ctrl-C interrupting the test
            kill_tree(proc.pid)
            out, err = proc.communicate()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise SlowMachine(argv, timeout, out, err) from None
            raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, argv, out, err)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def exit_after(rank: int, worker: Any, *args: Any) -> None:
    """An ``mp.spawn`` target: runs ``worker(rank, *args)``, then leaves the process with ``os._exit(0)``.

    torch 2.6's ``~ProcessGroupGloo`` joins its worker threads holding the GIL, while a thread that still frees
    its last work (an ``AsyncBarrierWork`` holding Python tensors) waits for the GIL: ``destroy_process_group``
    then never returns (py-spy: the worker's ``dist.destroy_process_group()``; gdb: ``~ProcessGroupGloo`` in
    ``thread::join``, a gloo thread in ``take_gil``). Here every destroy first sleeps, which releases the GIL for
    those threads, and the process ends without its frames' teardown, which frees the rest; an exception still
    reaches ``mp.spawn``."""
    import time

    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_after_gloo_threads(*a: Any, **kw: Any) -> Any:
        time.sleep(0.2)
        return destroy(*a, **kw)

    dist.destroy_process_group = destroy_after_gloo_threads
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
