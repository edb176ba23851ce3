"""Atomic writes (temporary file, ``os.replace``; mode 0666 less the umask, not mkstemp's 0600) and JSON reading."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Runs ``write(tmp_path)`` on a temporary file beside ``path``, then renames it over ``path`` (symlinks followed;
    pipes, devices written directly). IsADirectoryError for a folder; OSError naming ``path``; returns the path."""
    path = Path(os.path.realpath(path))  # a symlink keeps pointing where it did: write its target
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a file name")
    if path.exists() and not path.is_file():
        # a device or named pipe (/dev/stdout, /dev/null, mkfifo): write into it, never replace it
        write(str(path))
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # name the file the user asked for, not a temporary one
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Writes ``text`` to ``path`` atomically, fsynced before the rename; raises as ``write_atomic``."""

    def _write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # pipes and devices cannot be synced
                os.fsync(f.fileno())

    return write_atomic(path, _write)


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Writes ``data`` as indented JSON atomically; TypeError if not serialisable (nothing is written)."""
    return write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Reads a JSON file; FileNotFoundError, or ValueError (file, line, column) for a folder, non-UTF-8 or bad JSON."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: {json_error_text(exc)}") from None


def json_error_text(exc: json.JSONDecodeError) -> str:
    """``invalid JSON at line L column C (char N): <msg>``; json's trailing ``at`` becomes ``here``."""
    msg = exc.msg[: -len(" at")] + " here" if exc.msg.endswith(" at") else exc.msg
    return f"invalid JSON at line {exc.lineno} column {exc.colno} (char {exc.pos}): {msg}"


def yaml_error_text(exc: Exception) -> str:
    """One line for PyYAML's error ``exc`` (read by attribute): ``malformed YAML at line L column C: <problem>``."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and cmark is not None:
        context += f" started at line {cmark.line + 1} column {cmark.column + 1}"
    return f"malformed YAML{where}: {problem}" + (f" ({context})" if context else "")
