"""Turns lagom's NCCL tuner plugin on for every rank at launch, before NCCL loads one from ``NCCL_TUNER_PLUGIN`` at
the first communicator (v2.30.7 ``src/plugin/tuner.cc:37-60``; unset: never lagom's, :62-71)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from lagom_megatron.engine.cluster import parse_version
from lagom_megatron.nccl.env_check import EnvIssue, plugin_path_missing
from lagom_megatron.nccl.plugin.build import HEADERS, LIBRARY_NAME, PLUGIN_DIR, TUNER_SOURCES, build_tuner

PLUGIN_VAR = "NCCL_TUNER_PLUGIN"
PROFILER_VAR = "NCCL_PROFILER_PLUGIN"
"""Also NCCL's profiler plugin (read once per process, v2.30.7 ``src/plugin/profiler.cc:46-71``); a user's is kept."""
TABLE_VAR = "LAGOM_TUNER_CONFIG"
DIR_VAR = "LAGOM_TUNER_DIR"


def plugin_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$LAGOM_TUNER_DIR``, else ``build/nccl-plugin`` under the source tree holding this package (absolute)."""
    environ = os.environ if environ is None else environ
    if environ.get(DIR_VAR):
        return Path(environ[DIR_VAR]).expanduser().resolve()
    return (PLUGIN_DIR.parents[2] / "build" / "nccl-plugin").resolve()


def locate_or_build(environ: Mapping[str, str] | None = None) -> Path:
    """Absolute path of an up-to-date library in ``plugin_dir``, built when stale; FileNotFoundError, RuntimeError."""
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


def launch_env(
    environ: Mapping[str, str] | None = None,
    *,
    backend: str = "nccl",
    nccl_version: str | None = None,
    build: bool = True,
) -> tuple[dict[str, str], str | None]:
    """Variables every rank needs for the plugin (user-set ones stay) and a note; none below NCCL 2.22 or for gloo."""
    environ = os.environ if environ is None else environ
    if backend != "nccl":
        return {}, None
    try:
        version = parse_version(nccl_version) if nccl_version else None
    except ValueError:
        version = None
    if version is not None and version[:2] < MIN_NCCL:
        return {}, (
            f"lagom: note: NCCL {nccl_version} cannot load lagom's tuner plugin (2.22+); lagom applies "
            "CTA bounds only (docs/nccl.md)"
        )
    out: dict[str, str] = {}
    if PLUGIN_VAR not in environ and not build:
        lib = built_library(environ)
        if lib is None:
            return {}, (
                f"lagom: note: a dry run builds nothing; the launch builds the NCCL tuner plugin as "
                f"{plugin_dir(environ) / LIBRARY_NAME} and exports {PLUGIN_VAR} to every rank"
            )
        out[PLUGIN_VAR] = str(lib)
    if PLUGIN_VAR not in environ and PLUGIN_VAR not in out:
        try:
            out[PLUGIN_VAR] = str(locate_or_build(environ))
        except (FileNotFoundError, RuntimeError, OSError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return {}, (
                f"lagom: warning: the NCCL tuner plugin is not available ({first}); "
                f"{PLUGIN_VAR} stays unset and lagom uses communicator mode (docs/nccl.md)"
            )
    tuner = out.get(PLUGIN_VAR, environ.get(PLUGIN_VAR, ""))
    if PROFILER_VAR not in environ and os.path.isabs(tuner) and os.path.basename(tuner) == LIBRARY_NAME:
        out[PROFILER_VAR] = tuner
    if TABLE_VAR not in environ:
        out[TABLE_VAR] = ""
    return out, None


def enable_in_process(
    environ: MutableMapping[str, str] | None = None, *, backend: str = "nccl", nccl_version: str | None = None
) -> str | None:
    """Sets the plugin's variables here where the launcher did not (before the first communicator); returns the note."""
    environ = os.environ if environ is None else environ
    values, note = launch_env(environ, backend=backend, nccl_version=nccl_version)
    environ.update(values)
    return note


VAR = "NCCL_TUNER_PLUGIN"

TUNER_SYMBOLS_BY_NCCL: tuple[tuple[tuple[int, int], tuple[str, ...]], ...] = (
    ((2, 32), tuple(f"ncclTunerPlugin_v{v}" for v in (7, 6, 5, 4, 3, 2))),
    (
        (2, 30),
        ("ncclTunerPlugin_v6", "ncclTunerPlugin_v5", "ncclTunerPlugin_v4", "ncclTunerPlugin_v3", "ncclTunerPlugin_v2"),
    ),
    ((2, 28), ("ncclTunerPlugin_v5", "ncclTunerPlugin_v4", "ncclTunerPlugin_v3", "ncclTunerPlugin_v2")),
    ((2, 24), ("ncclTunerPlugin_v4", "ncclTunerPlugin_v3", "ncclTunerPlugin_v2")),
    ((2, 22), ("ncclTunerPlugin_v3", "ncclTunerPlugin_v2")),
    ((0, 0), ("ncclTunerPlugin_v2", "ncclTunerPlugin_v1")),
)
"""(first NCCL, tuner structs it looks up, newest first): v2.22.3 ``src/misc/tuner.cc:199-202``, v2.24.3 :216-222,
v2.28.3 ``src/plugin/tuner.cc:72-80``, v2.30.3 (v6 first; still so in the 2.31.2 library), 2.32 code
``src/plugin/tuner.cc:76-91`` @2449986f (v7 first; the 2.32.6 library names ``ncclTunerPlugin_v7``); older v2, v1
(``src/include/nccl_tuner.h:58`` @v2.21.5)."""

ALL_TUNER_SYMBOLS = tuple(f"ncclTunerPlugin_v{v}" for v in (7, 6, 5, 4, 3, 2, 1))

NEWEST_TUNER_ABI = 7
"""Newest tuner ABI lagom exports = NCCL 2.32's (``src/include/plugin/tuner/tuner_v7.h:55-117`` @2449986f)."""

PROFILER_SYMBOLS_BY_NCCL: tuple[tuple[tuple[int, int], tuple[str, ...]], ...] = (
    ((2, 31), tuple(f"ncclProfiler_v{v}" for v in (7, 6, 5, 4, 3, 2, 1))),
    ((2, 29), tuple(f"ncclProfiler_v{v}" for v in (6, 5, 4, 3, 2, 1))),
    ((2, 28), tuple(f"ncclProfiler_v{v}" for v in (5, 4, 3, 2, 1))),
    ((2, 27), tuple(f"ncclProfiler_v{v}" for v in (4, 3, 2, 1))),
    ((2, 26), ("ncclProfiler_v3", "ncclProfiler_v2", "ncclProfiler_v1")),
    ((2, 24), ("ncclProfiler_v2", "ncclProfiler_v1")),
    ((2, 23), ("ncclProfiler_v1",)),
    ((0, 0), ()),
)
"""(first NCCL release, profiler structs it looks up, newest first): v2.23.4 ``src/misc/profiler.cc:21,119``, v2.24.3
and v2.25.1 :220-223; v2.26.2, v2.27.3, v2.28.3, v2.29.2 and v2.30.7 ``src/plugin/profiler.cc:73-88``; 2.31.2
``src/plugin/profiler.cc:123-141`` @8898068. The 2.32.6 library also names ``ncclProfiler_v8`` (its header is not
read, lagom exports no v8) besides v7 .. v1, so 2.32 is listed with 2.31's order: the struct it takes from lagom is
v7."""

ALL_PROFILER_SYMBOLS = PROFILER_SYMBOLS_BY_NCCL[0][1]

_PROBE = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_LOCAL)\n"
    "except OSError as exc:\n"
    "    print('LOAD-ERROR', exc); sys.exit(0)\n"
    "print(' '.join(s for s in sys.argv[2:] if hasattr(lib, s)))\n"
)


