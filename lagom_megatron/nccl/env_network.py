"""Checks of the NCCL and ``TORCH_NCCL_*`` variables that are not lagom's knobs (debug, socket and network
interfaces, torch's own), in NCCL's and torch's grammar, so a typo stops before any rank starts."""

from __future__ import annotations

import re
from collections.abc import Mapping

from lagom_megatron.nccl.env_check import EnvIssue, plugin_path_missing

DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "ABORT", "TRACE")
DEBUG_SUBSYSTEMS = (
    "INIT",
    "COLL",
    "P2P",
    "SHM",
    "NET",
    "GRAPH",
    "TUNING",
    "ENV",
    "ALLOC",
    "ALLOC_HOST",
    "CALL",
    "PROXY",
    "NVLS",
    "BOOTSTRAP",
    "REG",
    "PROFILE",
    "RAS",
    "DESTROY",
    "ALL",
)
P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
SOCKET_FAMILIES = ("AF_INET", "AF_INET6")
INTEGER_VARIABLES = (
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE",
    "NCCL_IB_GID_INDEX",
    "NCCL_IB_RETRY_CNT",
    "NCCL_IB_TIMEOUT",
    "NCCL_SOCKET_NTHREADS",
    "NCCL_NSOCKS_PERTHREAD",
    "NCCL_CUMEM_ENABLE",
    "NCCL_COLLNET_ENABLE",
    "NCCL_IGNORE_CPU_AFFINITY",
    "NCCL_NET_GDR_READ",
)
TORCH_BOOLS = (
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_USE_COMM_NONBLOCKING",
    "TORCH_NCCL_AVOID_RECORD_STREAMS",
    "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_DESYNC_DEBUG",
    "TORCH_NCCL_ENABLE_TIMING",
    "TORCH_NCCL_NAN_CHECK",
)
TORCH_INTS = ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_BOOL_WORDS = ("y", "yes", "1", "t", "true", "n", "no", "0", "f", "false")
_STOI = re.compile(r"^\s*[+-]?\d+")


def _issue(var: str, value: str, what: str, why: str, fix: str) -> EnvIssue:
    return EnvIssue("error", var, value, what, why, fix)


def check_interface_list(var: str, value: str) -> list[EnvIssue]:
    """``NCCL_SOCKET_IFNAME`` / ``NCCL_IB_HCA`` against ``parseStringList``'s ``[^][=]name[:port],...`` grammar."""
    why = f"NCCL parses {var} as [^][=]name[:port],... (src/misc/utils.cc parseStringList)"
    body = value
    if body.startswith("="):
        if body[1:].startswith("^"):
            return [
                _issue(
                    var,
                    value,
                    f"{var}={value!r} puts '=' before '^'; allowed order: ^ then =",
                    why,
                    f"write {var}=^={body[2:]}",
                )
            ]
    body = body.removeprefix("^").removeprefix("=")
    entries = [e for e in body.split(",") if e]
    if not entries:
        return [
            _issue(
                var,
                value,
                f"{var}={value!r} names no interface",
                why + "; nothing would be selected",
                f"give interface names, e.g. {var}={'eth0' if 'SOCKET' in var else 'mlx5_0:1'}",
            )
        ]
    out = []
    for entry in entries:
        name, sep, port = entry.partition(":")
        if not name or any(c.isspace() for c in entry) or len(name) > 63:
            out.append(
                _issue(
                    var,
                    value,
                    f"{var}={value!r}: entry {entry!r} is not an interface name "
                    "(empty, with spaces, or over 63 characters)",
                    why,
                    "fix the entry",
                )
            )
        elif sep and (not port.isdigit() or int(port) < 1):
            out.append(
                _issue(
                    var,
                    value,
                    f"{var}={value!r}: port {port!r} of {name!r} is not a number >= 1",
                    why + "; atoi makes it 0, which matches no port",
                    f"write {name}:1 or just {name}",
                )
            )
    return out


