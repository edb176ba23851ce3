"""Communication configurations (NCCL knobs) and their domains.

A ``CommConfig`` is one point of the knob space of one collective: algorithm, protocol,
n_channels (CTAs), n_threads, chunk_size (bytes), and per-communicator extras (CTA policy, CGA
cluster size). ``None`` in a field means "NCCL's own choice" (stock behaviour).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class CommConfig:
    """One communication configuration. Every field ``None`` = NCCL defaults.

    On the gloo backend (CPU), ``n_channels`` is the number of gloo worker threads of the
    communicator and ``chunk_size`` the size in bytes of the pieces a tensor is split into;
    algorithm, protocol and n_threads do not apply there.
    """

    algorithm: str | None = None
    """NCCL algorithm: Ring, Tree, NVLS, NVLSTree, CollNetDirect, CollNetChain, PAT."""
    protocol: str | None = None
    """NCCL protocol: LL, LL128, Simple."""
    n_channels: int | None = None
    """Channels, one CTA each (1..64 from NCCL 2.25, 1..32 before)."""
    n_threads: int | None = None
    """Threads per CTA: 64, 128, 256 or 512 (NCCL_NTHREADS; process scope)."""
    chunk_size: int | None = None
    """Bytes moved per step of a channel (tuner plugin v6 / NCCL 2.30+)."""
    cta_policy: str | None = None
    """ncclConfig_t.CTAPolicy: DEFAULT, EFFICIENCY, ZERO (communicator scope)."""
    cga_cluster_size: int | None = None
    """ncclConfig_t.cgaClusterSize, 0..8 (communicator scope, sm90+)."""

    def to_dict(self) -> dict[str, Any]:
        """Returns the fields that are set (not ``None``), JSON-ready."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CommConfig":
        """Builds a config from ``to_dict`` output.

        Raises:
            ValueError: on a key that is not a CommConfig field (names the key and the allowed set).
        """
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown CommConfig field(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**data)

    def is_default(self) -> bool:
        """True when every knob is left to NCCL (a field comparison: called per site per iteration)."""
        return self == DEFAULT


DEFAULT = CommConfig()
"""NCCL's own choice for every knob."""


# --------------------------------------------------------------------------------------------
# Knob domains, scopes and validation.
#
# Sources: NCCL's user guide (env.rst, api/types.rst), src/graph/tuning.cc and src/init.cc as
# summarised in the project's research notes (NCCL mechanisms; ecosystem section 5). Where NCCL
# itself clamps silently (NCCL_NTHREADS=480 -> 512), lagom refuses instead: a value that NCCL
# would change behind our back makes the cost model's prediction wrong.
# --------------------------------------------------------------------------------------------

KNOB_ORDER: tuple[str, ...] = (
    "n_channels", "chunk_size", "n_threads", "protocol", "algorithm", "cta_policy", "cga_cluster_size",
)
"""Knob-priority order of the search (DESIGN.md section 4): channels and chunk size first, because
they move compute slowdown the most (Lagom's introduction); algorithm last."""

ALGORITHMS: tuple[str, ...] = ("Ring", "Tree", "NVLS", "NVLSTree", "CollNetDirect", "CollNetChain", "PAT")
"""NCCL algorithm names (NCCL_ALGO tokens, case as in NCCL's docs)."""
PROTOCOLS: tuple[str, ...] = ("LL", "LL128", "Simple")
"""NCCL protocol names (NCCL_PROTO tokens)."""
N_THREADS: tuple[int, ...] = (64, 128, 256, 512)
"""NCCL_NTHREADS values the docs allow (NCCL clamps others silently; nccl#698: 480 corrupts)."""
CTA_POLICIES: tuple[str, ...] = ("DEFAULT", "EFFICIENCY", "ZERO")
"""ncclConfig_t.CTAPolicy names (NCCL 2.27+, ZERO usable from 2.28)."""
CGA_CLUSTER_SIZES: tuple[int, ...] = tuple(range(0, 9))
"""ncclConfig_t.cgaClusterSize, 0..8 (sm90+; NCCL clamps above 8)."""

COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
"""Ops that run an NCCL algorithm (the tuner plugin is consulted for them)."""
P2P_OPS: tuple[str, ...] = ("send", "recv", "all_to_all")
"""Ops NCCL runs as point-to-point: no algorithm/protocol choice, CTAs not capped by the tuner (nccl#1598)."""

ALGORITHMS_FOR_OP: dict[str, tuple[str, ...]] = {
    "all_reduce": ("Ring", "Tree", "NVLS", "NVLSTree", "CollNetDirect", "CollNetChain"),
    "all_gather": ("Ring", "NVLS", "CollNetDirect", "PAT"),
    "reduce_scatter": ("Ring", "NVLS", "CollNetDirect", "PAT"),
    "broadcast": ("Ring",),
}
"""Which algorithm NCCL implements for which collective (Tree only for all-reduce, and so on)."""

PROTOCOLS_FOR_ALGORITHM: dict[str, tuple[str, ...]] = {
    "Ring": ("LL", "LL128", "Simple"),
    "Tree": ("LL", "LL128", "Simple"),
    "NVLS": ("Simple",),
    "NVLSTree": ("Simple",),
    "CollNetDirect": ("Simple",),
    "CollNetChain": ("Simple",),
    "PAT": ("Simple",),
}
"""Protocols each algorithm runs with in NCCL."""

_ALGORITHM_SINCE: dict[str, tuple[int, int, int]] = {
    "Ring": (2, 0, 0), "Tree": (2, 4, 0), "NVLS": (2, 17, 0), "NVLSTree": (2, 18, 0),
    "CollNetDirect": (2, 14, 0), "CollNetChain": (2, 14, 0), "PAT": (2, 23, 0),
}

CHUNK_RULES: dict[str, dict[str, int]] = {
    "Simple": {"min": 4096, "max": 524288, "multiple": 0},
    "LL": {"min": 1024, "max": 32768, "multiple": 0},
    "LL128": {"min": 3840, "max": 576000, "multiple": 120},
}
"""Chunk sizes NCCL can use per protocol, bytes. Simple and LL: powers of two up to one step of
the default buffer (NCCL_BUFFSIZE 4 MiB / NCCL_STEPS 8; LL buffer 512 KiB of 16-byte lines half of
which are flags, / 8 steps); LL128: multiples of 120 data bytes per 128-byte line up to one step
of its 4,915,200-byte buffer (x 120/128 / 8). NCCL clamps larger values to the buffer (tuner v6)."""
GLOO_CHUNK_MIN = 4096
"""Smallest piece lagom splits a gloo tensor into, bytes (a multiple of it is required)."""
GLOO_MAX_THREADS = 16
"""Largest gloo worker-thread count accepted per communicator."""
GLOO_DEFAULT_THREADS = 2
"""Worker threads of a gloo group built by ``new_group`` (torch 2.x; the pool's tests check it)."""

DEFAULT_CHUNK: dict[str, int] = {"Simple": 524288, "LL": 32768, "LL128": 576000}
"""NCCL's chunk per protocol with default buffers (bytes): what ``chunk_size=None`` means."""

MECHANISMS: dict[str, tuple[str, ...]] = {
    "nccl": ("tuner", "communicator", "env"),
    "sim": ("tuner", "communicator", "env"),
    "gloo": ("gloo",),
}
"""How a plan reaches the backend. ``tuner``: lagom's NCCL tuner plugin per call, plus
ncclConfig_t per communicator, plus the launch environment. ``communicator``: no plugin; per
communicator ncclConfig_t (min/max CTAs) and NCCL_ALGO/NCCL_PROTO set before the communicator
is created (communicator pool). ``env``: process-wide environment only. ``gloo``: gloo worker
threads per communicator and lagom's own tensor splitting per call."""

