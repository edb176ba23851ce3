"""Pre-flight rules for what a run writes and binds on this machine: output folders, the plan lock, the rendezvous port.

These rules apply only to a local run (``RunShape.local``: training itself, or ``lagom doctor``
without ``--cluster``): a doctor on a login node says nothing of another machine's folders.

- Output folders (``--lagom-plan``, ``--lagom-report`` and their defaults under ``lagom_out/``,
  ``--data-cache-path``) exist as folders or can be created, and a file can be created in them:
  the check creates and removes an unnamed temporary file (``tempfile.TemporaryFile``), so a
  read-only file system or an immutable folder is caught even for root, for whom ``os.access``
  always says yes.
- One writer per plan path across jobs: the first run takes an advisory POSIX lock
  (``fcntl.lockf``, which also works over NFS through its lock manager) on ``.<plan>.lock`` beside
  the plan and writes who holds it there; a second run is refused with the holder's pid, host,
  job and start time.
- ``MASTER_PORT`` is a port number (torch reads it with ``int()``; ``torch/distributed/rendezvous.py``
  ``_env_rendezvous_handler``) and, when ``MASTER_ADDR`` is this machine and rank 0 will create
  the store itself (no torchrun agent store: ``TORCHELASTIC_USE_AGENT_STORE``), it is free;
  otherwise torch's ``TCPStore`` fails with ``EADDRINUSE`` on rank 0 while the other ranks wait.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from lagom_megatron.training.preflight_types import Finding, RunShape

DEFAULT_RUN_DIR = "lagom_out"
"""Parent of the run directory without ``--lagom-plan`` (as ``megatron.run_files.DEFAULT_RUN_DIR``)."""

_HELD: dict[str, Any] = {}
"""Plan path -> the open lock file this process holds for its whole life."""


def folder_problem(folder: Path) -> str | None:
    """Why files cannot be written in ``folder`` (created if missing), or None when they can.

    Nothing is left behind: a missing folder is not created, its nearest existing ancestor is
    tried instead.
    """
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing ancestor of {folder}"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder, so {folder} cannot be created" if probe != folder \
            else f"{folder} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        what = "written" if probe == folder else f"created ({probe} is not writable)"
        return f"{folder} cannot be {what}: {exc.strerror}"
    return None


def output_paths(args: Mapping[str, Any]) -> list[tuple[str, str, Path]]:
    """(flag, value, folder) of every output of the run (module docstring)."""
    out = []
    if args.get("lagom"):
        plan = args.get("lagom_plan")
        run_dir = Path(plan).parent if plan else Path(DEFAULT_RUN_DIR) / (args.get("preset_name") or "run")
        out.append(("--lagom-plan", plan or str(run_dir / "plan.json"), run_dir))
        report = args.get("lagom_report")
        out.append(("--lagom-report", report or str(run_dir / "report.md"),
                    Path(report).parent if report else run_dir))
    if args.get("data_cache_path"):
        out.append(("--data-cache-path", args["data_cache_path"], Path(args["data_cache_path"])))
    return out


def rule_output_folders(s: RunShape) -> list[Finding]:
    """Each output folder exists or can be created, and is writable; an existing plan is readable."""
    if not s.local:
        return []
    out, seen = [], set()
    for flag, value, folder in output_paths(s.args):
        if folder in seen:  # one line per folder (the report defaults to the plan's folder)
            continue
        seen.add(folder)
        problem = folder_problem(folder)
        if problem:
            out.append(Finding(
                "error", "output-folder", f"{flag} {value!r}: {problem}",
                "the run would train, then fail on every rank when it first writes there",
                "give a path in a folder that exists and is writable, or that can be created"))
    plan = s.args.get("lagom_plan") if s.args.get("lagom") else None
    if plan and Path(plan).is_file() and not os.access(plan, os.R_OK):
        out.append(Finding("error", "output-folder", f"--lagom-plan {plan!r} exists but cannot be read",
                           "lagom would neither reuse it nor may it overwrite a file it could not read",
                           "make the file readable, or give another --lagom-plan"))
    return out


def _lock_path(plan: str | os.PathLike) -> Path:
    p = Path(os.path.realpath(plan))
    return p.with_name(f".{p.name}.lock")


def _holder(environ: Mapping[str, str]) -> str:
    job = environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID")
    return (f"pid {os.getpid()} on host {socket.gethostname()}" + (f", job {job}" if job else "")
            + f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}")


def _try_lock(path: Path) -> tuple[int | None, str]:
    """Opens and locks ``path``; (fd, "") when locked, (None, holder text) when another process holds it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            os.close(fd)
            raise
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        return None, holder
    return fd, ""