def _symbols_for(
    table: tuple[tuple[tuple[int, int], tuple[str, ...]], ...], every: tuple[str, ...], nccl_version: str | None
) -> tuple[str, ...]:
    try:
        version = parse_version(nccl_version) if nccl_version else None
    except ValueError:
        version = None
    if version is None:
        return every
    for first, names in table:
        if tuple(version[:2]) >= first:
            return names
    return table[-1][1]


def tuner_symbols_for(nccl_version: str | None) -> tuple[str, ...]:
    """The tuner struct names NCCL ``nccl_version`` looks up, newest first; all known names when None or unparsable."""
    return _symbols_for(TUNER_SYMBOLS_BY_NCCL, ALL_TUNER_SYMBOLS, nccl_version)


def profiler_symbols_for(nccl_version: str | None) -> tuple[str, ...]:
    """The profiler struct names NCCL ``nccl_version`` looks up, newest first (empty before 2.23); all when unknown."""
    return _symbols_for(PROFILER_SYMBOLS_BY_NCCL, ALL_PROFILER_SYMBOLS, nccl_version)


def abis_in_use(exported: tuple[str, ...] | list[str], nccl_version: str | None) -> tuple[str | None, str | None]:
    """(tuner, profiler) struct NCCL ``nccl_version`` takes from a library exporting ``exported``; None where none."""
    have = set(exported)
    tuner = next((n for n in tuner_symbols_for(nccl_version) if n in have), None)
    profiler = next((n for n in profiler_symbols_for(nccl_version) if n in have), None)
    return tuner, profiler