Scope = Literal["call", "communicator", "process"]
SCOPES: tuple[str, ...] = ("call", "communicator", "process")


TUNER_ABI_SINCE: tuple[tuple[tuple[int, int, int], int], ...] = (
    ((2, 30, 0), 6), ((2, 28, 0), 5), ((2, 24, 0), 4), ((2, 22, 0), 3), ((2, 21, 0), 2), ((2, 19, 0), 1),
)
"""Newest tuner plugin ABI per NCCL version: v3 (2.22) edits the cost table, v4 (2.24) adds regBuff,
v5 (2.28) per-communicator constants, v6 (2.30) getChunkSize. lagom's plugin implements v3-v6."""


def tuner_abi(nccl_version: tuple[int, int, int]) -> int:
    """Newest tuner plugin ABI NCCL ``nccl_version`` loads (0 = none)."""
    return next((abi for since, abi in TUNER_ABI_SINCE if nccl_version >= since), 0)


def default_mechanism(backend: str) -> str:
    """The mechanism a backend uses unless told otherwise: ``tuner`` (nccl, sim) or ``gloo``.

    Raises:
        ValueError: unknown backend (names it and the allowed set).
    """
    if backend not in MECHANISMS:
        raise ValueError(f"backend must be one of {sorted(MECHANISMS)}; got {backend!r}")
    return MECHANISMS[backend][0]


def _version(cluster: Any) -> tuple[int, int, int]:
    return cluster.nccl if cluster is not None else (2, 27, 5)


def max_channels(cluster: Any) -> int:
    """Largest channel (CTA) count NCCL allows: 64 from NCCL 2.25, 32 before; gloo: 16 threads."""
    if cluster is not None and cluster.backend == "gloo":
        return GLOO_MAX_THREADS
    return 64 if _version(cluster) >= (2, 25, 0) else 32


def knob_scope(knob: str, *, backend: str, mechanism: str | None = None, nccl_version: tuple[int, int, int] = (2, 27, 5)) -> str | None:
    """The widest unit a knob can differ over, or None when the mechanism cannot set it at all.

    ``call``: each collective site can have its own value; ``communicator``: one value per
    communicator (Megatron process group); ``process``: one value for the whole job.
    Sources: NCCL tuner plugin ABI v3-v6 (algorithm, protocol, nChannels per call from v3 /
    NCCL 2.22; chunk size per call from v6 / NCCL 2.30), ncclConfig_t fields (minCTAs/maxCTAs
    2.17, cgaClusterSize 2.17, CTAPolicy 2.27), NCCL_NTHREADS read once per process.

    Raises:
        ValueError: unknown knob, backend or mechanism (names it and the allowed set).
    """
    if knob not in KNOB_ORDER:
        raise ValueError(f"knob must be one of {list(KNOB_ORDER)}; got {knob!r}")
    if backend not in MECHANISMS:
        raise ValueError(f"backend must be one of {sorted(MECHANISMS)}; got {backend!r}")
    mechanism = mechanism or default_mechanism(backend)
    if mechanism not in MECHANISMS[backend]:
        raise ValueError(f"mechanism for backend {backend!r} must be one of {list(MECHANISMS[backend])}; got {mechanism!r}")
    if backend == "gloo":
        return {"n_channels": "communicator", "chunk_size": "call"}.get(knob)
    v = nccl_version
    if knob == "n_threads":
        return "process"
    if knob == "cta_policy":
        return None if v < (2, 27, 0) else ("process" if mechanism == "env" else "communicator")
    if knob == "cga_cluster_size":
        return None if v < (2, 17, 0) else ("process" if mechanism == "env" else "communicator")
    if mechanism == "env":
        return None if knob == "chunk_size" else "process"
    if mechanism == "communicator":
        return None if knob == "chunk_size" else "communicator"
    # tuner plugin (lagom's implements ABI v3-v6): per call from v3; chunk size from v6. Below
    # v3 the plugin does not load and the communicator pool sets these per communicator.
    abi = tuner_abi(v)
    if knob == "chunk_size":
        return "call" if abi >= 6 else None
    return "call" if abi >= 3 else "communicator"


