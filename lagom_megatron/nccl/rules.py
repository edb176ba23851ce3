"""Which knob NCCL lets lagom set, at which scope, with which values: the search domain on NCCL (and the simulator's)
under the mechanisms ``tuner``, ``communicator`` and ``env`` (docs/nccl.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import (
    ALGORITHMS_FOR_OP,
    KNOB_ORDER,
    N_THREADS,
    NET_PEER_CHANNELS,
    P2P_OPS,
    CommConfig,
    Registration,
    Scope,
    chunk_domain,
    invalid_value,
    max_channels,
)
from lagom_megatron.engine.plan import NCCL_MECHANISMS as MECHANISMS
from lagom_megatron.nccl.capabilities import Capabilities, fixed_knob_warning, restrict_domains
from lagom_megatron.nccl.pool import channel_cap, group_share
from lagom_megatron.nccl.registration import copy_engine_problem, symmetric_kernel_problem
from lagom_megatron.nccl.registration import registration as registration_for
from lagom_megatron.nccl.validate import (
    CHUNK_RULES,
    algorithms_for,
    call_algorithms,
    nccl_bins,
    validate_config,
    validate_cta_range,
)


def ll128_enabled(cluster: ClusterSpec, *, n_nodes: int = 1, group_size: int = 2) -> bool:
    """Whether NCCL enables LL128 by default for ``group_size`` ranks on ``n_nodes`` (PCIe: a bridged pair per node)."""
    if cluster.sm_arch < 80:
        return False
    if cluster.intra_link != "pcie":
        return True
    return bool(cluster.nvlink_bridge_gbps) and max(1, group_size // max(1, n_nodes)) == 2


TUNER_ABI_SINCE: tuple[tuple[tuple[int, int, int], int], ...] = (
    ((2, 32, 6), 7),
    ((2, 30, 0), 6),
    ((2, 28, 0), 5),
    ((2, 24, 0), 4),
    ((2, 22, 0), 3),
    ((2, 21, 0), 2),
    ((2, 19, 0), 1),
)
"""Newest tuner ABI per NCCL version: v3 edits the cost table, v4 adds regBuff, v5 per-comm constants, v6 chunk size,
v7 a fifth compute-capability row (Rubin); the 2.32.3 library still names v6 as its newest, 2.32.6 v7."""


def tuner_abi(nccl_version: tuple[int, int, int]) -> int:
    """Newest tuner plugin ABI NCCL ``nccl_version`` loads (0 = none)."""
    return next((abi for since, abi in TUNER_ABI_SINCE if nccl_version >= since), 0)


LAGOM_TUNER_ABI_MIN = 3
"""Oldest tuner ABI lagom's plugin exports (``ncclTunerPlugin_v3``, NCCL 2.22)."""


def default_mechanism(cluster: ClusterSpec) -> str:
    """``tuner`` where the cluster's NCCL loads lagom's plugin (NCCL 2.22+), else ``communicator``."""
    return "tuner" if tuner_abi(cluster.nccl) >= LAGOM_TUNER_ABI_MIN else "communicator"


def check_mechanism(mechanism: str, cluster: ClusterSpec) -> None:
    """Refuses ``tuner`` (ValueError) on a cluster whose NCCL cannot load lagom's plugin."""
    if mechanism == "tuner" and tuner_abi(cluster.nccl) < LAGOM_TUNER_ABI_MIN:
        raise ValueError(
            f"mechanism 'tuner' needs NCCL 2.22 or newer (lagom's tuner plugin, ABI v3); cluster "
            f"{cluster.name!r} has NCCL {cluster.nccl_version}: use mechanism 'communicator' or 'env'"
        )


__all__ = [
    "BACKENDS",
    "CHUNK_RULES",
    "MECHANISMS",
    "NcclRules",
    "algorithms_for",
    "applicable",
    "domains",
    "knob_scope",
    "probe_configs",
    "process_env",
    "tuner_abi",
    "tuner_call_key",
    "validate_config",
    "validate_cta_range",
    "check_mechanism",
    "default_mechanism",
]


BACKENDS: tuple[str, ...] = ("nccl", "sim")


HIGH_PRIORITY_DOMAIN: tuple = (None, True)
"""A site's own group's stream (None) or a high-priority pool entry; a low priority could only delay."""

