"""The knob space: ``CommConfig`` (None = NCCL's own choice), each knob's values, and ``KnobRules``, by which the
applying layer (``nccl.rules.NcclRules``, ``megatron.gloo.GlooRules``) gives the engine knobs, scopes, domains."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from lagom_megatron.engine.cluster import ClusterSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class CommConfig:
    """One communication config, None = NCCL's own; gloo: only ``n_channels`` (threads), ``chunk_size`` (piece)."""

    algorithm: str | None = None
    protocol: str | None = None
    n_channels: int | None = None
    """Channels, one CTA each (1..64 from NCCL 2.25, 1..32 before)."""
    n_threads: int | None = None
    """Threads per CTA: 64, 128, 256 or 512 (NCCL_NTHREADS; process scope)."""
    chunk_size: int | None = None
    """Bytes moved per step of a channel (tuner plugin v6 / NCCL 2.30+)."""
    cta_policy: str | None = None
    """ncclConfig_t.CTAPolicy (communicator scope)."""
    cga_cluster_size: int | None = None
    """ncclConfig_t.cgaClusterSize, 0..8 (communicator scope, sm90+; NCCL clamps above 8)."""
    net_peer_channels: int | None = None
    """P2P: ncclConfig_t.nChannelsPerNetPeer (NCCL 2.28+) or NCCL_NCHANNELS_PER_NET_PEER (process scope)."""
    high_priority_stream: bool | None = None
    """Run on a pool entry with a high-priority NCCL stream (``ProcessGroupNCCL.Options.is_high_priority_stream``)."""

    def to_dict(self) -> dict[str, Any]:
        """Returns the fields that are set (not ``None``), JSON-ready."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommConfig:
        """Builds a config from ``to_dict`` output; ValueError on a key that is not a field."""
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown CommConfig field(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**data)

    def is_default(self) -> bool:
        """True when every knob is left to NCCL (a field comparison: called per site per iteration)."""
        return self == DEFAULT


DEFAULT = CommConfig()


# Knob values: NCCL's user guide (env.rst, api/types.rst), src/graph/tuning.cc, src/init.cc; gloo's threads, pieces.

KNOB_ORDER: tuple[str, ...] = (
    "n_channels",
    "chunk_size",
    "n_threads",
    "protocol",
    "algorithm",
    "cta_policy",
    "cga_cluster_size",
    "net_peer_channels",
    "high_priority_stream",
)
"""Knob-priority order of the search: channels and chunk size first, they move compute slowdown most (Lagom)."""

ALGORITHMS: tuple[str, ...] = ("Ring", "Tree", "NVLS", "NVLSTree", "CollNetDirect", "CollNetChain", "PAT")
"""NCCL_ALGO / NCCL_PROTO tokens, case as in NCCL's docs."""
PROTOCOLS: tuple[str, ...] = ("LL", "LL128", "Simple")
N_THREADS: tuple[int, ...] = (64, 128, 256, 512)
"""NCCL_NTHREADS values the docs allow (NCCL clamps others silently; nccl#698: 480 corrupts)."""
CTA_POLICIES: tuple[str, ...] = ("DEFAULT", "EFFICIENCY", "ZERO")
"""ncclConfig_t.CTAPolicy names (NCCL 2.27+, ZERO usable from 2.28)."""
CGA_CLUSTER_SIZES: tuple[int, ...] = tuple(range(0, 9))
NET_PEER_CHANNELS: tuple[int, ...] = (1, 2, 4, 8, 16)
"""Values tried: NCCL rounds ``nChannelsPerNetPeer`` up to a power of two (v2.30.7 src/graph/paths.cc:988)."""

COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
P2P_OPS: tuple[str, ...] = ("send", "recv", "all_to_all")
"""Ops NCCL runs as point-to-point: no algorithm/protocol choice, CTAs not capped by the tuner (nccl#1598)."""

ALGORITHMS_FOR_OP: dict[str, tuple[str, ...]] = {
    "all_reduce": ("Ring", "Tree", "NVLS", "NVLSTree", "CollNetDirect", "CollNetChain"),
    "all_gather": ("Ring", "NVLS", "CollNetDirect", "PAT"),
    "reduce_scatter": ("Ring", "NVLS", "CollNetDirect", "PAT"),
    "broadcast": ("Ring",),
}

PROTOCOLS_FOR_ALGORITHM: dict[str, tuple[str, ...]] = {
    "Ring": ("LL", "LL128", "Simple"),
    "Tree": ("LL", "LL128", "Simple"),
    "NVLS": ("Simple",),
    "NVLSTree": ("Simple",),
    "CollNetDirect": ("Simple",),
    "CollNetChain": ("Simple",),
    "PAT": ("Simple",),
}

GLOO_MAX_THREADS = 16
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Registration:
    """What registering one site's buffers (Megatron's ``--use-nccl-ub``, from the next launch) lets NCCL run; given
    by ``KnobRules.registration`` for a site whose buffers can be registered here."""

    symmetric_kernels: bool
    """NCCL's symmetric-kernel picker runs the call on the registered window (all-NVLink; ``sym_kernels.cc``)."""
    copy_engine: bool
    """A pool entry with ``cta_policy`` ZERO runs it on copy engines, no SM (``ce_coll.cc`` ``ncclCeAvailable``)."""


class KnobRules(Protocol):
    """What one mechanism (tuner, communicator, env or gloo) can set on one cluster: the engine's search domain."""

    cluster: ClusterSpec
    backend: str
    mechanism: str

    def scope(self, knob: str) -> Scope | None:
        """Widest unit ``knob`` can differ over (call, communicator, process) or None; ValueError on an unknown knob."""

    def domains(
        self, *, op: str, n_nodes: int = 1, group_size: int = 2, reduce_op: str | None = None
    ) -> dict[str, tuple]:
        """Values scanned per knob for one site (``(None,)`` = not tunable); ``reduce_op`` where known."""

    def site_domains(self, site: Any) -> tuple[dict[str, tuple], str]:
        """``domains`` of one site, cut by what its call allows (reduction, dtype, registration), and a note why."""

    def for_sites(self, sites: Any) -> KnobRules:
        """These rules for a search over ``sites``: a specialised copy where domains depend on all sites, else self."""

    def registration(self, site: Any) -> Registration | None:
        """What registering ``site``'s buffers at the next launch would let NCCL run; None where they cannot be
        registered here (a group Megatron does not register, the versions, the hardware, the mechanism)."""

    def probe_configs(self) -> list[CommConfig]:
        """The few configs the warm-up applies to every site at once, one per probe iteration."""

    def applicable(self, config: CommConfig, *, op: str) -> CommConfig:
        """``config`` without the knobs that do not apply to ``op`` (probes go to every site)."""

    def validate(
        self,
        config: CommConfig,
        *,
        op: str,
        n_nodes: int = 1,
        group_size: int | None = None,
        reduce_op: str | None = None,
        dtype: str | None = None,
    ) -> None:
        """Raises ValueError naming the first knob of ``config`` the mechanism cannot apply to such a call."""

    def process_env(self, chosen: dict[str, list[int]]) -> dict[str, str]:
        """Launch environment for the process-scope knobs; ``chosen``: knob -> values picked for its sites."""