def algorithms_for(*, op: str, cluster: Any, n_nodes: int = 1, group_size: int = 2) -> tuple[str, ...]:
    """Algorithms NCCL can run for ``op`` on ``cluster`` (empty for point-to-point ops).

    NVLS/NVLSTree need NVSwitch and sm90+ (NVLSTree only across nodes); CollNet needs IB SHARP
    and more than one node; PAT needs one rank per node; each needs its first NCCL version.
    """
    if op not in ALGORITHMS_FOR_OP:
        return ()
    v = _version(cluster)
    out = []
    for alg in ALGORITHMS_FOR_OP[op]:
        if v < _ALGORITHM_SINCE[alg]:
            continue
        if alg in ("NVLS", "NVLSTree") and not (cluster.nvswitch and cluster.sm_arch >= 90):
            continue
        if alg == "NVLSTree" and n_nodes < 2:
            continue
        if alg in ("NVLS", "NVLSTree") and group_size <= 2 * n_nodes:
            continue  # two GPUs per NVLink domain: a direct copy, nothing for the switch to do (our rule)
        if alg == "NVLS" and n_nodes > 1 and op != "all_reduce":
            continue  # NVLS all-gather / reduce-scatter are modelled inside one NVLink domain only
        if alg.startswith("CollNet") and not (cluster.collnet and n_nodes > 1):
            continue
        if alg == "PAT" and group_size != n_nodes:
            continue
        out.append(alg)
    return tuple(out)


def chunk_domain(protocol: str | None, backend: str = "nccl") -> tuple[int, ...]:
    """Chunk sizes (bytes) the search tries for a protocol: NCCL's default and three smaller."""
    if backend == "gloo":
        return (262144, 1048576, 4194304)
    if protocol == "LL128":
        return (72000, 144000, 288000, 576000)
    if protocol == "LL":
        return (4096, 8192, 16384, 32768)
    return (65536, 131072, 262144, 524288)


def domains(*, backend: str, cluster: Any, op: str, n_nodes: int = 1, group_size: int = 2, protocol: str | None = None, mechanism: str | None = None) -> dict[str, tuple]:
    """The values the search scans for each knob of one site (``(None,)`` = left to NCCL).

    These are subsets of what ``validate_config`` accepts, chosen so that a scan of each knob is
    short (the search cost is linear in the sum of domain sizes): channels on a roughly
    geometric grid up to the NCCL maximum, four chunk sizes per protocol, all thread counts,
    protocols without forcing LL128 where NCCL would not enable it, the op's algorithms.
    A knob whose scope is None under ``mechanism`` gets ``(None,)``.

    Raises:
        ValueError: unknown backend or mechanism.
    """
    mech = mechanism or default_mechanism(backend)
    v = _version(cluster)
    scope = {k: knob_scope(k, backend=backend, mechanism=mech, nccl_version=v) for k in KNOB_ORDER}
    out: dict[str, tuple] = {k: (None,) for k in KNOB_ORDER}
    if backend == "gloo":
        out["n_channels"] = (1, 2, 4)
        out["chunk_size"] = (None,) + chunk_domain(None, "gloo")
        return out
    if op in P2P_OPS:
        return out  # NCCL's tuner is not consulted for point-to-point; CTAs not capped (nccl#1598)
    cap = max_channels(cluster)
    out["n_channels"] = tuple(c for c in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64) if c <= cap)
    if scope["chunk_size"] is not None:
        out["chunk_size"] = (None,) + chunk_domain(protocol)
    out["n_threads"] = N_THREADS
    if mech == "env":
        return out  # a process-wide algorithm or protocol would hit every op: never searched
    algs = algorithms_for(op=op, cluster=cluster, n_nodes=n_nodes, group_size=group_size)
    if scope["algorithm"] is not None and algs:
        out["algorithm"] = algs
    protos = ("LL", "LL128", "Simple") if cluster.sm_arch >= 80 else ("LL", "Simple")
    if mech != "tuner":
        protos = tuple(p for p in protos if p != "LL128")  # never force LL128 through NCCL_PROTO
    out["protocol"] = protos
    return out