P2P_CHANNEL_GRID: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
"""P2P CTA bounds worth trying: ``p2pnChannels`` is a power of two (v2.30.7 ``src/graph/paths.cc:977-991``)."""


def knob_scope(knob: str, *, mechanism: str = "tuner", nccl_version: tuple[int, int, int] = (2, 27, 5)) -> Scope | None:
    """Widest unit (call, communicator, process) a knob varies over; None if ``mechanism`` cannot set it; ValueError."""
    if knob not in KNOB_ORDER:
        raise ValueError(f"knob must be one of {list(KNOB_ORDER)}; got {knob!r}")
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism for backend 'nccl' must be one of {list(MECHANISMS)}; got {mechanism!r}")
    v = nccl_version
    if knob == "n_threads":
        return "process"
    if knob == "cta_policy":
        return None if v < (2, 27, 0) else ("process" if mechanism == "env" else "communicator")
    if knob == "cga_cluster_size":
        return None if v < (2, 17, 0) else ("process" if mechanism == "env" else "communicator")
    if knob == "high_priority_stream":
        # a pool entry's option, any NCCL (torch initNCCLComm, getStreamFromPool); env makes no groups
        return None if mechanism == "env" else "communicator"
    if knob == "net_peer_channels":
        # a cached NCCL_PARAM (2.12+); the ncclConfig_t field (2.28+) only where torch binds it (NcclRules.scope)
        return None if v < (2, 12, 0) else "process"
    if mechanism == "env":
        return None if knob == "chunk_size" else "process"
    if mechanism == "communicator":
        if knob in ("algorithm", "protocol") and v < (2, 24, 0):
            return None  # per-function NCCL_ALGO / NCCL_PROTO syntax is 2.24+: CTA bounds only before
        return None if knob == "chunk_size" else "communicator"
    # lagom's plugin implements ABI v3-v6; below v3 it does not load and pool entries set these
    abi = tuner_abi(v)
    if knob == "chunk_size":
        return "call" if abi >= 6 else None
    return "call" if abi >= 3 else "communicator"


def domains(
    *,
    cluster: ClusterSpec,
    op: str,
    n_nodes: int = 1,
    group_size: int = 2,
    mechanism: str = "tuner",
    reduce_op: str | None = None,
) -> dict[str, tuple]:
    """Values the search scans per knob of one site (``(None,)`` = NCCL's); ValueError: an unknown mechanism."""
    scope = {k: knob_scope(k, mechanism=mechanism, nccl_version=cluster.nccl) for k in KNOB_ORDER}
    out: dict[str, tuple] = {k: (None,) for k in KNOB_ORDER}
    cap = max_channels(cluster)
    if scope["high_priority_stream"] is not None:
        out["high_priority_stream"] = HIGH_PRIORITY_DOMAIN
    if op in P2P_OPS:
        # no tuner for P2P: CTA bounds set its channels, a power of two (engine.p2p), so only those differ
        out["n_channels"] = tuple(c for c in P2P_CHANNEL_GRID if c <= cap)
        if scope["net_peer_channels"] is not None and cluster.nccl_nodes(n_nodes, group_size) > 1:
            out["net_peer_channels"] = (None,) + NET_PEER_CHANNELS
        return out
    out["n_channels"] = tuple(c for c in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64) if c <= cap)
    if scope["chunk_size"] is not None:
        out["chunk_size"] = (None,) + chunk_domain(None)
    out["n_threads"] = N_THREADS
    if mechanism == "env":
        return out  # a process-wide algorithm or protocol would hit every op: never searched
    algs = algorithms_for(
        op=op,
        cluster=cluster,
        n_nodes=cluster.nccl_nodes(n_nodes, group_size),
        group_size=group_size,
        reduce_op=reduce_op,
    )
    if scope["algorithm"] is not None and algs:
        out["algorithm"] = algs
    protos = (
        ("LL", "LL128", "Simple")
        if ll128_enabled(cluster, n_nodes=cluster.nccl_nodes(n_nodes, group_size), group_size=group_size)
        else ("LL", "Simple")
    )
    if mechanism != "tuner":
        protos = tuple(p for p in protos if p != "LL128")
    if scope["protocol"] is not None:
        out["protocol"] = protos
    return out