def _in_use(plan: str, holder: str) -> str:
    return (f"--lagom-plan {plan!r} is in use by another run ({holder}); one run writes a plan path at a "
            f"time: wait for it, or give this run another --lagom-plan")


def rule_plan_lock(s: RunShape) -> list[Finding]:
    """No other run holds the plan's lock (probed and released at once; on rank 0 only, which then
    takes it with :func:`hold_plan_lock`)."""
    plan = s.args.get("lagom_plan") if s.args.get("lagom") else None
    if not s.local or not plan or str(Path(plan).resolve()) in _HELD:
        return []
    if s.environ.get("RANK", "0") != "0":
        return []  # rank 0 probes and then holds the lock; another rank's probe would race with it
    lock = _lock_path(plan)
    if Path(plan).is_dir() or not lock.is_file():
        return []  # a folder is refused by rule_output_folders; no lock file means no holder (a holder creates it)
    try:
        fd, holder = _try_lock(lock)
    except OSError:
        return []  # an unwritable folder: rule_output_folders names it
    if fd is not None:
        os.close(fd)  # closing releases the lock; the lock file stays for the next run
        return []
    return [Finding("error", "plan-lock", _in_use(plan, holder),
                    "two runs would overwrite each other's plan and verdict, and one would be lost",
                    "wait for the other run, or give another --lagom-plan")]


def hold_plan_lock(plan: str, environ: Mapping[str, str] | None = None) -> Path:
    """Takes the plan's lock for this process's life and records the holder in the lock file.

    Returns:
        The lock file's path.

    Raises:
        ValueError: another run holds it (the message names the holder and the plan).
    """
    key = str(Path(plan).resolve())
    lock = _lock_path(plan)
    if key in _HELD:
        return lock
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd, holder = _try_lock(lock)
    if fd is None:
        raise ValueError(_in_use(plan, holder))
    os.ftruncate(fd, 0)
    os.pwrite(fd, (_holder(os.environ if environ is None else environ) + "\n").encode(), 0)
    _HELD[key] = fd
    return lock


def release_plan_lock(plan: str) -> None:
    """Releases the lock :func:`hold_plan_lock` took (the process's exit does it too)."""
    fd = _HELD.pop(str(Path(plan).resolve()), None)
    if fd is not None:
        os.close(fd)


def _is_local_address(addr: str) -> bool:
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def rule_master_port(s: RunShape) -> list[Finding]:
    """``MASTER_PORT`` is an integer 1..65535 and, where rank 0 will bind it here, free (module docstring)."""
    port_text = s.environ.get("MASTER_PORT")
    if not s.local or port_text is None:
        return []
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        return [Finding("error", "master-port", f"MASTER_PORT={port_text!r} is not a port number; allowed: 1..65535",
                        "torch's env:// rendezvous reads it with int() and binds it on rank 0",
                        "export MASTER_PORT=<a free port>, e.g. 29500")]
    if s.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or s.environ.get("RANK", "0") != "0":
        return []  # torchrun's agent already bound it, or this process is not the one that binds
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return []  # a hook called after init (a Megatron-LM checkout): the store bound it itself
    addr = s.environ.get("MASTER_ADDR", "127.0.0.1")
    if not _is_local_address(addr):
        return []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore: TIME_WAIT is no conflict
        try:
            sock.bind(("", port))
            return []
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return []
    return [Finding("error", "master-port",
                    f"MASTER_PORT={port} is already in use on this machine (MASTER_ADDR={addr}); allowed: a free port",
                    "rank 0 binds the rendezvous store there; torch would fail with EADDRINUSE while the other "
                    "ranks wait", "export another MASTER_PORT, or stop the process that holds it")]
