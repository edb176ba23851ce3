"""Process-scope NCCL knobs of a plan, written as a shell env file beside the plan.

NCCL reads ``NCCL_NTHREADS`` and ``NCCL_BUFFSIZE`` once per process and caches them (its
``NCCL_PARAM`` getters), so a plan cannot change them in a running job. They go into
``<plan>.env`` (``runs/plan.json`` -> ``runs/plan.env``), which the launch scripts source before
starting the next run::

    # written by lagom: process-scope NCCL knobs of plan.json
    export NCCL_NTHREADS=256
    export NCCL_BUFFSIZE=2097152

The file may also carry the tuner plugin's location (``NCCL_TUNER_PLUGIN``) and the plan table
it reads (``LAGOM_TUNER_CONFIG``), which are process scope too (NCCL loads the plugin at the
first communicator creation). Every value is validated before it is written and again when read.
"""

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
"""NCCL_BUFFSIZE bounds in bytes. NCCL documents "an integer, default 4 MiB"; lagom further
requires a power of two in 64 KiB..1 GiB (our conservative choice: NCCL splits the buffer into
equal steps, and larger buffers cost GPU memory per peer and channel)."""

PROCESS_KNOBS: dict[str, str] = {
    "NCCL_NTHREADS": "CUDA threads per CTA for the Simple protocol",
    "NCCL_BUFFSIZE": "bytes of staging buffer per peer and channel (Simple protocol)",
}
"""Process-scope NCCL variables a plan may set."""
PATH_VARS: dict[str, str] = {
    "NCCL_TUNER_PLUGIN": "path of libnccl-tuner-lagom.so",
    "LAGOM_TUNER_CONFIG": "path of the plan table the tuner plugin reads",
}
"""Process-scope variables naming files."""
ALIASES = {"n_threads": "NCCL_NTHREADS", "buffsize": "NCCL_BUFFSIZE", "buffer_size": "NCCL_BUFFSIZE"}
"""Knob names a plan's ``env`` section may use instead of the NCCL variable names."""


def _int_value(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    try:
        return int(str(value).strip(), 10)
    except ValueError:
        raise ValueError(f"{name} must be an integer; got {value!r}") from None


def validate_process_env(env: Mapping[str, Any]) -> dict[str, str]:
    """Checks process-scope knobs against NCCL's domains and returns them as strings.

    Args:
        env: variable (or alias, see ``ALIASES``) -> value, e.g. ``{"NCCL_NTHREADS": 256}``.

    Returns:
        NCCL variable name -> value string, in a stable order (knobs first, then paths).

    Raises:
        ValueError: an unknown variable (names the allowed ones), NCCL_NTHREADS outside
            64/128/256/512, NCCL_BUFFSIZE not a power of two in 64 KiB..1 GiB, an empty path, or
            two names for the same variable.
    """
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
                raise ValueError(f"NCCL_BUFFSIZE must be a power of two in {BUFFSIZE_MIN}..{BUFFSIZE_MAX} "
                                 f"bytes; got {n}")
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
    """Writes validated ``export VAR=value`` lines to ``path`` atomically (temp file + rename).

    Args:
        env: see ``validate_process_env``; may be empty (the file then only has its header, so
            sourcing it is harmless).
        path: the env file, usually ``env_file_path(plan_path)``.
        source: what the values come from, for the header comment (e.g. the plan's file name).

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: see ``validate_process_env``.
    """
    values = validate_process_env(env)
    path = Path(path)
    lines = [f"# written by lagom: process-scope NCCL settings{f' of {source}' if source else ''}",
             "# NCCL reads these once per process; the launch scripts source this file before a run."]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    """Reads an env file written by ``write_env_file`` and validates it again.

    Returns:
        Variable -> value.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not ``export VAR=value`` or a comment (names the line), or a
            value outside NCCL's domain.
    """
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


def write_plan_env_file(plan_path: str | os.PathLike, env: Mapping[str, Any], *,
                        tuner_plugin: str | os.PathLike | None = None,
                        tuner_table: str | os.PathLike | None = None) -> Path:
    """Writes the env file of the plan saved at ``plan_path`` (``Plan.env`` plus, optionally,
    the tuner plugin and its table), beside it: ``runs/plan.json`` -> ``runs/plan.env``.

    Returns:
        The env file's path.

    Raises:
        ValueError: see ``validate_process_env``.
    """
    values: dict[str, Any] = dict(env)
    if tuner_plugin is not None:
        values["NCCL_TUNER_PLUGIN"] = os.fspath(tuner_plugin)
    if tuner_table is not None:
        values["LAGOM_TUNER_CONFIG"] = os.fspath(tuner_table)
    return write_env_file(values, env_file_path(plan_path), source=Path(plan_path).name)
