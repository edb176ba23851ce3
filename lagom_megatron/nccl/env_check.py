"""Checks of NCCL variables against NCCL's domains (``docs/userguide/source/env.rst``, ``src/graph/tuning.cc``,
``src/init.cc``), as NCCL ignores or clamps most bad values silently; lagom also forbids forced LL128 (NCCL issues 786,
1261) and a global algorithm list without Ring (NCCL issue 653, PyTorch PR 163063)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from lagom_megatron.engine.cluster import parse_version
from lagom_megatron.nccl.env_vars import (
    ALGORITHM_SINCE,
    CTA_POLICIES,
    FUNCTIONS,
    LAGOM_VARIABLES,
    MAX_CGA_CLUSTER_SIZE,
    NTHREADS_ALLOWED,
    PER_FUNCTION_SYNTAX_VERSION,
    PROTOCOLS,
    max_ctas,
    parse_selection,
)

Level = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class EnvIssue:
    """One variable's problem; "error": NCCL fails, ignores or clamps it, or lagom forbids it; "warning": legal."""

    level: Level
    variable: str
    value: str
    what: str
    why: str
    fix: str


def _int_value(var: str, value: str, issues: list[EnvIssue]) -> int | None:
    try:
        return int(value.strip(), 0)
    except ValueError:
        issues.append(
            EnvIssue(
                "error",
                var,
                value,
                f"{var}={value!r} is not an integer",
                "NCCL reads integer variables with strtoll and silently falls back to its default on "
                "anything else (src/misc/param.cc, INFO log only)",
                f"set {var} to an integer or unset it",
            )
        )
        return None


def _check_selection(
    var: str, value: str, kind: Literal["algorithm", "protocol"], version, issues: list[EnvIssue]
) -> None:
    try:
        enabled = parse_selection(value, kind)
    except ValueError as exc:
        allowed = ", ".join(ALGORITHM_SINCE if kind == "algorithm" else PROTOCOLS)
        issues.append(
            EnvIssue(
                "error",
                var,
                value,
                f"{var}={value!r}: {exc}",
                "NCCL 2.24+ fails the first collective with ncclInvalidUsage on a bad token or prefix "
                "(src/graph/tuning.cc, parseList)",
                f"use a comma list of {allowed}, '^' to exclude, and 'function:list' entries after the "
                f"first (e.g. 'ring,tree' or '^LL128;allreduce:LL,Simple')",
            )
        )
        return
    if version is not None and (";" in value or ":" in value) and version[:2] < PER_FUNCTION_SYNTAX_VERSION:
        issues.append(
            EnvIssue(
                "error",
                var,
                value,
                f"{var}={value!r} uses the per-function form, which needs NCCL 2.24+",
                f"the cluster's NCCL is {'.'.join(map(str, version))}; older releases do not parse "
                "'function:list' entries",
                "use one list for all functions, or upgrade NCCL",
            )
        )
    if kind == "algorithm":
        used = {canon for f in FUNCTIONS for canon in enabled[f]}
        if version is not None:
            for algo in sorted(used):
                first = ALGORITHM_SINCE[algo]
                if version[:2] < first and algo.lower() in value.lower():
                    issues.append(
                        EnvIssue(
                            "error",
                            var,
                            value,
                            f"{var} names {algo}, which needs NCCL {first[0]}.{first[1]}+",
                            f"the cluster's NCCL is {'.'.join(map(str, version))}",
                            f"drop {algo} from {var} or upgrade NCCL",
                        )
                    )
        first_entry = [e for e in value.split(";") if e][0]
        if ":" not in first_entry and "Ring" not in parse_selection(first_entry, kind)["AllReduce"]:
            issues.append(
                EnvIssue(
                    "error",
                    var,
                    value,
                    f"{var}={value!r} takes Ring away from every collective",
                    "a single global algorithm fails for collectives it cannot run (e.g. NVLS has no "
                    "int8 broadcast: 'no algorithm/protocol available', NCCL issue 653, PyTorch PR "
                    "163063), and lagom keeps Ring available everywhere",
                    f"restrict per function instead, e.g. {var}='allreduce:nvls,ring', or unset it",
                )
            )
    else:
        forced = sorted(f for f in FUNCTIONS if "LL128" in enabled[f] and _positively_names(value, f, "ll128"))
        if forced:
            issues.append(
                EnvIssue(
                    "error",
                    var,
                    value,
                    f"{var}={value!r} force-enables LL128 for {', '.join(forced)}",
                    "forcing LL128 where NCCL would not pick it gives silent data corruption on "
                    "unsupported paths (NCCL issues 786, 1261); NCCL's maintainers advise against "
                    "setting NCCL_PROTO except as a workaround",
                    f"only exclude protocols (e.g. {var}='^LL128') or unset {var}",
                )
            )