def _fail(knob: str, value: Any, allowed: Any, why: str = "") -> ValueError:
    why = f" ({why})" if why else ""
    return ValueError(f"{knob} {value!r} is not allowed{why}; allowed: {allowed}")


def validate_config(config: CommConfig, *, op: str, cluster: Any, mechanism: str | None = None, n_nodes: int = 1, group_size: int | None = None) -> None:
    """Checks every set knob of ``config`` against NCCL's documented domain for ``op`` on ``cluster``.

    Rules (research notes, ecosystem section 5): algorithm and protocol names as NCCL spells
    them, algorithm implemented for the op and the hardware, protocol run by the algorithm,
    LL128 never forced through the environment (silent corruption, nccl#786/#1261), n_threads
    in {64, 128, 256, 512}, 1 <= n_channels <= 64 (32 before NCCL 2.25), chunk size within the
    protocol's buffer step and granularity, CTA policy name, CGA cluster size 0..8 (sm90+).

    Raises:
        ValueError: the first offending knob, with its value and the allowed set.
    """
    backend = cluster.backend if cluster is not None else "nccl"
    mech = mechanism or default_mechanism(backend)
    group_size = group_size or max(2, n_nodes * getattr(cluster, "gpus_per_node", 1))  # whole nodes
    c = config
    if backend == "gloo":
        for knob in ("algorithm", "protocol", "n_threads", "cta_policy", "cga_cluster_size"):
            if getattr(c, knob) is not None:
                raise _fail(knob, getattr(c, knob), [None], "gloo has no such knob")
        if c.n_channels is not None and not (isinstance(c.n_channels, int) and 1 <= c.n_channels <= GLOO_MAX_THREADS):
            raise _fail("n_channels", c.n_channels, f"1..{GLOO_MAX_THREADS} gloo worker threads")
        if c.chunk_size is not None and not (isinstance(c.chunk_size, int) and c.chunk_size >= GLOO_CHUNK_MIN and c.chunk_size % GLOO_CHUNK_MIN == 0):
            raise _fail("chunk_size", c.chunk_size, f"a multiple of {GLOO_CHUNK_MIN} bytes")
        return
    if c.algorithm is not None:
        if c.algorithm not in ALGORITHMS:
            raise _fail("algorithm", c.algorithm, list(ALGORITHMS), "unknown NCCL algorithm")
        if op not in ALGORITHMS_FOR_OP:
            raise _fail("algorithm", c.algorithm, [None], f"op {op!r} is point-to-point")
        if c.algorithm not in ALGORITHMS_FOR_OP[op]:
            raise _fail("algorithm", c.algorithm, list(ALGORITHMS_FOR_OP[op]), f"not implemented for {op}")
        ok = algorithms_for(op=op, cluster=cluster, n_nodes=n_nodes, group_size=group_size)
        if c.algorithm not in ok:
            raise _fail("algorithm", c.algorithm, list(ok),
                        f"not available on {cluster.name} (sm{cluster.sm_arch}, NCCL {cluster.nccl_version}, {n_nodes} node(s))")
    if c.protocol is not None:
        if c.protocol not in PROTOCOLS:
            raise _fail("protocol", c.protocol, list(PROTOCOLS), "unknown NCCL protocol")
        if op in P2P_OPS:
            raise _fail("protocol", c.protocol, [None], f"op {op!r} is point-to-point")
        if c.protocol == "LL128" and mech != "tuner":
            raise _fail("protocol", c.protocol, ["LL", "Simple"],
                        "forcing LL128 through NCCL_PROTO can corrupt data silently; only the tuner plugin may prefer it")
        if c.algorithm is not None and c.protocol not in PROTOCOLS_FOR_ALGORITHM[c.algorithm]:
            raise _fail("protocol", c.protocol, list(PROTOCOLS_FOR_ALGORITHM[c.algorithm]), f"with algorithm {c.algorithm}")
    if c.n_threads is not None and (isinstance(c.n_threads, bool) or c.n_threads not in N_THREADS):
        raise _fail("n_threads", c.n_threads, list(N_THREADS), "NCCL_NTHREADS")
    if c.n_channels is not None:
        cap = max_channels(cluster)
        if isinstance(c.n_channels, bool) or not isinstance(c.n_channels, int) or not 1 <= c.n_channels <= cap:
            raise _fail("n_channels", c.n_channels, f"integers 1..{cap} (NCCL {cluster.nccl_version})")
        if op in P2P_OPS and mech == "tuner":
            raise _fail("n_channels", c.n_channels, [None], f"the tuner plugin cannot cap {op} (nccl#1598)")
    if c.chunk_size is not None:
        v = _version(cluster)
        if mech != "tuner" or v < (2, 30, 0):
            raise _fail("chunk_size", c.chunk_size, [None], f"per-call chunk size needs the tuner plugin v6 (NCCL >= 2.30); have NCCL {cluster.nccl_version}, mechanism {mech}")
        _check_chunk(c.chunk_size, c.protocol or "Simple")
    if c.cta_policy is not None and c.cta_policy not in CTA_POLICIES:
        raise _fail("cta_policy", c.cta_policy, list(CTA_POLICIES))
    if c.cga_cluster_size is not None:
        if isinstance(c.cga_cluster_size, bool) or c.cga_cluster_size not in CGA_CLUSTER_SIZES:
            raise _fail("cga_cluster_size", c.cga_cluster_size, "integers 0..8")
        if cluster.sm_arch < 90 and c.cga_cluster_size != 0:
            raise _fail("cga_cluster_size", c.cga_cluster_size, [0], f"thread-block clusters need sm90+; {cluster.name} is sm{cluster.sm_arch}")


