"""Checks that ``NCCL_TUNER_PLUGIN`` names a tuner plugin NCCL will load (on a bad value NCCL silently keeps its own
tuner), and which tuner and profiler ABI NCCL will use with lagom's library. NCCL v2.30.7: ``none`` disables
(``src/plugin/tuner.cc:58-60``); else ``dlopen`` RTLD_NOW | RTLD_LOCAL (``src/os/linux.cc:52``,
``src/plugin/plugin_open.cc:41``) of the value, then ``libnccl-tuner-<value>.so``, newest known struct first
(``src/plugin/tuner.cc:73-85``). The library is probed in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping

from lagom_megatron.nccl.env_check import EnvIssue, plugin_path_missing
from lagom_megatron.nccl.env_grammar import parse_version

VAR = "NCCL_TUNER_PLUGIN"

TUNER_SYMBOLS_BY_NCCL: tuple[tuple[tuple[int, int], tuple[str, ...]], ...] = (
    ((2, 30), ("ncclTunerPlugin_v6", "ncclTunerPlugin_v5", "ncclTunerPlugin_v4", "ncclTunerPlugin_v3", "ncclTunerPlugin_v2")),
    ((2, 28), ("ncclTunerPlugin_v5", "ncclTunerPlugin_v4", "ncclTunerPlugin_v3", "ncclTunerPlugin_v2")),
    ((2, 24), ("ncclTunerPlugin_v4", "ncclTunerPlugin_v3", "ncclTunerPlugin_v2")),
    ((2, 22), ("ncclTunerPlugin_v3", "ncclTunerPlugin_v2")),
    ((0, 0), ("ncclTunerPlugin_v2", "ncclTunerPlugin_v1")),
)
"""(first NCCL release, tuner structs it looks up, newest first): v2.22.3 ``src/misc/tuner.cc:199-202``, v2.24.3
:216-222, v2.28.3 ``src/plugin/tuner.cc:72-80``, v2.30.3 (v6 first); 2.21 and older v2, v1
(``src/include/nccl_tuner.h:58`` @v2.21.5)."""

ALL_TUNER_SYMBOLS = tuple(f"ncclTunerPlugin_v{v}" for v in (6, 5, 4, 3, 2, 1))

NEWEST_TUNER_ABI = 6
"""Newest tuner ABI lagom exports: NCCL v2.30.7 has ``tuner_v2.h`` .. ``tuner_v6.h`` (``src/include/plugin/tuner/``) and
looks up ``ncclTunerPlugin_v6`` first (``src/plugin/tuner.cc:73``)."""

PROFILER_VAR = "NCCL_PROFILER_PLUGIN"

PROFILER_SYMBOLS_BY_NCCL: tuple[tuple[tuple[int, int], tuple[str, ...]], ...] = (
    ((2, 29), tuple(f"ncclProfiler_v{v}" for v in (6, 5, 4, 3, 2, 1))),
    ((2, 28), tuple(f"ncclProfiler_v{v}" for v in (5, 4, 3, 2, 1))),
    ((2, 27), tuple(f"ncclProfiler_v{v}" for v in (4, 3, 2, 1))),
    ((2, 26), ("ncclProfiler_v3", "ncclProfiler_v2", "ncclProfiler_v1")),
    ((2, 24), ("ncclProfiler_v2", "ncclProfiler_v1")),
    ((2, 23), ("ncclProfiler_v1",)),
    ((0, 0), ()),
)
"""(first NCCL release, profiler structs it looks up, newest first): v2.23.4 ``src/misc/profiler.cc:21,119``, v2.24.3
and v2.25.1 :220-223; v2.26.2, v2.27.3, v2.28.3, v2.29.2 and v2.30.7 ``src/plugin/profiler.cc:73-88``."""

ALL_PROFILER_SYMBOLS = PROFILER_SYMBOLS_BY_NCCL[0][1]

_PROBE = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_LOCAL)\n"
    "except OSError as exc:\n"
    "    print('LOAD-ERROR', exc); sys.exit(0)\n"
    "print(' '.join(s for s in sys.argv[2:] if hasattr(lib, s)))\n"
)


def _symbols_for(table: tuple[tuple[tuple[int, int], tuple[str, ...]], ...], every: tuple[str, ...],
                 nccl_version: str | None) -> tuple[str, ...]:
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


def probe_library(path: str, symbols: tuple[str, ...] = ALL_TUNER_SYMBOLS, timeout_s: float = 30.0
                  ) -> tuple[tuple[str, ...], str | None]:
    """Loads ``path`` as NCCL does, in a child process: (exported ``symbols``, None) or ((), the loader's error)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, path, *symbols], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return (), f"loading it took longer than {timeout_s:.0f} s"
    out = proc.stdout.strip()
    if proc.returncode != 0:
        return (), (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    if out.startswith("LOAD-ERROR"):
        return (), out[len("LOAD-ERROR"):].strip()
    return tuple(out.split()), None


def check_tuner_plugin(environ: Mapping[str, str] | None = None, *, nccl_version: str | None = None,
                       probe: bool = True) -> list[EnvIssue]:
    """At most one error ``EnvIssue``: an ``NCCL_TUNER_PLUGIN`` that is ``none``, relative, unloadable or without a
    struct ``nccl_version`` looks up. Unset is fine; a missing file is ``env_check``'s."""
    environ = os.environ if environ is None else environ
    value = environ.get(VAR)
    if value is None:
        return []
    shown = f"{VAR}={value!r}"
    if value.strip().lower() == "none" or not value.strip():
        return [EnvIssue(
            "error", VAR, value, f"{shown} disables the tuner plugin",
            "NCCL skips every tuner plugin for 'none' (src/plugin/tuner.cc:58-60) and an empty value "
            "names no library, so a plan's per-collective choices are never applied",
            f"set {VAR} to the absolute path of libnccl-tuner-lagom.so (lagom build-tuner), or unset it",
        )]
    if "/" in value and not os.path.isabs(value):
        return [EnvIssue(
            "error", VAR, value, f"{shown} is a relative path",
            "NCCL dlopens it relative to each rank's working directory, which the launcher may change "
            "per node; where it does not resolve NCCL silently keeps its internal tuner",
            f"set {VAR} to an absolute path, e.g. {os.path.abspath(value)}",
        )]
    if "/" not in value or plugin_path_missing(value) or not probe:
        return []  # a loader-path name, or a missing file (env_check reports that)
    wanted = tuner_symbols_for(nccl_version)
    exported, error = probe_library(value, ALL_TUNER_SYMBOLS + ALL_PROFILER_SYMBOLS)
    if error is not None:
        return [EnvIssue(
            "error", VAR, value, f"{shown} does not load: {error}",
            "NCCL dlopens it with RTLD_NOW and, when that fails, silently keeps its internal tuner "
            "(src/plugin/plugin_open.cc:41, src/plugin/tuner.cc:62-66)",
            "rebuild the plugin on this system (lagom build-tuner) or point the variable at a loadable library",
        )]
    if not set(exported) & set(wanted):
        profilers = [n for n in exported if n.startswith("ncclProfiler_")]
        exported = tuple(n for n in exported if n.startswith("ncclTunerPlugin_"))
        has = f"it exports {', '.join(exported)}" if exported else "it exports no ncclTunerPlugin_v* struct"
        has += f" (profiler structs: {', '.join(profilers)})" if profilers else " and no ncclProfiler_v* struct"
        need = f"NCCL {nccl_version}" if nccl_version and wanted != ALL_TUNER_SYMBOLS else "NCCL"
        return [EnvIssue(
            "error", VAR, value, f"{shown} has none of the symbols {need} looks up ({', '.join(wanted)})",
            f"{has}; NCCL then reports the plugin unsupported at INFO level and keeps its internal "
            "tuner (src/plugin/tuner.cc:73-88); lagom's plugin exports v3-v6, which NCCL 2.22+ reads",
            f"point {VAR} at libnccl-tuner-lagom.so (lagom build-tuner)"
            + (", and use NCCL 2.22 or newer" if "ncclTunerPlugin_v3" not in wanted else ""),
        )]
    return []


def plugin_abi_report(environ: Mapping[str, str] | None = None, *, nccl_version: str | None = None,
                      probe: bool = True) -> tuple[str | None, list[EnvIssue]]:
    """(a line on the ABIs NCCL will use with the plugin library, or None; a warning when ``NCCL_PROFILER_PLUGIN`` is
    ``none`` (``src/plugin/profiler.cc:58-60``) or another library: lagom then checks only row hits)."""
    environ = os.environ if environ is None else environ
    tuner_lib = environ.get(VAR, "")
    if not probe or not os.path.isabs(tuner_lib) or plugin_path_missing(tuner_lib):
        return None, []
    exported, error = probe_library(tuner_lib, ALL_TUNER_SYMBOLS + ALL_PROFILER_SYMBOLS)
    if error is not None:
        return None, []  # check_tuner_plugin reports it
    tuner, profiler = abis_in_use(exported, nccl_version)
    nccl = f"NCCL {nccl_version}" if nccl_version else "NCCL (version unknown: newest lookup order)"
    issues: list[EnvIssue] = []
    value = environ.get(PROFILER_VAR)
    same = not value or (os.path.isabs(value) and os.path.realpath(value) == os.path.realpath(tuner_lib))
    abi = f"{profiler} (profiler ABI v{profiler.rsplit('v', 1)[1]})" if profiler else "no profiler struct"
    if profiler is not None and not same:
        why = (f"{PROFILER_VAR}='none' disables profiler plugins" if value.strip().lower() == "none" else
               f"{PROFILER_VAR}={value!r} names another profiler plugin, which lagom never replaces")
        issues.append(EnvIssue(
            "warning", PROFILER_VAR, value, f"{why}: lagom checks only the tuner's row hits, not what NCCL ran",
            "the observed check reads lagom's own profiler records (docs/nccl.md, 'Applied = observed')",
            f"keep it, or set {PROFILER_VAR}={tuner_lib} to check what NCCL ran"))
        profiler_used = f"no profiler of lagom's ({PROFILER_VAR}={value})"
    elif profiler is not None and not value:
        profiler_used = f"{abi}, once {PROFILER_VAR} names it (lagom's launch sets it when unset)"
    else:
        profiler_used = abi
    tuner_used = f"{tuner} (tuner ABI v{tuner.rsplit('v', 1)[1]})" if tuner else "no tuner struct"
    return f"{nccl} will use, of {tuner_lib}: {tuner_used}; {profiler_used}", issues
