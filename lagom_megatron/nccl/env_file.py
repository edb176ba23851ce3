"""A plan's process-scope NCCL knobs as the validated env file the launch sources (NCCL reads them once per process)."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lagom_megatron.engine.files import write_text_atomic

NTHREADS_DOMAIN = (64, 128, 256, 512)
"""NCCL_NTHREADS values NCCL accepts (threads per CTA; NCCL's docs, env.rst)."""
BUFFSIZE_MIN = 1 << 16
BUFFSIZE_MAX = 1 << 30
"""NCCL_BUFFSIZE bounds, bytes: lagom's conservative power-of-two range (NCCL documents only the 4 MiB default)."""

PROCESS_KNOBS: dict[str, str] = {
    "NCCL_NTHREADS": "CUDA threads per CTA for the Simple protocol",
    "NCCL_BUFFSIZE": "bytes of staging buffer per peer and channel (Simple protocol)",
}
PATH_VARS: dict[str, str] = {
    "NCCL_TUNER_PLUGIN": "path of libnccl-tuner-lagom.so",
    "LAGOM_TUNER_CONFIG": "path of the plan table the tuner plugin reads",
}
ALIASES = {"n_threads": "NCCL_NTHREADS", "buffsize": "NCCL_BUFFSIZE", "buffer_size": "NCCL_BUFFSIZE"}


def _int_value(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    try:
        return int(str(value).strip(), 10)
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {value!r}") from None


def validate_process_env(env: Mapping[str, Any]) -> dict[str, str]:
    """``env`` (names or ``ALIASES``) validated, as strings, knobs first; ValueError: unknown, doubled or bad entry."""
    out: dict[str, str] = {}
    for key, value in env.items():
        name = ALIASES.get(key, key)
        if name in out:
            raise ValueError(f"{name} is given twice (as {key!r} and another name)")
        if name == "NCCL_NTHREADS":
            n = _int_value(name, value)
            if n not in NTHREADS_DOMAIN:
                raise ValueError(f"NCCL_NTHREADS must be one of {list(NTHREADS_DOMAIN)}; got {n}")
            out[name] = str(n)
        elif name == "NCCL_BUFFSIZE":
            n = _int_value(name, value)
            if not BUFFSIZE_MIN <= n <= BUFFSIZE_MAX or n & (n - 1):
                raise ValueError(
                    f"NCCL_BUFFSIZE must be a power of two in {BUFFSIZE_MIN}..{BUFFSIZE_MAX} bytes; got {n}"
                )
            out[name] = str(n)
        elif name in PATH_VARS:
            if not str(value).strip() or "\n" in str(value):
                raise ValueError(f"{name} must be a non-empty path on one line; got {value!r}")
            out[name] = str(value)
        else:
            allowed = sorted([*PROCESS_KNOBS, *PATH_VARS, *ALIASES])
            raise ValueError(f"{key!r} is not a process-scope knob lagom writes; allowed: {allowed}")
    order = [*PROCESS_KNOBS, *PATH_VARS]
    return {k: out[k] for k in order if k in out}


def env_file_path(plan_path: str | os.PathLike) -> Path:
    """``runs/plan.json`` -> ``runs/plan.env`` (``plan`` -> ``plan.env``)."""
    p = Path(plan_path)
    return p.with_suffix(".env") if p.suffix else p.with_name(p.name + ".env")


def write_env_file(env: Mapping[str, Any], path: str | os.PathLike, *, source: str | None = None) -> Path:
    """Writes validated ``export VAR=value`` lines to ``path`` atomically (ValueError: ``validate_process_env``)."""
    values = validate_process_env(env)
    path = Path(path)
    lines = [
        f"# written by lagom: process-scope NCCL settings{f' of {source}' if source else ''}",
        "# NCCL reads these once per process; the launch scripts source this file before a run.",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """Reads and revalidates an env file; FileNotFoundError, or ValueError naming a bad line or value."""
    env: dict[str, str] = {}
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)
        if len(words) != 2 or words[0] != "export" or "=" not in words[1]:
            raise ValueError(f"{path}:{lineno}: expected 'export VAR=value', got {raw!r}")
        key, value = words[1].split("=", 1)
        env[key] = value
    return validate_process_env(env)


def write_plan_env_file(
    plan_path: str | os.PathLike,
    env: Mapping[str, Any],
    *,
    tuner_plugin: str | os.PathLike | None = None,
    tuner_table: str | os.PathLike | None = None,
) -> Path:
    """Writes ``env`` (and the tuner plugin and table) to ``env_file_path(plan_path)``; ValueError if invalid."""
    values: dict[str, Any] = dict(env)
    if tuner_plugin is not None:
        values["NCCL_TUNER_PLUGIN"] = os.fspath(tuner_plugin)
    if tuner_table is not None:
        values["LAGOM_TUNER_CONFIG"] = os.fspath(tuner_table)
    return write_env_file(values, env_file_path(plan_path), source=Path(plan_path).name)
