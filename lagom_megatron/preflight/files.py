"""Rules for what a local run writes and binds: output folders, the folder lock (``fcntl.lockf`` on LOCK_NAME, also
on NFS), ``MASTER_PORT`` (``int()`` in ``torch/distributed/rendezvous.py`` ``_env_rendezvous_handler``)."""

from __future__ import annotations

import errno
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lagom_megatron.preflight.types import Finding, RunShape

DEFAULT_RUN_DIR = "lagom_out"

LOCK_NAME = ".lagom.lock"

_HELD: dict[str, Any] = {}
"""Folder (realpath) -> the open lock fd this process holds for its whole life."""


def folder_problem(folder: Path) -> str | None:
    """Why files cannot be written in ``folder``, or None (a ``TemporaryFile``: ``os.access`` lies to root on r/o)."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            return f"no existing ancestor of {folder}"
        probe = probe.parent
    if not probe.is_dir():
        return (
            f"{probe} is a file, not a folder, so {folder} cannot be created"
            if probe != folder
            else f"{folder} is a file, not a folder"
        )
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        what = "written" if probe == folder else f"created ({probe} is not writable)"
        return f"{folder} cannot be {what}: {exc.strerror}"
    return None


NEW_FOLDER = "give a new or empty folder (nothing in this one is replaced or removed)"
"""What to do about a refused output folder (``output_folder_problem``'s default advice)."""


def output_folder_problem(
    folder: str | os.PathLike, *, allowed: Callable[[Path], bool] | None = None, advice: str = NEW_FOLDER
) -> str | None:
    """Why a script may not write its files into ``folder``, or None: ``folder_problem``, or an entry there that
    ``allowed(path)`` does not accept (the script's own earlier output, or a name it never writes); by default no
    entry is accepted: the folder must be new or empty. Nothing is written, replaced or removed."""
    folder = Path(folder)
    problem = folder_problem(folder)
    if problem or not folder.is_dir():
        return problem
    try:
        names = sorted(p.name for p in folder.iterdir() if allowed is None or not allowed(p))
    except OSError as exc:
        return f"{folder} cannot be read: {exc.strerror}"
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{folder} already holds {shown}: {advice}"


def first_line_is(prefix: str) -> Callable[[Path], bool]:
    """``allowed`` of ``output_folder_problem``: a regular file whose first line starts with ``prefix``."""

    def starts_so(path: Path) -> bool:
        if not path.is_file() or path.is_symlink():  # never open a pipe (it blocks) nor follow a link out
            return False
        try:
            with path.open("rb") as f:
                return f.readline().startswith(prefix.encode())
        except OSError:
            return False

    return starts_so


def main(argv: list[str] | None = None) -> int:
    """``python -m lagom_megatron.preflight.files FOLDER [OWN_FIRST_LINE [ADVICE]]`` (the shell scripts' check):
    prints ``output_folder_problem`` (files starting with OWN_FIRST_LINE allowed) and returns 1, or returns 0."""
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 3:
        print("usage: python -m lagom_megatron.preflight.files FOLDER [OWN_FIRST_LINE [ADVICE]]", file=sys.stderr)
        return 2
    allowed = first_line_is(args[1]) if len(args) > 1 and args[1] else None
    problem = output_folder_problem(args[0], allowed=allowed, **({"advice": args[2]} if len(args) > 2 else {}))
    if problem:
        print(problem)
    return 1 if problem else 0


def output_paths(args: Mapping[str, Any]) -> list[tuple[str, str, Path]]:
    """(flag, value, folder) of every output of the run."""
    out = []
    if args.get("lagom"):
        plan = args.get("lagom_plan")
        run_dir = Path(plan).parent if plan else Path(DEFAULT_RUN_DIR) / (args.get("preset_name") or "run")
        out.append(("--lagom-plan", plan or str(run_dir / "plan.json"), run_dir))
        report = args.get("lagom_report")
        out.append(("--lagom-report", report or str(run_dir / "report.md"), Path(report).parent if report else run_dir))
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
            out.append(
                Finding(
                    "error",
                    "output-folder",
                    f"{flag} {value!r}: {problem}",
                    "the run would train, then fail on every rank when it first writes there",
                    "give a path in a folder that exists and is writable, or that can be created",
                )
            )
    plan = s.args.get("lagom_plan") if s.args.get("lagom") else None
    if plan and Path(plan).is_file() and not os.access(plan, os.R_OK):
        out.append(
            Finding(
                "error",
                "output-folder",
                f"--lagom-plan {plan!r} exists but cannot be read",
                "lagom would neither reuse it nor may it overwrite a file it could not read",
                "make the file readable, or give another --lagom-plan",
            )
        )
    return out


def output_name_problem(args: Mapping[str, Any]) -> str | None:
    """Why two files of a ``--lagom`` run would be one (``RunFiles.name_clash``, or LOCK_NAME), or None."""
    if not args.get("lagom"):
        return None
    from lagom_megatron.megatron.outputs.run_files import RunFiles

    for flag in ("--lagom-plan", "--lagom-report"):
        value = args.get(flag[2:].replace("-", "_"))
        if value and Path(value).name == LOCK_NAME:
            return (
                f"{flag} {value!r} is the name of the lock file a run keeps in each folder it writes: "
                f"give {flag} another file name"
            )
    return RunFiles(
        plan_path=args.get("lagom_plan"), report_path=args.get("lagom_report"), preset_name=args.get("preset_name")
    ).name_clash()


def rule_output_names(s: RunShape) -> list[Finding]:
    problem = output_name_problem(s.args)
    if problem is None:
        return []
    return [
        Finding(
            "error",
            "output-names",
            problem,
            "lagom writes both files: the later one replaces the earlier, and one of them (a plan, a "
            "profile, a report or the user's file) is lost",
            "give --lagom-plan and --lagom-report names of their own",
        )
    ]


def _folder_key(folder: str | os.PathLike) -> str:
    return os.path.realpath(folder)


def _lock_path(folder: str | os.PathLike) -> Path:
    return Path(_folder_key(folder)) / LOCK_NAME


def run_folders(args: Mapping[str, Any]) -> list[tuple[str, str, Path]]:
    """(flag, value, folder) of each distinct folder (by realpath) a ``--lagom`` run writes."""
    out, seen = [], set()
    for flag, value, folder in output_paths(args):
        key = _folder_key(folder)
        if flag != "--data-cache-path" and key not in seen:
            seen.add(key)
            if flag == "--lagom-plan" and not args.get("lagom_plan"):
                value = f"{value} (the default, without --lagom-plan)"
            out.append((flag, value, folder))
    return out


def _holder(environ: Mapping[str, str]) -> str:
    job = environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID")
    return (
        f"pid {os.getpid()} on host {socket.gethostname()}"
        + (f", job {job}" if job else "")
        + f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}"
    )


