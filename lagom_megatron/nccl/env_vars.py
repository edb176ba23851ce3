"""NCCL variables that matter to lagom (``LAGOM_VARIABLES``, the one table of them); ``validate_env`` checks those lagom
writes (``env_check``: the user's)."""

from __future__ import annotations

from typing import Literal

from lagom_megatron.engine.cluster import parse_version
from lagom_megatron.engine.knobs import ALGORITHMS, N_THREADS, PROTOCOLS, invalid_value

LagomEffect = Literal["per-communicator", "tuner", "tuner-plugin", "p2p-channels", "observed", "log-file"]

LAGOM_VARIABLES: dict[str, tuple[LagomEffect, str]] = {
    "NCCL_MIN_CTAS": ("per-communicator", "ncclConfig_t.minCTAs"),
    "NCCL_MAX_CTAS": ("per-communicator", "ncclConfig_t.maxCTAs"),
    "NCCL_CGA_CLUSTER_SIZE": ("per-communicator", "ncclConfig_t.cgaClusterSize"),
    "NCCL_CTA_POLICY": ("per-communicator", "ncclConfig_t.CTAPolicy"),
    "NCCL_NVLS_NCHANNELS": ("per-communicator", "ncclConfig_t.nvlsCTAs"),
    "NCCL_MIN_NCHANNELS": ("per-communicator", "ncclConfig_t.minCTAs (deprecated name)"),
    "NCCL_MAX_NCHANNELS": ("per-communicator", "ncclConfig_t.maxCTAs (deprecated name)"),
    "NCCL_NCHANNELS_PER_NET_PEER": ("per-communicator", "ncclConfig_t.nChannelsPerNetPeer (src/init.cc:2038-2047)"),
    "NCCL_ALGO": ("tuner", "restricts the algorithms before the tuner plugin sees the cost table"),
    "NCCL_PROTO": ("tuner", "restricts the protocols before the tuner plugin sees the cost table"),
    "NCCL_TUNER_PLUGIN": ("tuner-plugin", "one tuner plugin per process"),
    "NCCL_MIN_P2P_NCHANNELS": (
        "p2p-channels",
        "the lower bound of p2pnChannels (src/graph/paths.cc:957, :980-985 @v2.30.7-1)",
    ),
    "NCCL_MAX_P2P_NCHANNELS": (
        "p2p-channels",
        "the upper bound of p2pnChannels (src/graph/paths.cc:958, :980-985 @v2.30.7-1)",
    ),
    "NCCL_PROFILER_PLUGIN": (
        "observed",
        "one profiler plugin per process, none for 'none' (src/plugin/profiler.cc:58-60)",
    ),
    "NCCL_DEBUG_FILE": (
        "log-file",
        'opened with fopen(path, "w") by every process, %h and %p expanded, only when NCCL_DEBUG is above VERSION '
        "(src/debug.cc:201-237 @v2.30.7-1)",
    ),
}
"""Every NCCL variable that changes what lagom tunes (per-communicator fields, the tuner's table, the send/recv channel
knob), what it can see (the observed check) or where NCCL writes: ``env_check.override_issues`` names each one set."""

PER_COMMUNICATOR_OVERRIDES: dict[str, str] = {
    var: what for var, (effect, what) in LAGOM_VARIABLES.items() if effect == "per-communicator"
}
"""A set override replaces its ``ncclConfig_t`` field in every communicator (``src/init.cc`` ``envConfigOverride``)."""
TUNER_OVERRIDES: dict[str, str] = {var: what for var, (effect, what) in LAGOM_VARIABLES.items() if effect == "tuner"}


def launch_nthreads(env: dict[str, str]) -> int | None:
    """``NCCL_NTHREADS`` of a launch environment; None when unset or empty (NCCL reads it once per process)."""
    value = env.get("NCCL_NTHREADS")
    return int(value) if value else None


