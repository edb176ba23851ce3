"""Turns lagom's NCCL tuner plugin on for every rank at launch: locates or builds the library and
gives the variables NCCL and the plugin read.

NCCL loads a tuner plugin once per process, at the first communicator, from ``NCCL_TUNER_PLUGIN``
(NCCL v2.30.7 ``src/plugin/tuner.cc:37-60``); with the variable unset it tries
``libnccl-tuner.so`` and the network plugin, never lagom's (``tuner.cc:62-71``). So the variable
must hold the library's absolute path in every rank's environment before
``init_process_group`` creates the first communicator: the SLURM launch exports it
(``launch/slurm.py``) and the training loop sets it in-process when the launcher did not
(``training/loop.py``). The plan table variable (``LAGOM_TUNER_CONFIG``) starts empty for every
rank, so Megatron's own communicators read no table and every rank starts from the same state (the
plugin takes ``""`` as "no table" and then does not fall back to ``NCCL_TUNER_CONFIG_FILE``);
lagom's pool names a table, or ``none``, around the creation of each of its communicators.

Fallbacks when the plugin cannot be used (documented in docs/nccl.md): communicator mode
(per-communicator ``NCCL_ALGO``/``NCCL_PROTO`` and CTA bounds, NCCL >= 2.24) and CTA bounds only
(older NCCL). A variable the user set is never replaced (``lagom doctor`` checks it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, MutableMapping

from lagom_megatron.nccl.env_grammar import parse_version
from lagom_megatron.nccl.plugin.build import HEADERS, LIBRARY_NAME, PLUGIN_DIR, TUNER_SOURCES, build_tuner

PLUGIN_VAR = "NCCL_TUNER_PLUGIN"
PROFILER_VAR = "NCCL_PROFILER_PLUGIN"
"""The same library is NCCL's profiler plugin (its ``ncclProfiler_v*`` half, ``nccl/plugin/profiler.c``):
NCCL opens the library this variable names once per process, at the first communicator
(NVIDIA/nccl v2.30.7 ``src/plugin/profiler.cc:46-71``); unset, it tries ``libnccl-profiler.so``,
never lagom's. A value the user set (another profiler plugin, or ``none``) is never replaced:
lagom then checks the tuner's row hits only (``lagom doctor`` says so)."""
TABLE_VAR = "LAGOM_TUNER_CONFIG"
DIR_VAR = "LAGOM_TUNER_DIR"
"""Where the library is looked for and built; default ``<source tree>/build/nccl-plugin``."""


def plugin_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder of the plugin library: ``$LAGOM_TUNER_DIR``, else ``build/nccl-plugin`` under the
    source tree that holds this package (an absolute path in both cases)."""
    environ = os.environ if environ is None else environ
    if environ.get(DIR_VAR):
        return Path(environ[DIR_VAR]).expanduser().resolve()
    return (PLUGIN_DIR.parents[2] / "build" / "nccl-plugin").resolve()


def locate_or_build(environ: Mapping[str, str] | None = None) -> Path:
    """The absolute path of an up-to-date ``libnccl-tuner-lagom.so`` in ``plugin_dir``, built with
    gcc when missing or older than one of its C sources (the build is atomic, so ranks building at
    once are safe).

    Raises:
        FileNotFoundError: no C compiler and no library.
        RuntimeError: the compiler failed.
    """
    lib = built_library(environ)
    if lib is not None:
        return lib
    return build_tuner(plugin_dir(environ), cc=environ.get("CC") if environ is not None else None)


MIN_NCCL = (2, 22)
"""First NCCL that loads a tuner struct lagom exports (``ncclTunerPlugin_v3``, NCCL v2.22.3
``src/misc/tuner.cc:199``); 2.21 and older look up only v2/v1 (``nccl/plugin_check.py``)."""


def built_library(environ: Mapping[str, str] | None = None) -> Path | None:
    """The up-to-date ``libnccl-tuner-lagom.so`` of ``plugin_dir``, or None when it must be (re)built."""
    lib = plugin_dir(environ) / LIBRARY_NAME
    sources = [*TUNER_SOURCES, *HEADERS]
    newest = max(p.stat().st_mtime for p in sources if p.exists())
    return lib if lib.is_file() and lib.stat().st_mtime >= newest else None


def launch_env(environ: Mapping[str, str] | None = None, *, backend: str = "nccl",
               nccl_version: str | None = None, build: bool = True) -> tuple[dict[str, str], str | None]:
    """The variables to export to every rank to turn the plugin on.

    Args:
        environ: the launcher's environment (default ``os.environ``).
        backend: the cluster's backend; only "nccl" uses the plugin.
        nccl_version: the cluster's NCCL (e.g. "2.27.5"); below 2.22 NCCL cannot load lagom's
            plugin, so nothing is exported (the CTA-bounds-only fallback). None = unknown.
        build: False (a dry run): a library not built yet is not built; nothing is exported and the
            note says what the launch will build.

    Returns:
        (variables, note): ``NCCL_TUNER_PLUGIN`` (absolute path), ``NCCL_PROFILER_PLUGIN`` (the
        same library, when the tuner variable names lagom's) and ``LAGOM_TUNER_CONFIG`` ("")
        unless the user already set them; empty for gloo. ``note`` is a one-line warning when the
        library could not be built (then lagom falls back to communicator mode), else None.
    """
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
    """Sets the plugin's variables in this process's environment when the launcher did not; call it
    before the first NCCL communicator (``init_process_group``).

    Args:
        nccl_version: this process's NCCL, e.g. ``".".join(map(str, torch.cuda.nccl.version()))``.

    Returns:
        The warning line when the plugin could not be built or this NCCL cannot load it (the
        caller logs it), else None.
    """
    environ = os.environ if environ is None else environ
    values, note = launch_env(environ, backend=backend, nccl_version=nccl_version)
    environ.update(values)
    return note