def _try_lock(path: Path) -> tuple[int | None, str]:
    """(fd, "") when locked, (None, holder text) when another process holds ``path``."""
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


def _in_use(flag: str, value: str, folder: Path, holder: str) -> str:
    real = _folder_key(folder)
    where = str(folder) if real == os.path.abspath(folder) else f"{folder}, that is {real}"
    return (
        f"{flag} {value!r} is in use by another run ({holder}): one run writes a folder at a time "
        f"({where}): wait for it, or give this run another {flag}"
    )


def rule_plan_lock(s: RunShape) -> list[Finding]:
    """No other run holds a folder this run writes (probed and released at once, on rank 0)."""
    if not s.local or s.environ.get("RANK", "0") != "0":
        return []  # rank 0 probes and then holds the locks; another rank's probe would race with it
    out = []
    for flag, value, folder in run_folders(s.args):
        lock = _lock_path(folder)
        if _folder_key(folder) in _HELD or not lock.is_file():
            continue  # no lock file means no holder (a holder creates it); a missing folder has none
        try:
            fd, holder = _try_lock(lock)
        except OSError:
            continue  # an unwritable folder: rule_output_folders names it
        if fd is not None:
            os.close(fd)  # closing releases the lock; the lock file stays for the next run
            continue
        out.append(
            Finding(
                "error",
                "plan-lock",
                _in_use(flag, value, folder, holder),
                "two runs would overwrite each other's plan, profile, report and verdict, and one would be lost",
                f"wait for the other run, or give another {flag}",
            )
        )
    return out


def hold_folder_lock(
    folder: str | os.PathLike,
    environ: Mapping[str, str] | None = None,
    *,
    flag: str = "--lagom-plan",
    value: str | None = None,
) -> Path:
    """Takes ``folder``'s lock for the process's life; returns its path. ValueError: another run holds it."""
    key = _folder_key(folder)
    lock = _lock_path(folder)
    if key in _HELD:
        return lock
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd, holder = _try_lock(lock)
    if fd is None:
        raise ValueError(_in_use(flag, str(folder) if value is None else value, Path(folder), holder))
    os.ftruncate(fd, 0)
    os.pwrite(fd, (_holder(os.environ if environ is None else environ) + "\n").encode(), 0)
    _HELD[key] = fd
    return lock


def hold_run_locks(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> list[Path]:
    """:func:`hold_folder_lock` on each :func:`run_folders`; ValueError releases those taken."""
    taken: list[str] = []
    try:
        locks = []
        for flag, value, folder in run_folders(args):
            fresh = _folder_key(folder) not in _HELD
            locks.append(hold_folder_lock(folder, environ, flag=flag, value=value))
            if fresh:
                taken.append(_folder_key(folder))
        return locks
    except ValueError:
        for key in taken:
            os.close(_HELD.pop(key))
        raise


def release_folder_lock(folder: str | os.PathLike) -> None:
    fd = _HELD.pop(_folder_key(folder), None)
    if fd is not None:
        os.close(fd)


def folder_in_use(folder: str | os.PathLike) -> str | None:
    """Who holds ``folder``'s lock (pid, host, job, since), or None when no run does."""
    lock = _lock_path(folder)
    if _folder_key(folder) in _HELD:
        return f"this process, pid {os.getpid()}"
    if not lock.is_file():
        return None
    try:
        fd, holder = _try_lock(lock)
    except OSError:
        return None
    if fd is not None:
        os.close(fd)
        return None
    return holder


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
    """``MASTER_PORT`` is an integer 1..65535 and, where rank 0 will bind it here, free."""
    port_text = s.environ.get("MASTER_PORT")
    if not s.local or port_text is None:
        return []
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        return [
            Finding(
                "error",
                "master-port",
                f"MASTER_PORT={port_text!r} is not a port number; allowed: 1..65535",
                "torch's env:// rendezvous reads it with int() and binds it on rank 0",
                "export MASTER_PORT=<a free port>, e.g. 29500",
            )
        ]
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
    return [
        Finding(
            "error",
            "master-port",
            f"MASTER_PORT={port} is already in use on this machine (MASTER_ADDR={addr}); allowed: a free port",
            "rank 0 binds the rendezvous store there; torch would fail with EADDRINUSE while the other ranks wait",
            "export another MASTER_PORT, or stop the process that holds it",
        )
    ]


if __name__ == "__main__":
    sys.exit(main())
