"""The knob space: communication configurations, the values each knob can take, and the contract
(``KnobRules``) by which the layer that applies plans tells the engine what it can set.

A ``CommConfig`` is one point of the knob space of one collective: algorithm, protocol,
n_channels (CTAs), n_threads, chunk_size (bytes), and per-communicator extras (CTA policy, CGA
cluster size). ``None`` in a field means "NCCL's own choice" (stock behaviour).

Which knobs a mechanism can set, at which scope, on which NCCL version, is not decided here: the
engine is handed a ``KnobRules`` (``lagom_megatron.nccl.rules.NcclRules`` on NCCL and on the
simulator, ``lagom_megatron.megatron.gloo.GlooRules`` on gloo) and searches the domain it gives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from lagom_megatron.engine.cluster import ClusterSpec


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
    net_peer_channels: int | None = None
    """Channels per network peer of point-to-point calls: ncclConfig_t.nChannelsPerNetPeer (NCCL
    2.28+, where torch binds it) or NCCL_NCHANNELS_PER_NET_PEER (process scope); a power of two."""
    high_priority_stream: bool | None = None
    """The site's collectives run on a pool entry whose NCCL stream has a high CUDA priority
    (``ProcessGroupNCCL.Options.is_high_priority_stream``, as Megatron's
    ``--high-priority-stream-groups`` sets for a group; communicator scope). None = the group's own
    stream priority."""

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
# The values each knob can take (NCCL's names and ranges; gloo's threads and pieces).
#
# Sources: NCCL's user guide (env.rst, api/types.rst), src/graph/tuning.cc and src/init.cc as
# summarised in the project's research notes (NCCL mechanisms; ecosystem section 5).
# --------------------------------------------------------------------------------------------

KNOB_ORDER: tuple[str, ...] = (
    "n_channels", "chunk_size", "n_threads", "protocol", "algorithm", "cta_policy", "cga_cluster_size",
    "net_peer_channels", "high_priority_stream",
)
"""Knob-priority order of the search (docs/engine.md): channels and chunk size first, because
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
NET_PEER_CHANNELS: tuple[int, ...] = (1, 2, 4, 8, 16)
"""Channels per network peer the search tries: NCCL rounds ``nChannelsPerNetPeer`` up to a power of
two (NVIDIA/nccl v2.30.7 ``src/graph/paths.cc:988``), so only powers of two are distinct."""

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

GLOO_MAX_THREADS = 16
"""Largest gloo worker-thread count accepted per communicator."""
GLOO_DEFAULT_THREADS = 2
"""Worker threads of a gloo group built by ``new_group`` (torch 2.x; the pool's tests check it)."""

DEFAULT_CHUNK: dict[str, int] = {"Simple": 524288, "LL": 32768, "LL128": 576000}
"""NCCL's chunk per protocol with default buffers (bytes): what ``chunk_size=None`` means."""

Scope = Literal["call", "communicator", "process"]
SCOPES: tuple[str, ...] = ("call", "communicator", "process")


def _version(cluster: Any) -> tuple[int, int, int]:
    return cluster.nccl if cluster is not None else (2, 27, 5)


def max_channels(cluster: Any) -> int:
    """Largest channel (CTA) count NCCL allows: 64 from NCCL 2.25, 32 before; gloo: 16 threads."""
    if cluster is not None and cluster.backend == "gloo":
        return GLOO_MAX_THREADS
    return 64 if _version(cluster) >= (2, 25, 0) else 32


def chunk_domain(protocol: str | None, backend: str = "nccl") -> tuple[int, ...]:
    """Chunk sizes (bytes) the search tries for a protocol: NCCL's default and three smaller."""
    if backend == "gloo":
        return (262144, 1048576, 4194304)
    if protocol == "LL128":
        return (72000, 144000, 288000, 576000)
    if protocol == "LL":
        return (4096, 8192, 16384, 32768)
    return (65536, 131072, 262144, 524288)


def invalid_value(knob: str, value: Any, allowed: Any, why: str = "") -> ValueError:
    """The ``ValueError`` every knob check raises: ``"<knob> <value> is not allowed (<why>); allowed: <set>"``."""
    why = f" ({why})" if why else ""
    return ValueError(f"{knob} {value!r} is not allowed{why}; allowed: {allowed}")


class KnobRules(Protocol):
    """What one mechanism can set on one cluster: the search domain handed to the engine.

    Implemented by ``lagom_megatron.nccl.rules.NcclRules`` (NCCL and the simulated cluster: tuner
    plugin, communicator options or process environment, per NCCL version) and
    ``lagom_megatron.megatron.gloo.GlooRules`` (gloo worker threads and tensor pieces). The engine
    never decides these itself: a plan can then hold only what the applying layer can apply.

    Attributes:
        cluster: the ``ClusterSpec`` the rules are for (also the cost model's cluster).
        backend: ``nccl``, ``gloo`` or ``sim``: what profiles and plans are labelled with.
        mechanism: how a plan is applied (``tuner``, ``communicator``, ``env`` or ``gloo``).
    """

    cluster: "ClusterSpec"
    backend: str
    mechanism: str

    def scope(self, knob: str) -> Scope | None:
        """The widest unit ``knob`` can differ over (``call``, ``communicator``, ``process``), or
        None when the mechanism cannot set it. Raises ValueError on an unknown knob."""

    def domains(self, *, op: str, n_nodes: int = 1, group_size: int = 2, reduce_op: str | None = None) -> dict[str, tuple]:
        """Values the search scans per knob for one collective site (``(None,)`` = not tunable);
        ``reduce_op`` is the call's reduction where known (some algorithms depend on it)."""

    def site_domains(self, site: Any) -> tuple[dict[str, tuple], str]:
        """``domains`` of one ``profile.CollectiveSite``, cut by what the call itself allows (its
        reduction, dtype, buffer registration), and a note on what was cut and why (empty when
        nothing was)."""

    def for_sites(self, sites: Any) -> "KnobRules":
        """These rules for one search over ``sites`` (``profile.CollectiveSite``): rules whose domains
        depend on the whole set of sites (e.g. a memory budget the sites' groups share) return a
        specialised copy; others return themselves."""

    def probe_configs(self) -> list[CommConfig]:
        """The few configs the warm-up applies to every site at once, one per probe iteration."""

    def applicable(self, config: CommConfig, *, op: str) -> CommConfig:
        """``config`` without the knobs that do not apply to ``op`` (probes go to every site)."""

    def validate(self, config: CommConfig, *, op: str, n_nodes: int = 1, group_size: int | None = None,
                 reduce_op: str | None = None, dtype: str | None = None) -> None:
        """Raises ValueError naming the first knob of ``config`` the mechanism cannot apply (for a call
        with ``reduce_op`` and ``dtype`` where they are known)."""

    def process_env(self, chosen: dict[str, list[int]]) -> dict[str, str]:
        """The launch environment that applies the process-scope knobs of a plan: ``chosen`` maps
        each such knob to the values the search picked for the sites it governs."""