def applicable(config: CommConfig, *, op: str) -> CommConfig:
    """``config`` less knobs NCCL ignores for ``op`` (P2P: ``NCCL_MAX_NTHREADS``, v2.30.7 ``src/enqueue.cc:1136``)."""
    if op in P2P_OPS:
        return CommConfig(
            n_channels=config.n_channels,
            net_peer_channels=config.net_peer_channels,
            high_priority_stream=config.high_priority_stream,
        )
    if config.net_peer_channels is not None:
        config = CommConfig(**{**config.to_dict(), "net_peer_channels": None})
    if config.algorithm is not None and config.algorithm not in ALGORITHMS_FOR_OP.get(op, ()):
        return CommConfig(**{**config.to_dict(), "algorithm": None})
    return config


def probe_configs(cluster: ClusterSpec, *, mechanism: str = "tuner") -> list[CommConfig]:
    """Configs the warm-up applies to every site at once, one per probe iteration, spanning what the cost model fits."""
    cap = max_channels(cluster)
    probes = [
        CommConfig(n_channels=2),
        CommConfig(n_channels=8),
        CommConfig(protocol="Simple", n_channels=min(16, cap)),
    ]
    if cluster.nccl >= (2, 30, 0):
        probes.append(CommConfig(protocol="Simple", n_channels=4, chunk_size=131072))
    if knob_scope("high_priority_stream", mechanism=mechanism, nccl_version=cluster.nccl) is not None:
        probes.append(CommConfig(high_priority_stream=True))
    return probes


def symmetric_kernels(cluster: ClusterSpec, site: Any) -> bool:
    """Whether NCCL runs ``site`` (symmetric windows) on symmetric kernels, which ask no tuner: all-NVLink and 2.28+
    (``ncclMakeSymmetricTaskList``, v2.28.9 ``src/enqueue.cc:360-362``, ``src/scheduler/symmetric_sched.cc:26-35``;
    v2.30.7 ``symmetric_sched.cc:66-215``, ``src/sym_kernels.cc:591-597``), or 2.27 with one collective (v2.27.7
    ``src/enqueue.cc:338-360``)."""
    return symmetric_kernel_problem(cluster, site) is None  # the reasons, and ncclSymkImplemented's ops: there


def process_env(chosen: dict[str, list[int]]) -> dict[str, str]:
    """NCCL's launch env for a plan's process-scope knobs (``chosen``: knob -> values; the largest wins); both CTA ends
    (NCCL PR 2256); ``NCCL_NCHANNELS_PER_NET_PEER`` overrides every communicator (v2.30.7 ``src/init.cc:2038-2047``)."""
    env: dict[str, str] = {}
    if chosen.get("n_threads") and set(chosen["n_threads"]) != {512}:
        env["NCCL_NTHREADS"] = str(max(chosen["n_threads"]))
    if chosen.get("n_channels"):
        env["NCCL_MIN_CTAS"], env["NCCL_MAX_CTAS"] = "1", str(max(chosen["n_channels"]))
    if chosen.get("net_peer_channels"):
        env["NCCL_NCHANNELS_PER_NET_PEER"] = str(max(chosen["net_peer_channels"]))
    return env


def tuner_call_key(*, group: str, op: str, nbytes: int) -> tuple[str, str, int]:
    """What NCCL's tuner tells calls apart by (``getCollInfo``, v2.30.7 ``src/include/tuner.h``): one row per key."""
    return (group, op, int(nbytes))