def probe_library(
    path: str, symbols: tuple[str, ...] = ALL_TUNER_SYMBOLS, timeout_s: float = 30.0
) -> tuple[tuple[str, ...], str | None]:
    """Loads ``path`` as NCCL does, in a child process: (exported ``symbols``, None) or ((), the loader's error)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, path, *symbols], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return (), f"loading it took longer than {timeout_s:.0f} s"
    out = proc.stdout.strip()
    if proc.returncode != 0:
        return (), (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    if out.startswith("LOAD-ERROR"):
        return (), out[len("LOAD-ERROR") :].strip()
    return tuple(out.split()), None


def check_tuner_plugin(
    environ: Mapping[str, str] | None = None, *, nccl_version: str | None = None, probe: bool = True
) -> list[EnvIssue]:
    """At most one error: an ``NCCL_TUNER_PLUGIN`` that is ``none``, relative, unloadable or without NCCL's struct."""
    environ = os.environ if environ is None else environ
    value = environ.get(VAR)
    if value is None:
        return []
    shown = f"{VAR}={value!r}"
    if value.strip().lower() == "none" or not value.strip():
        return [
            EnvIssue(
                "error",
                VAR,
                value,
                f"{shown} disables the tuner plugin",
                "NCCL skips every tuner plugin for 'none' (src/plugin/tuner.cc:58-60) and an empty value "
                "names no library, so a plan's per-collective choices are never applied",
                f"set {VAR} to the absolute path of libnccl-tuner-lagom.so (lagom build-tuner), or unset it",
            )
        ]
    if "/" in value and not os.path.isabs(value):
        return [
            EnvIssue(
                "error",
                VAR,
                value,
                f"{shown} is a relative path",
                "NCCL dlopens it relative to each rank's working directory, which the launcher may change "
                "per node; where it does not resolve NCCL silently keeps its internal tuner",
                f"set {VAR} to an absolute path, e.g. {os.path.abspath(value)}",
            )
        ]
    if "/" not in value or plugin_path_missing(value) or not probe:
        return []  # a loader-path name, or a missing file (env_check reports that)
    wanted = tuner_symbols_for(nccl_version)
    exported, error = probe_library(value, ALL_TUNER_SYMBOLS + ALL_PROFILER_SYMBOLS)
    if error is not None:
        return [
            EnvIssue(
                "error",
                VAR,
                value,
                f"{shown} does not load: {error}",
                "NCCL dlopens it with RTLD_NOW and, when that fails, silently keeps its internal tuner "
                "(src/plugin/plugin_open.cc:41, src/plugin/tuner.cc:62-66)",
                "rebuild the plugin on this system (lagom build-tuner) or point the variable at a loadable library",
            )
        ]
    if not set(exported) & set(wanted):
        profilers = [n for n in exported if n.startswith("ncclProfiler_")]
        exported = tuple(n for n in exported if n.startswith("ncclTunerPlugin_"))
        has = f"it exports {', '.join(exported)}" if exported else "it exports no ncclTunerPlugin_v* struct"
        has += f" (profiler structs: {', '.join(profilers)})" if profilers else " and no ncclProfiler_v* struct"
        need = f"NCCL {nccl_version}" if nccl_version and wanted != ALL_TUNER_SYMBOLS else "NCCL"
        return [
            EnvIssue(
                "error",
                VAR,
                value,
                f"{shown} has none of the symbols {need} looks up ({', '.join(wanted)})",
                f"{has}; NCCL then reports the plugin unsupported at INFO level and keeps its internal "
                "tuner (src/plugin/tuner.cc:73-88); lagom's plugin exports v3-v7, which NCCL 2.22+ reads",
                f"point {VAR} at libnccl-tuner-lagom.so (lagom build-tuner)"
                + (", and use NCCL 2.22 or newer" if "ncclTunerPlugin_v3" not in wanted else ""),
            )
        ]
    return []


def plugin_abi_report(
    environ: Mapping[str, str] | None = None, *, nccl_version: str | None = None, probe: bool = True
) -> str | None:
    """A line on the ABIs NCCL will use with the plugin library, or None (a user's own ``NCCL_PROFILER_PLUGIN`` is
    warned of by ``env_check.override_issues``)."""
    environ = os.environ if environ is None else environ
    tuner_lib = environ.get(VAR, "")
    if not probe or not os.path.isabs(tuner_lib) or plugin_path_missing(tuner_lib):
        return None
    exported, error = probe_library(tuner_lib, ALL_TUNER_SYMBOLS + ALL_PROFILER_SYMBOLS)
    if error is not None:
        return None  # check_tuner_plugin reports it
    tuner, profiler = abis_in_use(exported, nccl_version)
    nccl = f"NCCL {nccl_version}" if nccl_version else "NCCL (version unknown: newest lookup order)"
    value = environ.get(PROFILER_VAR)
    same = not value or (os.path.isabs(value) and os.path.realpath(value) == os.path.realpath(tuner_lib))
    abi = f"{profiler} (profiler ABI v{profiler.rsplit('v', 1)[1]})" if profiler else "no profiler struct"
    if profiler is not None and not same:
        profiler_used = f"no profiler of lagom's ({PROFILER_VAR}={value})"
    elif profiler is not None and not value:
        profiler_used = f"{abi}, once {PROFILER_VAR} names it (lagom's launch sets it when unset)"
    else:
        profiler_used = abi
    tuner_used = f"{tuner} (tuner ABI v{tuner.rsplit('v', 1)[1]})" if tuner else "no tuner struct"
    return f"{nccl} will use, of {tuner_lib}: {tuner_used}; {profiler_used}"
