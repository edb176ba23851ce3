"""Turns lagom's NCCL tuner plugin on for every rank at launch: locates or builds it and gives the variables to export.

NCCL loads a tuner once per process, at the first communicator, from ``NCCL_TUNER_PLUGIN`` (v2.30.7
``src/plugin/tuner.cc:37-60``; unset: never lagom's, :62-71), so every rank needs its absolute path first.
``LAGOM_TUNER_CONFIG`` starts "" (no table); the pool names one per communicator. A user's value is never replaced.
Without the plugin: communicator mode (NCCL 2.24+), else CTA bounds only (docs/nccl.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, MutableMapping

from lagom_megatron.nccl.env_grammar import parse_version
from lagom_megatron.nccl.plugin.build import HEADERS, LIBRARY_NAME, PLUGIN_DIR, TUNER_SOURCES, build_tuner

PLUGIN_VAR = "NCCL_TUNER_PLUGIN"
PROFILER_VAR = "NCCL_PROFILER_PLUGIN"
"""Also NCCL's profiler plugin (read once per process, v2.30.7 ``src/plugin/profiler.cc:46-71``); a user's is kept."""
TABLE_VAR = "LAGOM_TUNER_CONFIG"
DIR_VAR = "LAGOM_TUNER_DIR"
"""Where the library is looked for and built; default ``<source tree>/build/nccl-plugin``."""


def plugin_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$LAGOM_TUNER_DIR``, else ``build/nccl-plugin`` under the source tree holding this package (absolute)."""
    environ = os.environ if environ is None else environ
    if environ.get(DIR_VAR):
        return Path(environ[DIR_VAR]).expanduser().resolve()
    return (PLUGIN_DIR.parents[2] / "build" / "nccl-plugin").resolve()


def locate_or_build(environ: Mapping[str, str] | None = None) -> Path:
    """Absolute path of an up-to-date library in ``plugin_dir``, built (atomically) when missing or stale. Raises
    FileNotFoundError (no compiler and no library) or RuntimeError (the compiler failed)."""
    lib = built_library(environ)
    if lib is not None:
        return lib
    return build_tuner(plugin_dir(environ), cc=environ.get("CC") if environ is not None else None)


MIN_NCCL = (2, 22)
"""First NCCL that loads ``ncclTunerPlugin_v3`` (v2.22.3 ``src/misc/tuner.cc:199``); 2.21 looks up only v2/v1."""


def built_library(environ: Mapping[str, str] | None = None) -> Path | None:
    """The up-to-date ``libnccl-tuner-lagom.so`` of ``plugin_dir``, or None when it must be (re)built."""
    lib = plugin_dir(environ) / LIBRARY_NAME
    sources = [*TUNER_SOURCES, *HEADERS]
    newest = max(p.stat().st_mtime for p in sources if p.exists())
    return lib if lib.is_file() and lib.stat().st_mtime >= newest else None


def launch_env(environ: Mapping[str, str] | None = None, *, backend: str = "nccl",
               nccl_version: str | None = None, build: bool = True) -> tuple[dict[str, str], str | None]:
    """The variables to export to every rank to turn the plugin on, and a log note or None. Nothing below NCCL 2.22,
    after a failed build, in a dry run (``build=False``) without a library, or for gloo; user-set ones stay."""
    environ = os.environ if environ is None else environ
    if backend != "nccl":
        return {}, None
    version = parse_version(nccl_version)
    if version is not None and version[:2] < MIN_NCCL:
        return {}, (f"lagom: note: NCCL {nccl_version} cannot load lagom's tuner plugin (2.22+); lagom applies "
                    "CTA bounds only (docs/nccl.md)")
    out: dict[str, str] = {}
    if PLUGIN_VAR not in environ and not build:
        lib = built_library(environ)
        if lib is None:
            return {}, (f"lagom: note: a dry run builds nothing; the launch builds the NCCL tuner plugin as "
                        f"{plugin_dir(environ) / LIBRARY_NAME} and exports {PLUGIN_VAR} to every rank")
        out[PLUGIN_VAR] = str(lib)
    if PLUGIN_VAR not in environ and PLUGIN_VAR not in out:
        try:
            out[PLUGIN_VAR] = str(locate_or_build(environ))
        except (FileNotFoundError, RuntimeError, OSError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return {}, (f"lagom: warning: the NCCL tuner plugin is not available ({first}); "
                        f"{PLUGIN_VAR} stays unset and lagom uses communicator mode (docs/nccl.md)")
    tuner = out.get(PLUGIN_VAR, environ.get(PLUGIN_VAR, ""))
    if PROFILER_VAR not in environ and os.path.isabs(tuner) and os.path.basename(tuner) == LIBRARY_NAME:
        out[PROFILER_VAR] = tuner
    if TABLE_VAR not in environ:
        out[TABLE_VAR] = ""
    return out, None


def enable_in_process(environ: MutableMapping[str, str] | None = None, *, backend: str = "nccl",
                      nccl_version: str | None = None) -> str | None:
    """Sets the plugin's variables here where the launcher did not (before the first communicator); returns the note."""
    environ = os.environ if environ is None else environ
    values, note = launch_env(environ, backend=backend, nccl_version=nccl_version)
    environ.update(values)
    return note