def check_network_env(environ: Mapping[str, str]) -> list[EnvIssue]:
    """One error ``EnvIssue`` per set variable of this module (or list entry) its grammar rejects."""
    out: list[EnvIssue] = []
    for var in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"):
        if var in environ:
            out += check_interface_list(var, environ[var])
    choices = (
        ("NCCL_DEBUG", DEBUG_LEVELS, "src/debug.cc"),
        ("NCCL_P2P_LEVEL", P2P_LEVELS, "env.rst"),
        ("NCCL_SOCKET_FAMILY", SOCKET_FAMILIES, "env.rst"),
    )
    for var, allowed, source in choices:
        value = environ.get(var)
        if value is not None and value.strip().upper() not in allowed:
            out.append(
                _issue(
                    var,
                    value,
                    f"{var}={value!r} is not one of {', '.join(allowed)}",
                    f"NCCL ignores other values without a word ({source})",
                    f"set {var} to one of them",
                )
            )
    subsys = environ.get("NCCL_DEBUG_SUBSYS")
    if subsys is not None:
        unknown = [t for t in subsys.removeprefix("^").split(",") if t.strip().upper() not in DEBUG_SUBSYSTEMS]
        if unknown:
            out.append(
                _issue(
                    "NCCL_DEBUG_SUBSYS",
                    subsys,
                    f"NCCL_DEBUG_SUBSYS={subsys!r}: unknown subsystem(s) "
                    f"{', '.join(map(repr, unknown))}; allowed: {', '.join(DEBUG_SUBSYSTEMS)}",
                    "NCCL skips unknown names (src/debug.cc)",
                    "fix the names; '^' first inverts the list",
                )
            )
    plugin = environ.get("NCCL_NET_PLUGIN")
    if plugin is not None and plugin.lower() != "none" and plugin_path_missing(plugin):
        out.append(
            _issue(
                "NCCL_NET_PLUGIN",
                plugin,
                f"NCCL_NET_PLUGIN={plugin!r}: the file does not exist",
                "NCCL falls back to its internal network transports",
                "fix the path or unset it",
            )
        )
    for var in INTEGER_VARIABLES:
        value = environ.get(var)
        if value is not None and not re.fullmatch(r"\s*[+-]?(0[xX][0-9a-fA-F]+|\d+)\s*", value):
            out.append(
                _issue(
                    var,
                    value,
                    f"{var}={value!r} is not an integer",
                    "NCCL reads it with strtoll and silently keeps its default (src/misc/param.cc)",
                    f"set {var} to an integer or unset it",
                )
            )
    for var in TORCH_BOOLS:
        value = environ.get(var)
        if value is not None and value.lower() not in _BOOL_WORDS:
            out.append(
                _issue(
                    var,
                    value,
                    f"{var}={value!r} is not a boolean; allowed: {', '.join(_BOOL_WORDS)}",
                    "torch's getCvarBool stops every rank on it when the NCCL process group is created "
                    "(c10d/Utils.hpp)",
                    f"set {var}=1 or {var}=0",
                )
            )
    for var in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", *TORCH_INTS):
        value = environ.get(var)
        if value is None:
            continue
        m = _STOI.match(value)
        if not m:
            out.append(
                _issue(
                    var,
                    value,
                    f"{var}={value!r} is not an integer",
                    "torch's getCvarInt (std::stoi) stops every rank on it (c10d/Utils.hpp)",
                    f"set {var} to an integer",
                )
            )
        elif var == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and not 0 <= int(m.group()) <= 3:
            out.append(
                _issue(
                    var,
                    value,
                    f"{var}={value!r} is not an ErrorHandlingMode; allowed: 0, 1, 2, 3",
                    "0 no handling, 1 tear down, 2 clean up only, 3 skip clean-up (ProcessGroupNCCL.hpp)",
                    f"set {var}=1 (torch's default) or 3",
                )
            )
    return out