def _positively_names(value: str, function: str, token: str) -> bool:
    """True when the entry that decides ``function`` lists ``token`` without ``^``."""
    decisive = None
    for i, entry in enumerate(e for e in value.split(";") if e):
        parts = [p for p in entry.split(":") if p]
        if len(parts) >= 2:
            if parts[0].lower() == function.lower():
                decisive = parts[1]
        elif i == 0 and parts:
            decisive = parts[0]
    if decisive is None or decisive.startswith("^"):
        return False
    return token in [t.lower() for t in decisive.split(",") if t]


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_nccl_env(environ: Mapping[str, str], *, nccl_version: str | None = None) -> list[EnvIssue]:
    """Every known NCCL variable of ``environ`` against its domain; ``nccl_version`` None skips the version rules."""
    try:
        version = parse_version(nccl_version) if nccl_version else None
    except ValueError:
        version = None
    issues: list[EnvIssue] = []
    get = environ.get
    for var, kind in (("NCCL_ALGO", "algorithm"), ("NCCL_PROTO", "protocol")):
        if get(var) is not None:
            _check_selection(var, get(var), kind, version, issues)  # type: ignore[arg-type]

    for var in ("NCCL_NTHREADS",):
        if get(var) is not None and (n := _int_value(var, get(var), issues)) is not None:
            if n not in NTHREADS_ALLOWED:
                issues.append(
                    EnvIssue(
                        "error",
                        var,
                        get(var),
                        f"{var}={n} is not one of {', '.join(map(str, NTHREADS_ALLOWED))}",
                        "NCCL clamps other values with an INFO log only (not a multiple of 32 -> 512, "
                        "above 512 -> 512, below 64 -> 64; src/graph/tuning.cc); NCCL issue 698 shows "
                        "wrong all-reduce results with 480",
                        f"set {var} to 64, 128, 256 or 512, or unset it",
                    )
                )
    if get("NCCL_LL128_NTHREADS") is not None:
        var = "NCCL_LL128_NTHREADS"
        if (n := _int_value(var, get(var), issues)) is not None and (n % 32 or not 64 <= n <= 640):
            issues.append(
                EnvIssue(
                    "error",
                    var,
                    get(var),
                    f"{var}={n} is outside 64..640 or not a multiple of 32",
                    "NCCL clamps it with an INFO log only (src/graph/tuning.cc, getNthreads)",
                    f"set {var} to a multiple of 32 between 64 and 640, or unset it",
                )
            )

    limit = max_ctas(nccl_version)
    for low_var, high_var in (("NCCL_MIN_CTAS", "NCCL_MAX_CTAS"), ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")):
        values = {}
        for var in (low_var, high_var):
            if get(var) is None:
                continue
            n = _int_value(var, get(var), issues)
            if n is None:
                continue
            if not 1 <= n <= limit:
                issues.append(
                    EnvIssue(
                        "error",
                        var,
                        get(var),
                        f"{var}={n} is outside 1..{limit}",
                        f"NCCL ignores values <= 0 and caps CTAs at {limit} "
                        f"({'64 from NCCL 2.25' if limit == 64 else '32 before NCCL 2.25'}; src/init.cc)",
                        f"set {var} between 1 and {limit}",
                    )
                )
                continue
            values[var] = n
        if len(values) == 2 and values[low_var] > values[high_var]:
            issues.append(
                EnvIssue(
                    "error",
                    low_var,
                    get(low_var),
                    f"{low_var} ({values[low_var]}) must be <= {high_var} ({values[high_var]})",
                    "NCCL rejects a communicator whose minimum CTA count exceeds its maximum "
                    "(ncclInvalidArgument, src/init.cc)",
                    f"lower {low_var} or raise {high_var}",
                )
            )
        elif len(values) == 1 and (get(low_var) is None or get(high_var) is None):
            (only,) = values
            other = high_var if only == low_var else low_var
            issues.append(
                EnvIssue(
                    "warning",
                    only,
                    get(only),
                    f"{only} is set without {other}: a one-ended CTA range",
                    "the other end stays at NCCL's default, which may not bracket it (a minimum above the "
                    "default maximum is an invalid range; NCCL PR 2256)",
                    f"set both {low_var} and {high_var}",
                )
            )

    if get("NCCL_BUFFSIZE") is not None:
        var = "NCCL_BUFFSIZE"
        if (n := _int_value(var, get(var), issues)) is not None and not _is_power_of_two(n):
            issues.append(
                EnvIssue(
                    "error",
                    var,
                    get(var),
                    f"{var}={n} is not a positive power of two",
                    "NCCL documents powers of two (default 4 MiB); odd sizes gave wrong results and "
                    "hangs (NCCL issues 698, 1739)",
                    f"set {var} to a power of two (e.g. 4194304) or unset it",
                )
            )
    for var in ("NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE"):
        if get(var) is not None:
            issues.append(
                EnvIssue(
                    "warning",
                    var,
                    get(var),
                    f"{var} is set",
                    "NCCL's maintainers recommend not changing it: LL128 buffers must be a multiple of "
                    "120 bytes and odd sizes hang (NCCL issue 1739)",
                    f"unset {var}",
                )
            )
    for var in ("NCCL_P2P_NET_CHUNKSIZE", "NCCL_P2P_NVL_CHUNKSIZE", "NCCL_P2P_PCI_CHUNKSIZE", "NCCL_NVLS_CHUNKSIZE"):
        if get(var) is not None and (n := _int_value(var, get(var), issues)) is not None:
            if not _is_power_of_two(n):
                issues.append(
                    EnvIssue(
                        "error",
                        var,
                        get(var),
                        f"{var}={n} is not a positive power of two",
                        "NCCL documents power-of-two chunk sizes (env.rst)",
                        f"set {var} to a power of two (e.g. 2097152) or unset it",
                    )
                )
    if get("NCCL_CHUNK_SIZE") is not None:
        issues.append(
            EnvIssue(
                "warning",
                "NCCL_CHUNK_SIZE",
                get("NCCL_CHUNK_SIZE"),
                "NCCL_CHUNK_SIZE is set",
                "it is undocumented (src/enqueue.cc, 0 = automatic) and applies to every collective",
                "unset it; lagom sets chunk sizes per collective through its tuner plugin",
            )
        )

    if get("NCCL_CGA_CLUSTER_SIZE") is not None:
        var = "NCCL_CGA_CLUSTER_SIZE"
        if (n := _int_value(var, get(var), issues)) is not None and not 0 <= n <= MAX_CGA_CLUSTER_SIZE:
            issues.append(
                EnvIssue(
                    "error",
                    var,
                    get(var),
                    f"{var}={n} is outside 0..{MAX_CGA_CLUSTER_SIZE}",
                    "NCCL clamps values above 8 to 8 and ignores negative ones, with an INFO log only "
                    "(src/init.cc, envConfigOverride)",
                    f"set {var} between 0 and {MAX_CGA_CLUSTER_SIZE}",
                )
            )

    if get("NCCL_CTA_POLICY") is not None:
        _check_cta_policy(get("NCCL_CTA_POLICY"), version, issues)  # type: ignore[arg-type]

    if get("NCCL_NVLS_ENABLE") is not None and get("NCCL_NVLS_ENABLE").strip() not in ("0", "1", "2"):
        issues.append(
            EnvIssue(
                "error",
                "NCCL_NVLS_ENABLE",
                get("NCCL_NVLS_ENABLE"),
                f"NCCL_NVLS_ENABLE={get('NCCL_NVLS_ENABLE')!r} is not 0, 1 or 2",
                "env.rst documents 0 (off), 1 (on) and 2 (auto, the default)",
                "set NCCL_NVLS_ENABLE to 0, 1 or 2, or unset it",
            )
        )
    plugin = get("NCCL_TUNER_PLUGIN")
    if plugin_path_missing(plugin):
        issues.append(
            EnvIssue(
                "error",
                "NCCL_TUNER_PLUGIN",
                plugin,
                f"NCCL_TUNER_PLUGIN={plugin!r}: the file does not exist",
                "NCCL dlopens the tuner plugin when a communicator is created; when that fails it logs "
                "at INFO level only and silently uses its internal tuner instead",
                "point NCCL_TUNER_PLUGIN at an existing file (lagom's: `lagom build-tuner -o build` -> "
                "build/libnccl-tuner-lagom.so), or unset it",
            )
        )
    return issues


def plugin_path_missing(value: str | None) -> bool:
    """True when ``value`` is a path (contains ``/``) to a missing file; bare names are left to the dynamic loader."""
    return bool(value) and "/" in value and not os.path.exists(value)


def _check_cta_policy(value: str, version, issues: list[EnvIssue]) -> None:
    var = "NCCL_CTA_POLICY"
    if version is not None and version[:2] < (2, 27):
        issues.append(
            EnvIssue(
                "error",
                var,
                value,
                f"{var} needs NCCL 2.27+",
                f"the cluster's NCCL is {'.'.join(map(str, version))}, which does not read it",
                f"unset {var} or upgrade NCCL",
            )
        )
        return
    if value[:1].isdigit():
        if value.strip() not in ("0", "1", "2"):
            issues.append(
                EnvIssue(
                    "error",
                    var,
                    value,
                    f"{var}={value!r} is not a legacy policy number (0, 1 or 2)",
                    "NCCL reads only the first digit and falls back to DEFAULT on anything else, with "
                    "an INFO log (src/init.cc)",
                    f"set {var} to 0 (DEFAULT), 1 (EFFICIENCY) or 2 (ZERO), or names joined by '|'",
                )
            )
        return
    names = [t for t in value.split("|") if t]
    bad = [t for t in names if t.upper() not in CTA_POLICIES]
    if bad or not names:
        issues.append(
            EnvIssue(
                "error",
                var,
                value,
                f"{var}={value!r}: unknown policy {', '.join(map(repr, bad)) or 'name'}",
                "NCCL ignores unknown names with an INFO log only (src/init.cc)",
                f"use {' | '.join(CTA_POLICIES)} joined by '|' (NCCL 2.29+) or 0/1/2",
            )
        )
    elif version is not None and version[:2] < (2, 29):
        issues.append(
            EnvIssue(
                "error",
                var,
                value,
                f"{var}={value!r} uses policy names, which need NCCL 2.29+",
                f"the cluster's NCCL is {'.'.join(map(str, version))}, which reads only 0, 1 or 2",
                "use the number: DEFAULT=0, EFFICIENCY=1, ZERO=2",
            )
        )


def override_issues(environ: Mapping[str, str]) -> list[EnvIssue]:
    """A warning per set ``LAGOM_VARIABLES`` variable that silently replaces lagom's choices (NCCL issue 1661), removes
    a knob from its search, hides what NCCL ran from it, or sends NCCL's lines where no rank can read them apart."""
    issues = []
    for var, (effect, what) in LAGOM_VARIABLES.items():
        value = environ.get(var)
        issue = None if value is None else _OVERRIDES[effect](var, value, what, environ)
        if issue is not None:
            issues.append(issue)
    return issues


def _per_communicator(var: str, value: str, field: str, environ: Mapping[str, str]) -> EnvIssue:
    return EnvIssue(
        "warning",
        var,
        value,
        f"{var} is set and overrides lagom's per-communicator choice",
        f"NCCL copies it into {field} of every communicator (src/init.cc, envConfigOverride), "
        "so the plan's per-collective settings for this knob are silently ignored",
        f"unset {var} and let lagom set it per communicator",
    )


def _tuner(var: str, value: str, what: str, environ: Mapping[str, str]) -> EnvIssue:
    return EnvIssue(
        "warning",
        var,
        value,
        f"{var} is set and limits lagom's tuner plugin",
        f"it {what}; the plan's choices outside it are silently dropped",
        f"unset {var}; lagom chooses per collective",
    )


def _tuner_plugin(var: str, value: str, what: str, environ: Mapping[str, str]) -> EnvIssue | None:
    if "lagom" in value.lower() or plugin_path_missing(value):  # a missing file is check_nccl_env's error
        return None
    return EnvIssue(
        "warning",
        var,
        value,
        f"{var}={value!r} is not lagom's plugin",
        f"NCCL loads {what}; another plugin replaces lagom's per-collective algorithm, protocol and channel choices",
        f"unset {var} (lagom sets it when a plan needs its plugin)",
    )


def _p2p_channels(var: str, value: str, what: str, environ: Mapping[str, str]) -> EnvIssue:
    return EnvIssue(
        "warning",
        var,
        value,
        f"{var}={value!r} bounds the channels of every send/recv: lagom's n_channels knob for the send/recv sites "
        "keeps only the values NCCL can still run, and leaves the search when one is left",
        f"NCCL sets it as {what} for the whole process, over any per-collective choice "
        "(nccl.capabilities._p2p_bounds keeps the n_channels values that still differ)",
        f"unset {var} to let lagom search the send/recv channels",
    )


def _observed(var: str, value: str, what: str, environ: Mapping[str, str]) -> EnvIssue | None:
    tuner = environ.get("NCCL_TUNER_PLUGIN", "")
    ours = "lagom" in os.path.basename(value).lower() or (
        os.path.isabs(value) and os.path.isabs(tuner) and os.path.realpath(value) == os.path.realpath(tuner)
    )
    if ours:
        return None
    said = (
        f"{var}='none' disables profiler plugins"
        if value.strip().lower() == "none"
        else f"{var}={value!r} names another profiler plugin, which lagom never replaces"
    )
    return EnvIssue(
        "warning",
        var,
        value,
        f"{said}: lagom checks only the tuner's row hits, not what NCCL ran",
        f"NCCL loads {what}; the observed check reads lagom's own profiler records (docs/nccl.md, 'Applied = observed')",
        f"keep it, or unset {var} (lagom's launch then names its own library) to check what NCCL ran",
    )


def _log_file(var: str, value: str, what: str, environ: Mapping[str, str]) -> EnvIssue | None:
    level = environ.get("NCCL_DEBUG", "").strip().upper()
    if level not in ("WARN", "INFO", "ABORT", "TRACE"):
        return EnvIssue(
            "warning",
            var,
            value,
            f"{var}={value!r} has no effect: NCCL_DEBUG is {repr(environ['NCCL_DEBUG']) if 'NCCL_DEBUG' in environ else 'unset'}, "
            "and NCCL opens the file only at NCCL_DEBUG=WARN, INFO, ABORT or TRACE",
            f"the file is {what}",
            f"set NCCL_DEBUG=INFO (or WARN) with it, or unset {var}",
        )
    missing = [part for part in ("%h", "%p") if part not in value.replace("%%", "")]
    if not missing:
        return None
    return EnvIssue(
        "warning",
        var,
        value,
        f"{var}={value!r} has no {' or '.join(missing)}: the ranks write NCCL's lines to one file, each truncating "
        "it when it starts, so the channels and algorithms NCCL ran are lost for all but the last",
        f"the file is {what}; %h is the host name, %p the process id",
        f"name one file per process, e.g. {var}={_per_process(value)}",
    )


def _per_process(value: str) -> str:
    stem, dot, suffix = value.rpartition(".")
    return f"{stem}.%h.%p.{suffix}" if dot and "/" not in suffix else f"{value}.%h.%p"


_OVERRIDES = {
    "per-communicator": _per_communicator,
    "tuner": _tuner,
    "tuner-plugin": _tuner_plugin,
    "p2p-channels": _p2p_channels,
    "observed": _observed,
    "log-file": _log_file,
}
