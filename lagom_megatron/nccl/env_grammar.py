"""What NCCL accepts in ``NCCL_ALGO`` / ``NCCL_PROTO`` (grammar, tokens) and the thread, CTA, CGA and CTA-policy
variables. Sources: NCCL ``docs/userguide/source/env.rst``, ``src/graph/tuning.cc`` (``parseList``, ``getNthreads``),
``src/init.cc`` (``envConfigOverride``, ``getEnvCtaPolicyOnce``)."""

from __future__ import annotations

from typing import Literal

FUNCTIONS: tuple[str, ...] = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
"""Function prefixes of the per-function form (NCCL 2.24+). There is no AllToAll or SendRecv."""

ALGORITHMS: dict[str, tuple[int, int]] = {
    "Tree": (2, 4),
    "Ring": (2, 4),
    "CollNetDirect": (2, 14),
    "CollNetChain": (2, 14),
    "NVLS": (2, 17),
    "NVLSTree": (2, 18),
    "PAT": (2, 23),
}
"""Algorithm token -> first NCCL (major, minor) that accepts it (tokens are case-insensitive)."""

PROTOCOLS: tuple[str, ...] = ("LL", "LL128", "Simple")

NTHREADS_ALLOWED: tuple[int, ...] = (64, 128, 256, 512)
"""NCCL_NTHREADS values listed by env.rst; NCCL clamps anything else with an INFO log only."""

CTA_POLICIES: tuple[str, ...] = ("DEFAULT", "EFFICIENCY", "ZERO")
"""NCCL_CTA_POLICY names (2.29+), combinable with ``|``; legacy digits 0, 1, 2 (2.27+)."""

MAX_CGA_CLUSTER_SIZE = 8
"""NCCL_MAX_CGA_CLUSTER_SIZE in ``src/init.cc``: larger values are clamped to 8."""

PER_FUNCTION_SYNTAX_VERSION = (2, 24)
"""First NCCL release with the ``function:list;...`` form of NCCL_ALGO / NCCL_PROTO."""


def parse_version(text: str | None) -> tuple[int, int, int] | None:
    """``"2.27.3"`` -> ``(2, 27, 3)``; None or an unparsable string -> None."""
    if not text:
        return None
    parts = str(text).split(".")
    try:
        nums = [int(p) for p in parts[:3]]
    except ValueError:
        return None
    while len(nums) < 3:
        nums.append(0)
    return (nums[0], nums[1], nums[2])


def max_ctas(nccl_version: str | None) -> int:
    """Largest CTA count NCCL accepts: 64 from NCCL 2.25 (MAXCHANNELS), 32 before; 64 if unknown."""
    v = parse_version(nccl_version)
    return 32 if v is not None and v[:2] < (2, 25) else 64


def parse_selection(value: str, kind: Literal["algorithm", "protocol"]) -> dict[str, frozenset[str]]:
    """Parses an ``NCCL_ALGO`` / ``NCCL_PROTO`` value as NCCL's ``parseList`` does: function name -> enabled tokens.

    ``;``-separated ``[function:]list`` entries (only the first without prefix), ``^`` negates, case-insensitive.
    Raises ValueError in NCCL's wording (a later entry without prefix, unknown token or prefix, empty value)."""
    tokens = tuple(ALGORITHMS) if kind == "algorithm" else PROTOCOLS
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
                    f'Unrecognized element token "{name}" when parsing "{value}"; '
                    f"allowed {kind}s: {', '.join(tokens)}"
                )
            chosen.add(canon[name.lower()])
        result = frozenset(tokens) - chosen if negate else frozenset(chosen)
        for f in targets:
            enabled[f] = result
    return enabled