@dataclass(frozen=True)
class NcclRules:
    """``KnobRules`` of one mechanism on one NCCL cluster; ValueError: a gloo cluster, unknown mechanism or backend."""

    cluster: ClusterSpec
    mechanism: str = None  # type: ignore[assignment]  # None: default_mechanism(cluster), set in __post_init__
    backend: str = "nccl"
    capabilities: Capabilities | None = None
    """The agreed capabilities of a live run (domains are cut to them); None = what the cluster spec promises."""
    pool_budget_bytes: int | None = None
    """Pool memory budget per rank (``--lagom-pool-budget-mib``); None = unbounded. Caps channels (``nccl.budget``)."""
    nvls_heads: int = 0
    budget_groups: tuple[str, ...] = ()
    """Groups sharing the budget equally (set by ``for_sites``); empty = the whole budget per group."""

    def __post_init__(self) -> None:
        if self.cluster.backend != "nccl":
            raise ValueError(
                f"cluster {self.cluster.name!r} is a {self.cluster.backend} cluster; NCCL rules need an NCCL cluster"
            )
        if self.mechanism is None:
            object.__setattr__(self, "mechanism", default_mechanism(self.cluster))
        if self.mechanism not in MECHANISMS:
            raise ValueError(
                f"mechanism for backend {self.backend!r} must be one of {list(MECHANISMS)}; got {self.mechanism!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"NCCL rules serve backends {list(BACKENDS)}; got {self.backend!r}")

    def scope(self, knob: str) -> Scope | None:
        """``knob_scope``; ``net_peer_channels`` per communicator where torch binds ``n_channels_per_net_peer``."""
        scope = knob_scope(knob, mechanism=self.mechanism, nccl_version=self.cluster.nccl)
        if (
            knob == "net_peer_channels"
            and scope is not None
            and self.mechanism != "env"
            and self.capabilities is not None
            and self.cluster.nccl >= (2, 28, 0)
            and "n_channels_per_net_peer" in self.capabilities.config_fields
        ):
            return "communicator"
        return scope

    def domains(
        self, *, op: str, n_nodes: int = 1, group_size: int = 2, reduce_op: str | None = None
    ) -> dict[str, tuple]:
        """``domains`` of one site (``n_nodes``: hosts), cut to the run's capabilities and ``channel_cap``."""
        d = domains(
            cluster=self.cluster,
            op=op,
            n_nodes=n_nodes,
            group_size=group_size,
            mechanism=self.mechanism,
            reduce_op=reduce_op,
        )
        if self.capabilities is not None:
            d, _ = restrict_domains(
                d,
                self.capabilities,
                op=op,
                n_nodes=self.cluster.nccl_nodes(n_nodes, group_size),
                mechanism=self.mechanism,
            )
            if self.scope("net_peer_channels") != "communicator":
                d["net_peer_channels"] = (None,)  # a process-wide value: read once, before any plan
        cap = self.channel_cap()
        if cap is not None and d["n_channels"] != (None,):
            d["n_channels"] = tuple(n for n in d["n_channels"] if n is None or n <= cap) or (None,)
        return d

    def site_domains(self, site: Any) -> tuple[dict[str, tuple], str]:
        """``domains`` of a ``CollectiveSite`` cut by its call and its buffer registration, and a note on each cut."""
        d = self.domains(op=site.op, n_nodes=site.n_nodes, group_size=site.group_size, reduce_op=site.reduce_op)
        notes = []
        d["algorithm"], why = call_algorithms(
            d["algorithm"], op=site.op, reduce_op=site.reduce_op, dtype=site.dtype, parts=site.parts
        )
        if why:
            notes.append(why)
        if site.registered == "fixed":
            d = {k: (None,) for k in d}
            notes.append(
                "registered buffers (--use-nccl-ub) that only the group's own communicator holds: kept there, "
                "NCCL's choice (a pool entry cannot register a memory pool megatron-core does not keep)"
            )
        elif site.registered == "symmetric" and symmetric_kernels(self.cluster, site):
            d = {k: (None,) for k in d}
            notes.append(
                "buffers in symmetric windows (--use-nccl-ub) on an all-NVLink communicator: NCCL runs its "
                "symmetric kernels, which ask no tuner plugin, so nothing a plan sets reaches the call: NCCL's choice"
            )
        elif site.registered in ("pool", "symmetric"):
            notes.append("registered buffers (--use-nccl-ub): its pool entry registers the same NCCL memory pool")
        bins = nccl_bins(site.parts, nbytes=site.nbytes, op=site.op)
        if len(bins) > 1 and self.mechanism == "tuner" and any(len(v) > 1 for v in d.values()):
            notes.append(f"{len(bins)} tuner rows, one per NCCL bin of its tensors ({', '.join(map(str, bins))} bytes)")
        return d, "; ".join(notes)

    def registration(self, site: Any) -> Registration | None:
        """``KnobRules.registration``: ``nccl.registration.registration`` under this mechanism and capabilities."""
        return registration_for(self.cluster, site, cta_scope=self.scope("cta_policy"), capabilities=self.capabilities)

    def channel_cap(self) -> int | None:
        """Largest channel count one group's pool entry may have under the budget; None = no cap."""
        if self.pool_budget_bytes is None or self.mechanism == "env":
            return None
        share = group_share(self.pool_budget_bytes, self.budget_groups)
        return channel_cap(share, nvls_heads=self.nvls_heads, limit=max_channels(self.cluster))

    def for_sites(self, sites: Any) -> NcclRules:
        """These rules for ``sites``: the budget is shared by groups with a site whose channels can be set."""
        if self.pool_budget_bytes is None:
            return self
        groups = sorted(
            {
                s.group
                for s in sites
                if len(
                    domains(
                        cluster=self.cluster,
                        op=s.op,
                        n_nodes=s.n_nodes,
                        group_size=s.group_size,
                        mechanism=self.mechanism,
                    )["n_channels"]
                )
                > 1
            }
        )
        return replace(self, budget_groups=tuple(groups))

    def call_keys(self, site: Any) -> list[tuple[str, str, int]]:
        """``call_key`` of each NCCL bin of ``site``'s call (``bins.nccl_bins``)."""
        out = []
        for nbytes in nccl_bins(site.parts, nbytes=site.nbytes, op=site.op):
            k = self.call_key(group=site.group, op=site.op, nbytes=nbytes)
            if k is not None:
                out.append(k)
        return out

    def call_key(self, *, group: str, op: str, nbytes: int) -> tuple[str, str, int] | None:
        """``(group, op, nbytes)``: what NCCL's tuner tells calls apart by (``getCollInfo``); None unless ``tuner``."""
        if self.mechanism != "tuner" or op in P2P_OPS:
            return None  # P2P has no table row: its sites are told apart by the entry they are routed to
        return tuner_call_key(group=group, op=op, nbytes=nbytes)

    def warnings(self) -> list[str]:
        """One line per knob a variable of the run fixes (so the search leaves it alone)."""
        if self.capabilities is None:
            return []
        return [fixed_knob_warning(k, v) for k, v in sorted(self.capabilities.fixed_knobs().items())]

    def probe_configs(self) -> list[CommConfig]:
        """``probe_configs``, live: only what a per-communicator entry applies (nothing fixed, no chunk size)."""
        probes = probe_configs(self.cluster, mechanism=self.mechanism)
        if self.capabilities is None:
            return probes
        fixed = self.capabilities.fixed_knobs()
        out: list[CommConfig] = []
        for p in probes:
            d = {
                k: v
                for k, v in p.to_dict().items()
                if k not in fixed
                and k != "chunk_size"
                and not (k in ("algorithm", "protocol") and self.cluster.nccl < (2, 24, 0))
            }
            c = CommConfig(**d)
            if not c.is_default() and c not in out:
                out.append(c)
        return out

    def applicable(self, config: CommConfig, *, op: str) -> CommConfig:
        """``applicable``: what of ``config`` NCCL honours for ``op``."""
        return applicable(config, op=op)

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
        """``validate_config`` under this mechanism, also refusing knobs the capabilities empty; ValueError."""
        validate_config(
            config,
            op=op,
            cluster=self.cluster,
            mechanism=self.mechanism,
            n_nodes=n_nodes,
            group_size=group_size,
            reduce_op=reduce_op,
            dtype=dtype,
        )
        if config.cta_policy == "ZERO":
            why = copy_engine_problem(
                self.cluster,
                op=op,
                n_nodes=n_nodes,
                group_size=group_size,
                cta_scope=self.scope("cta_policy"),
                capabilities=self.capabilities,
            )
            if why:
                raise invalid_value("cta_policy", "ZERO", [None, "DEFAULT", "EFFICIENCY"], why)
        if self.capabilities is not None:
            d = self.domains(op=op, n_nodes=n_nodes, group_size=group_size or 2, reduce_op=reduce_op)
            for knob, value in config.to_dict().items():
                if knob == "cta_policy" and value == "ZERO":
                    continue  # copy engines: allowed above
                if knob in d and (d[knob] == (None,) or (knob == "algorithm" and value not in d[knob])):
                    raise invalid_value(
                        knob,
                        value,
                        list(d[knob]),
                        f"not applicable under mechanism {self.mechanism} with this run's capabilities",
                    )

    def process_env(self, chosen: dict[str, list[int]]) -> dict[str, str]:
        """``process_env``: NCCL's variables for the process-scope knobs of a plan."""
        return process_env(chosen)