def _split_list(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


def validate_env(env: dict[str, str]) -> None:
    """Checks lagom's variables: no forced LL128 (nccl#786), Ring in a global NCCL_ALGO (pytorch#163063); ValueError."""
    for key, value in env.items():
        value = str(value)
        if key == "NCCL_PROTO":
            for entry in value.split(";"):
                body = entry.split(":", 1)[-1]
                if body.startswith("^"):
                    continue
                tokens = _split_list(body)
                bad = [t for t in tokens if t.lower() not in {p.lower() for p in PROTOCOLS}]
                if bad:
                    raise invalid_value("NCCL_PROTO", value, list(PROTOCOLS), f"unknown token {bad[0]!r}")
                if any(t.lower() == "ll128" for t in tokens):
                    raise invalid_value(
                        "NCCL_PROTO",
                        value,
                        "exclusions such as '^LL128' or lists without LL128",
                        "forcing LL128 can corrupt data silently (nccl#786)",
                    )
        elif key == "NCCL_ALGO":
            for entry in value.split(";"):
                prefixed = ":" in entry
                body = entry.split(":", 1)[-1]
                if body.startswith("^"):
                    continue
                tokens = _split_list(body)
                bad = [t for t in tokens if t.lower() not in {a.lower() for a in ALGORITHMS}]
                if bad:
                    raise invalid_value("NCCL_ALGO", value, list(ALGORITHMS), f"unknown token {bad[0]!r}")
                if not prefixed and "ring" not in {t.lower() for t in tokens}:
                    raise invalid_value(
                        "NCCL_ALGO",
                        value,
                        "a global list that includes Ring, or per-function entries ('allreduce:nvls,ring')",
                        "collectives with no allowed algorithm fail (pytorch#163063)",
                    )
        elif key == "NCCL_NTHREADS":
            if not value.isdigit() or int(value) not in N_THREADS:
                raise invalid_value("NCCL_NTHREADS", value, list(N_THREADS))
        elif key == "NCCL_NCHANNELS_PER_NET_PEER":
            if not value.isdigit() or not 1 <= int(value) <= 64 or int(value) & (int(value) - 1):
                raise invalid_value("NCCL_NCHANNELS_PER_NET_PEER", value, "powers of two 1..64 (NCCL rounds up to one)")
        elif key == "NCCL_BUFFSIZE":
            if not value.isdigit() or int(value) <= 0 or int(value) & (int(value) - 1):
                raise invalid_value("NCCL_BUFFSIZE", value, "powers of two (bytes)")


FUNCTIONS: tuple[str, ...] = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
"""Function prefixes of the per-function form (NCCL 2.24+). There is no AllToAll or SendRecv."""

ALGORITHM_SINCE: dict[str, tuple[int, int]] = {
    "Tree": (2, 4),
    "Ring": (2, 4),
    "CollNetDirect": (2, 14),
    "CollNetChain": (2, 14),
    "NVLS": (2, 17),
    "NVLSTree": (2, 18),
    "PAT": (2, 23),
}
"""Algorithm token, in NCCL's enum order -> first NCCL (major, minor) that accepts it (case-insensitive)."""

NTHREADS_ALLOWED: tuple[int, ...] = (64, 128, 256, 512)
"""NCCL_NTHREADS values listed by env.rst; NCCL clamps anything else with an INFO log only."""

CTA_POLICIES: tuple[str, ...] = ("DEFAULT", "EFFICIENCY", "ZERO")
"""NCCL_CTA_POLICY names (2.29+), combinable with ``|``; legacy digits 0, 1, 2 (2.27+)."""

MAX_CGA_CLUSTER_SIZE = 8
"""NCCL_MAX_CGA_CLUSTER_SIZE in ``src/init.cc``: larger values are clamped to 8."""

PER_FUNCTION_SYNTAX_VERSION = (2, 24)


def max_ctas(nccl_version: str | None) -> int:
    """Largest CTA count NCCL accepts: 64 from NCCL 2.25 (MAXCHANNELS), 32 before; 64 if unknown or unparsable."""
    try:
        return 32 if nccl_version and parse_version(nccl_version)[:2] < (2, 25) else 64
    except ValueError:
        return 64


def parse_selection(value: str, kind: Literal["algorithm", "protocol"]) -> dict[str, frozenset[str]]:
    """``NCCL_ALGO``/``NCCL_PROTO`` as ``parseList`` reads it: function -> enabled tokens; ValueError, NCCL's words."""
    tokens = tuple(ALGORITHM_SINCE) if kind == "algorithm" else PROTOCOLS
    canon = {t.lower(): t for t in tokens}
    funcs = {f.lower(): f for f in FUNCTIONS}
    enabled: dict[str, frozenset[str]] = {f: frozenset(tokens) for f in FUNCTIONS}
    entries = [e for e in value.split(";") if e]
    if not entries:
        raise ValueError(f"empty value {value!r}; expected a comma-separated list of {', '.join(tokens)}")
    for i, entry in enumerate(entries):
        parts = [p for p in entry.split(":") if p]
        if len(parts) >= 2:
            prefix, elems = parts[0], parts[1]
            if prefix.lower() not in funcs:
                raise ValueError(
                    f'Unrecognized prefix token "{prefix}" when parsing "{value}"; '
                    f"allowed prefixes: {', '.join(FUNCTIONS)} (no alltoall or sendrecv)"
                )
            targets = [funcs[prefix.lower()]]
        else:
            if i > 0 or value.startswith(";"):
                raise ValueError(f'All entries except the first must have a prefix: "{value}"')
            elems = parts[0] if parts else ""
            targets = list(FUNCTIONS)
        negate = elems.startswith("^")
        names = [t for t in elems.lstrip("^").split(",") if t]
        chosen = set()
        for name in names:
            if name.lower() not in canon:
                raise ValueError(
                    f'Unrecognized element token "{name}" when parsing "{value}"; allowed {kind}s: {", ".join(tokens)}'
                )
            chosen.add(canon[name.lower()])
        result = frozenset(tokens) - chosen if negate else frozenset(chosen)
        for f in targets:
            enabled[f] = result
    return enabled