def _check_chunk(chunk: int, protocol: str) -> None:
    rule = CHUNK_RULES[protocol]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not rule["min"] <= chunk <= rule["max"]:
        raise _fail("chunk_size", chunk, f"{rule['min']}..{rule['max']} bytes for protocol {protocol}")
    if rule["multiple"]:
        if chunk % rule["multiple"]:
            raise _fail("chunk_size", chunk, f"multiples of {rule['multiple']} bytes for protocol {protocol} (120 data bytes per 128-byte line)")
    elif chunk & (chunk - 1):
        raise _fail("chunk_size", chunk, f"powers of two for protocol {protocol}")


def validate_cta_range(min_ctas: int | None, max_ctas: int | None, *, cluster: Any) -> None:
    """Checks a communicator's CTA range as written to ncclConfig_t / Megatron's YAML.

    Both ends must be given (NCCL PR#2256: ``min_ctas`` alone reaches NCCL as 4/-2147483648 and
    fails with ncclInvalidArgument), integers, and 1 <= min_ctas <= max_ctas <= 64 (32 before 2.25).

    Raises:
        ValueError: names the missing end, or the numbers that break the rule.
    """
    if (min_ctas is None) != (max_ctas is None):
        given, missing = ("min_ctas", "max_ctas") if max_ctas is None else ("max_ctas", "min_ctas")
        raise ValueError(f"a CTA range needs both ends: {given} is set but {missing} is not (NCCL rejects a one-sided range)")
    if min_ctas is None:
        return
    cap = max_channels(cluster)
    for name, value in (("min_ctas", min_ctas), ("max_ctas", max_ctas)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap:
            raise _fail(name, value, f"integers 1..{cap} (NCCL {cluster.nccl_version})")
    if min_ctas > max_ctas:
        raise ValueError(f"min_ctas ({min_ctas}) must be <= max_ctas ({max_ctas})")


def _split_list(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


def validate_env(env: dict[str, str]) -> None:
    """Checks NCCL environment variables lagom would write (or the user set) against NCCL's rules.

    NCCL_PROTO must not force LL128 (only exclusions like ``^LL128`` are accepted); NCCL_ALGO
    must not be a global list without Ring (pytorch#163063: broadcast/barrier die with NVLS or
    CollNet alone); NCCL_NTHREADS in {64, 128, 256, 512}; NCCL_BUFFSIZE a power of two.

    Raises:
        ValueError: names the variable, its value and what is allowed.
    """
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
                    raise _fail("NCCL_PROTO", value, list(PROTOCOLS), f"unknown token {bad[0]!r}")
                if any(t.lower() == "ll128" for t in tokens):
                    raise _fail("NCCL_PROTO", value, "exclusions such as '^LL128' or lists without LL128",
                                "forcing LL128 can corrupt data silently (nccl#786)")
        elif key == "NCCL_ALGO":
            for entry in value.split(";"):
                prefixed = ":" in entry
                body = entry.split(":", 1)[-1]
                if body.startswith("^"):
                    continue
                tokens = _split_list(body)
                bad = [t for t in tokens if t.lower() not in {a.lower() for a in ALGORITHMS}]
                if bad:
                    raise _fail("NCCL_ALGO", value, list(ALGORITHMS), f"unknown token {bad[0]!r}")
                if not prefixed and "ring" not in {t.lower() for t in tokens}:
                    raise _fail("NCCL_ALGO", value, "a global list that includes Ring, or per-function entries ('allreduce:nvls,ring')",
                                "collectives with no allowed algorithm fail (pytorch#163063)")
        elif key == "NCCL_NTHREADS":
            if not value.isdigit() or int(value) not in N_THREADS:
                raise _fail("NCCL_NTHREADS", value, list(N_THREADS))
        elif key == "NCCL_BUFFSIZE":
            if not value.isdigit() or int(value) <= 0 or int(value) & (int(value) - 1):
                raise _fail("NCCL_BUFFSIZE", value, "powers of two (bytes)")


def applicable(config: CommConfig, *, op: str, backend: str) -> CommConfig:
    """``config`` without the knobs that do not apply to ``op`` on ``backend`` (probe configs are
    applied to all sites at once; a send/recv site keeps only what NCCL's P2P path honours)."""
    if backend == "gloo":
        return CommConfig(n_channels=config.n_channels, chunk_size=config.chunk_size)
    if op in P2P_OPS:
        return CommConfig(n_threads=config.n_threads)
    if config.algorithm is not None and config.algorithm not in ALGORITHMS_FOR_OP.get(op, ()):
        return CommConfig(**{**config.to_dict(), "algorithm": None})
    return config


def probe_configs(backend: str, cluster: Any) -> list[CommConfig]:
    """The few configs the warm-up applies to every site at once, one per probe iteration.

    Each probe gives every region one more measured point; together with the default iteration
    they span what the cost model fits: channel count (bandwidth growth and SM share), protocol
    (HBM traffic per wire byte) and, where settable, chunk size. All are valid for every
    collective op (``applicable`` strips them for point-to-point sites).

    Raises:
        ValueError: unknown backend.
    """
    if backend not in MECHANISMS:
        raise ValueError(f"backend must be one of {sorted(MECHANISMS)}; got {backend!r}")
    if backend == "gloo":
        return [CommConfig(n_channels=1), CommConfig(n_channels=4), CommConfig(n_channels=2, chunk_size=1048576)]
    cap = max_channels(cluster)
    probes = [CommConfig(n_channels=2), CommConfig(n_channels=8), CommConfig(protocol="Simple", n_channels=min(16, cap))]
    if cluster is not None and cluster.nccl >= (2, 30, 0):
        probes.append(CommConfig(protocol="Simple", n_channels=4, chunk_size=131072))
    return probes
