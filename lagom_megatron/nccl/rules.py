"""Which knob NCCL lets lagom set, at which scope, with which values: the search domain on NCCL.

Three mechanisms apply a plan on stock NCCL (docs/nccl.md; research notes, NCCL
mechanisms):

* ``tuner``: lagom's tuner plugin sets algorithm, protocol and channels per call (plugin ABI v3,
  NCCL 2.22+) and chunk size per call (ABI v6, NCCL 2.30+), ``ncclConfig_t`` sets the
  communicator-scope extras (CTA policy, CGA cluster size), the launch environment the rest;
* ``communicator``: no plugin; ``ncclConfig_t`` min/max CTAs per communicator, and
  ``NCCL_ALGO`` / ``NCCL_PROTO`` set just before a communicator-pool entry is created;
* ``env``: the process environment only (one value per job).

``NcclRules`` is the ``engine.knobs.KnobRules`` of one mechanism on one cluster: the engine
searches only what it returns, so a plan never holds a knob the mechanism cannot apply. The
simulated cluster (``lagom_megatron.sim``) models NCCL and uses the same rules.

Value checks live in ``nccl.validate`` and the per-call algorithm rules in ``nccl.algorithms``;
both are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import (
    ALGORITHMS_FOR_OP, KNOB_ORDER, N_THREADS, NET_PEER_CHANNELS, P2P_OPS, CommConfig, Scope, chunk_domain,
    invalid_value, max_channels,
)
from lagom_megatron.nccl.algorithms import algorithms_for, call_algorithms
from lagom_megatron.nccl.bins import nccl_bins
from lagom_megatron.nccl.budget import channel_cap, group_share
from lagom_megatron.nccl.capabilities import Capabilities, fixed_knob_warning, restrict_domains
from lagom_megatron.nccl.tuner_abi import (  # noqa: F401 (public here too)
    LAGOM_TUNER_ABI_MIN, TUNER_ABI_SINCE, check_mechanism, default_mechanism, tuner_abi,
)
from lagom_megatron.nccl.validate import CHUNK_RULES, validate_config, validate_cta_range
from lagom_megatron.nccl.paths import ll128_enabled

__all__ = ["BACKENDS", "CHUNK_RULES", "MECHANISMS", "NcclRules", "algorithms_for", "applicable", "domains", "knob_scope",
           "probe_configs", "process_env", "tuner_abi", "tuner_call_key", "validate_config", "validate_cta_range",
           "check_mechanism", "default_mechanism"]

MECHANISMS: tuple[str, ...] = ("tuner", "communicator", "env")
"""How a plan reaches NCCL (module docstring); ``tuner`` is the default."""

BACKENDS: tuple[str, ...] = ("nccl", "sim")
"""Profile / plan labels these rules serve: real NCCL, and the simulated cluster that models it."""


HIGH_PRIORITY_DOMAIN: tuple = (None, True)
"""Stream priorities a site's communicator may take: its group's own (None) or a high-priority pool
entry (``True``); a low priority is never chosen (it can only delay the collective)."""

P2P_CHANNEL_GRID: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
"""CTA bounds the search tries for a point-to-point site: ``p2pnChannels`` is the bound rounded up to a
power of two (NVIDIA/nccl v2.30.7 ``src/graph/paths.cc:977-991``), so other bounds add nothing."""

def knob_scope(knob: str, *, mechanism: str = "tuner", nccl_version: tuple[int, int, int] = (2, 27, 5)) -> Scope | None:
    """The widest unit a knob can differ over, or None when the mechanism cannot set it at all.

    ``call``: each collective site can have its own value; ``communicator``: one value per
    communicator (Megatron process group); ``process``: one value for the whole job.
    Sources: NCCL tuner plugin ABI v3-v6 (algorithm, protocol, nChannels per call from v3 /
    NCCL 2.22; chunk size per call from v6 / NCCL 2.30), ncclConfig_t fields (minCTAs/maxCTAs
    2.17, cgaClusterSize 2.17, CTAPolicy 2.27), NCCL_NTHREADS read once per process.

    Raises:
        ValueError: unknown knob or mechanism (names it and the allowed set).
    """
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
        # ProcessGroupNCCL.Options(is_high_priority_stream=...) of a pool entry: torch takes the NCCL
        # stream of each process group from its stream pool at that priority (initNCCLComm,
        # ``getStreamFromPool(options_->is_high_priority_stream || TORCH_NCCL_HIGH_PRIORITY)``);
        # any NCCL version. Not a variable: the env mechanism has no process groups to make.
        return None if mechanism == "env" else "communicator"
    if knob == "net_peer_channels":
        # NCCL_NCHANNELS_PER_NET_PEER (2.12+, a cached NCCL_PARAM: one value per process); the
        # ncclConfig_t field (2.28+) is per communicator only where torch binds it (NcclRules.scope)
        return None if v < (2, 12, 0) else "process"
    if mechanism == "env":
        return None if knob == "chunk_size" else "process"
    if mechanism == "communicator":
        if knob in ("algorithm", "protocol") and v < (2, 24, 0):
            return None  # per-function NCCL_ALGO / NCCL_PROTO syntax is 2.24+: CTA bounds only before
        return None if knob == "chunk_size" else "communicator"
    # tuner plugin (lagom's implements ABI v3-v6): per call from v3; chunk size from v6. Below
    # v3 the plugin does not load and the communicator pool sets these per communicator.
    abi = tuner_abi(v)
    if knob == "chunk_size":
        return "call" if abi >= 6 else None
    return "call" if abi >= 3 else "communicator"


def domains(*, cluster: ClusterSpec, op: str, n_nodes: int = 1, group_size: int = 2, mechanism: str = "tuner",
            reduce_op: str | None = None) -> dict[str, tuple]:
    """The values the search scans for each knob of one site (``(None,)`` = left to NCCL).

    These are subsets of what ``validate_config`` accepts, chosen so that a scan of each knob is
    short (the search cost is linear in the sum of domain sizes): channels on a roughly
    geometric grid up to the NCCL maximum, four chunk sizes (Simple's grid), all thread counts,
    protocols without LL128 where NCCL would not enable it (``ll128_enabled``), the op's algorithms.
    A knob whose scope is None under ``mechanism`` gets ``(None,)``.

    Raises:
        ValueError: unknown mechanism.
    """
    scope = {k: knob_scope(k, mechanism=mechanism, nccl_version=cluster.nccl) for k in KNOB_ORDER}
    out: dict[str, tuple] = {k: (None,) for k in KNOB_ORDER}
    cap = max_channels(cluster)
    if scope["high_priority_stream"] is not None:
        out["high_priority_stream"] = HIGH_PRIORITY_DOMAIN
    if op in P2P_OPS:
        # NCCL's tuner is never asked about point-to-point; the communicator's CTA bounds set its
        # P2P channels (a power of two, ``engine.p2p``), so only powers of two are distinct values;
        # across nodes also the channels per network peer
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
    algs = algorithms_for(op=op, cluster=cluster, n_nodes=cluster.nccl_nodes(n_nodes, group_size), group_size=group_size,
                          reduce_op=reduce_op)
    if scope["algorithm"] is not None and algs:
        out["algorithm"] = algs
    protos = ("LL", "LL128", "Simple") if ll128_enabled(cluster, n_nodes=cluster.nccl_nodes(n_nodes, group_size), group_size=group_size) else ("LL", "Simple")
    if mechanism != "tuner":
        protos = tuple(p for p in protos if p != "LL128")  # never force LL128 through NCCL_PROTO
    if scope["protocol"] is not None:
        out["protocol"] = protos
    return out


def applicable(config: CommConfig, *, op: str) -> CommConfig:
    """``config`` without the knobs that do not apply to ``op`` on NCCL (probe configs are applied
    to all sites at once). A send/recv or all-to-all site keeps only what NCCL's P2P path honours:
    the communicator's channel count and channels per network peer (``engine.p2p``); its kernel
    runs ``NCCL_MAX_NTHREADS`` whatever ``NCCL_NTHREADS`` says (NVIDIA/nccl v2.30.7
    ``src/enqueue.cc:1136``)."""
    if op in P2P_OPS:
        return CommConfig(n_channels=config.n_channels, net_peer_channels=config.net_peer_channels,
                          high_priority_stream=config.high_priority_stream)
    if config.net_peer_channels is not None:
        config = CommConfig(**{**config.to_dict(), "net_peer_channels": None})
    if config.algorithm is not None and config.algorithm not in ALGORITHMS_FOR_OP.get(op, ()):
        return CommConfig(**{**config.to_dict(), "algorithm": None})
    return config


def probe_configs(cluster: ClusterSpec, *, mechanism: str = "tuner") -> list[CommConfig]:
    """The few configs the warm-up applies to every site at once, one per probe iteration.

    Each probe gives every region one more measured point; together with the default iteration
    they span what the cost model fits: channel count (bandwidth growth and SM share), protocol
    (HBM traffic per wire byte), where settable chunk size, and, where a pool entry can set it, a
    high-priority stream at NCCL's own config (what the default iteration's collectives lose
    waiting for a running kernel's blocks, ``fit._dispatch_waits``). All are valid for every
    collective op (``applicable`` strips them for point-to-point sites).
    """
    cap = max_channels(cluster)
    probes = [CommConfig(n_channels=2), CommConfig(n_channels=8), CommConfig(protocol="Simple", n_channels=min(16, cap))]
    if cluster.nccl >= (2, 30, 0):
        probes.append(CommConfig(protocol="Simple", n_channels=4, chunk_size=131072))
    if knob_scope("high_priority_stream", mechanism=mechanism, nccl_version=cluster.nccl) is not None:
        probes.append(CommConfig(high_priority_stream=True))
    return probes


def symmetric_kernels(cluster: ClusterSpec, site: Any) -> bool:
    """Whether NCCL would run ``site`` (buffers in symmetric windows) on its symmetric kernels, which
    never ask the tuner plugin: an all-NVLink communicator (NVSwitch node, one NCCL node) and NCCL
    2.28+ for any call (``ncclMakeSymmetricTaskList``, NVIDIA/nccl v2.28.9 ``src/enqueue.cc:360-362``,
    ``src/scheduler/symmetric_sched.cc:26-35``; v2.30.7 ``symmetric_sched.cc:66-215``, where
    ``ncclSymkAvailable`` needs ``isAllDirectNvlink``, ``src/sym_kernels.cc:591-597``), NCCL 2.27 for a
    call of one collective (v2.27.7 ``src/enqueue.cc:338-360``: one task on one node)."""
    if cluster.intra_link != "nvlink" or not cluster.nvswitch or cluster.nccl_nodes(site.n_nodes, site.group_size) > 1:
        return False
    v = cluster.nccl
    return v >= (2, 28, 0) or (v >= (2, 27, 0) and len(site.parts) < 2)


def process_env(chosen: dict[str, list[int]]) -> dict[str, str]:
    """NCCL's launch environment for a plan's process-scope knobs (``chosen``: knob -> the values
    picked for the sites it governs; one process-wide value must serve them all).

    ``n_threads`` -> ``NCCL_NTHREADS`` = the largest picked, left unset when every site keeps
    NCCL's 512; ``n_channels`` (``env`` mechanism) -> ``NCCL_MIN_CTAS=1`` and ``NCCL_MAX_CTAS`` =
    the largest picked, both ends always set (NCCL PR 2256: a one-sided range fails);
    ``net_peer_channels`` -> ``NCCL_NCHANNELS_PER_NET_PEER`` (it overrides the ``ncclConfig_t``
    field of every communicator, NVIDIA/nccl v2.30.7 ``src/init.cc:2038-2047``).
    """
    env: dict[str, str] = {}
    if chosen.get("n_threads") and set(chosen["n_threads"]) != {512}:
        env["NCCL_NTHREADS"] = str(max(chosen["n_threads"]))
    if chosen.get("n_channels"):
        env["NCCL_MIN_CTAS"], env["NCCL_MAX_CTAS"] = "1", str(max(chosen["n_channels"]))
    if chosen.get("net_peer_channels"):
        env["NCCL_NCHANNELS_PER_NET_PEER"] = str(max(chosen["net_peer_channels"]))
    return env


def tuner_call_key(*, group: str, op: str, nbytes: int) -> tuple[str, str, int]:
    """What NCCL's tuner plugin can tell one collective call by: the communicator (a process group
    and its pool entries share the group's tag), the op and the byte count (``getCollInfo`` gets
    the function and ``nBytes``; NCCL v2.30.7 ``src/include/tuner.h``). Sites with the same key
    get one table row: ``SearchProblem.tie_indistinguishable`` gives them one decision
    (``NcclRules.call_key``) and ``export.tuner_rows`` refuses a plan that does not."""
    return (group, op, int(nbytes))


@dataclass(frozen=True)
class NcclRules:
    """``engine.knobs.KnobRules`` of one mechanism on one NCCL cluster (module docstring).

    Args:
        cluster: the ``ClusterSpec`` (its NCCL version, NVSwitch, SHARP and SM architecture decide
            the algorithms, the channel limit and the scopes).
        mechanism: ``tuner``, ``communicator`` or ``env``; None (default): :func:`default_mechanism`.
        backend: ``nccl`` (a real run) or ``sim`` (the simulated cluster), the label of the
            profiles and plans searched under these rules.
        capabilities: the run's agreed capabilities; its NCCL version must be the cluster's
            (``megatron.backends.rules_for`` sets both) and the domains are cut to what they allow
            (``capabilities.restrict_domains``).

    Raises:
        ValueError: a gloo cluster, an unknown mechanism or backend (names the value and the
            allowed set).
    """

    cluster: ClusterSpec
    mechanism: str = None  # type: ignore[assignment]  # None: default_mechanism(cluster), set in __post_init__
    backend: str = "nccl"
    capabilities: Capabilities | None = None
    """The agreed ``nccl.capabilities.Capabilities`` of a live run; None (offline search, the
    simulator) = what the cluster spec promises."""
    pool_budget_bytes: int | None = None
    """The pool's memory budget per rank (``--lagom-pool-budget-mib``); None = unbounded. Caps each
    group's channel domain at what its share allows (``nccl.budget``; not under ``env``)."""
    nvls_heads: int = 0
    """NVLS heads counted in an entry's estimate (ranks of an NVLink domain where NVLS runs)."""
    budget_groups: tuple[str, ...] = ()
    """Groups sharing the budget equally (set by ``for_sites``); empty = the whole budget per group."""

    def __post_init__(self) -> None:
        if self.cluster.backend != "nccl":
            raise ValueError(f"cluster {self.cluster.name!r} is a {self.cluster.backend} cluster; NCCL rules need an NCCL cluster")
        if self.mechanism is None:
            object.__setattr__(self, "mechanism", default_mechanism(self.cluster))
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism for backend {self.backend!r} must be one of {list(MECHANISMS)}; got {self.mechanism!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"NCCL rules serve backends {list(BACKENDS)}; got {self.backend!r}")

    def scope(self, knob: str) -> Scope | None:
        """``knob_scope`` under this mechanism and the cluster's NCCL version; ``net_peer_channels``
        is per communicator where the run's torch binds ``NCCLConfig.n_channels_per_net_peer`` on
        NCCL 2.28+ (agreed capabilities; no released torch we read does)."""
        scope = knob_scope(knob, mechanism=self.mechanism, nccl_version=self.cluster.nccl)
        if (knob == "net_peer_channels" and scope is not None and self.mechanism != "env" and self.capabilities is not None
                and self.cluster.nccl >= (2, 28, 0) and "n_channels_per_net_peer" in self.capabilities.config_fields):
            return "communicator"
        return scope

    def domains(self, *, op: str, n_nodes: int = 1, group_size: int = 2, reduce_op: str | None = None) -> dict[str, tuple]:
        """``domains`` of one site of ``op`` spanning ``n_nodes`` hosts and ``group_size``
        ranks, cut to the run's capabilities when there are any, channels cut to ``channel_cap``."""
        d = domains(cluster=self.cluster, op=op, n_nodes=n_nodes, group_size=group_size, mechanism=self.mechanism,
                    reduce_op=reduce_op)
        if self.capabilities is not None:
            d, _ = restrict_domains(d, self.capabilities, op=op, n_nodes=self.cluster.nccl_nodes(n_nodes, group_size),
                                    mechanism=self.mechanism)
            if self.scope("net_peer_channels") != "communicator":
                d["net_peer_channels"] = (None,)  # a process-wide value: read once, before any plan
        cap = self.channel_cap()
        if cap is not None and d["n_channels"] != (None,):
            d["n_channels"] = tuple(n for n in d["n_channels"] if n is None or n <= cap) or (None,)
        return d

    def site_domains(self, site: Any) -> tuple[dict[str, tuple], str]:
        """``domains`` of one ``CollectiveSite`` cut by its call (``algorithms.call_algorithms``: no
        NVLS for a reduction and dtype NCCL has none for), all knobs left to NCCL where its buffers
        are registered on the group's own communicator only (``registered = fixed``), and a note
        on each such cut, on a pool entry that registers the site's memory pool, and on a site that
        needs one tuner row per NCCL bin (``bins.nccl_bins``)."""
        d = self.domains(op=site.op, n_nodes=site.n_nodes, group_size=site.group_size, reduce_op=site.reduce_op)
        notes = []
        d["algorithm"], why = call_algorithms(d["algorithm"], op=site.op, reduce_op=site.reduce_op, dtype=site.dtype,
                                              parts=site.parts)
        if why:
            notes.append(why)
        if site.registered == "fixed":
            d = {k: (None,) for k in d}
            notes.append("registered buffers (--use-nccl-ub) that only the group's own communicator holds: kept there, "
                         "NCCL's choice (a pool entry cannot register a memory pool megatron-core does not keep)")
        elif site.registered == "symmetric" and symmetric_kernels(self.cluster, site):
            d = {k: (None,) for k in d}
            notes.append("buffers in symmetric windows (--use-nccl-ub) on an all-NVLink communicator: NCCL runs its "
                         "symmetric kernels, which ask no tuner plugin, so nothing a plan sets reaches the call: NCCL's choice")
        elif site.registered in ("pool", "symmetric"):
            notes.append("registered buffers (--use-nccl-ub): its pool entry registers the same NCCL memory pool")
        bins = nccl_bins(site.parts, nbytes=site.nbytes, op=site.op)
        if len(bins) > 1 and self.mechanism == "tuner" and any(len(v) > 1 for v in d.values()):
            notes.append(f"{len(bins)} tuner rows, one per NCCL bin of its tensors ({', '.join(map(str, bins))} bytes)")
        return d, "; ".join(notes)

    def channel_cap(self) -> int | None:
        """Largest channel count a pool entry of one group may have under the budget
        (``nccl.budget``: the equal share of ``budget_groups``); None = no cap (no budget, ``env``)."""
        if self.pool_budget_bytes is None or self.mechanism == "env":
            return None
        share = group_share(self.pool_budget_bytes, self.budget_groups)
        return channel_cap(share, nvls_heads=self.nvls_heads, limit=max_channels(self.cluster))

    def for_sites(self, sites: Any) -> "NcclRules":
        """These rules for a search over ``sites`` (``engine.profile.CollectiveSite``): the budget is
        shared by the groups with a site whose channel count the mechanism can set."""
        if self.pool_budget_bytes is None:
            return self
        groups = sorted({s.group for s in sites if len(domains(cluster=self.cluster, op=s.op, n_nodes=s.n_nodes,
                                                               group_size=s.group_size, mechanism=self.mechanism)
                                                       ["n_channels"]) > 1})
        return replace(self, budget_groups=tuple(groups))

    def call_keys(self, site: Any) -> list[tuple[str, str, int]]:
        """``call_key`` of each NCCL bin of ``site``'s call (``bins.nccl_bins``): sites sharing any
        key share the table rows of that key, so they get one decision."""
        out = []
        for nbytes in nccl_bins(site.parts, nbytes=site.nbytes, op=site.op):
            k = self.call_key(group=site.group, op=site.op, nbytes=nbytes)
            if k is not None:
                out.append(k)
        return out

    def call_key(self, *, group: str, op: str, nbytes: int) -> tuple[str, str, int] | None:
        """Which sites NCCL cannot tell apart under this mechanism (``SearchProblem.tie_indistinguishable``).

        With the tuner plugin every non-default site of a group runs on one pool entry, and NCCL
        hands the plugin only the collective and its byte count (``getCollInfo``), so sites of one
        (group, op, bytes) share a table row: key ``(group, op, nbytes)``. Communicator and env
        mechanisms give each distinct config its own communicator (or one value per job): None.
        """
        if self.mechanism != "tuner" or op in P2P_OPS:
            return None  # P2P has no table row: its sites are told apart by the entry they are routed to
        return tuner_call_key(group=group, op=op, nbytes=nbytes)

    def warnings(self) -> list[str]:
        """One line per knob a variable of the run fixes (so the search leaves it alone)."""
        if self.capabilities is None:
            return []
        return [fixed_knob_warning(k, v) for k, v in sorted(self.capabilities.fixed_knobs().items())]

    def probe_configs(self) -> list[CommConfig]:
        """``probe_configs`` of the cluster. In a live run (capabilities given) the probes run on
        per-communicator pool entries (no plan table exists yet), so they keep only what such an
        entry applies: no chunk size (no ``ncclConfig_t`` field), no protocol before NCCL 2.24
        (per-function ``NCCL_PROTO``), nothing a variable of the run fixes."""
        probes = probe_configs(self.cluster, mechanism=self.mechanism)
        if self.capabilities is None:
            return probes
        fixed = self.capabilities.fixed_knobs()
        out: list[CommConfig] = []
        for p in probes:
            d = {k: v for k, v in p.to_dict().items() if k not in fixed and k != "chunk_size"
                 and not (k in ("algorithm", "protocol") and self.cluster.nccl < (2, 24, 0))}
            c = CommConfig(**d)
            if not c.is_default() and c not in out:
                out.append(c)
        return out

    def applicable(self, config: CommConfig, *, op: str) -> CommConfig:
        """``applicable``: what of ``config`` NCCL honours for ``op``."""
        return applicable(config, op=op)

    def validate(self, config: CommConfig, *, op: str, n_nodes: int = 1, group_size: int | None = None,
                 reduce_op: str | None = None, dtype: str | None = None) -> None:
        """``validate_config`` under this mechanism on the cluster (with the call's reduction and
        dtype where known); with capabilities, also refuses a knob whose domain they empty (names
        the knob and why).

        Raises:
            ValueError: the first knob that cannot be applied.
        """
        validate_config(config, op=op, cluster=self.cluster, mechanism=self.mechanism, n_nodes=n_nodes, group_size=group_size,
                        reduce_op=reduce_op, dtype=dtype)
        if self.capabilities is not None:
            d = self.domains(op=op, n_nodes=n_nodes, group_size=group_size or 2, reduce_op=reduce_op)
            for knob, value in config.to_dict().items():
                if knob in d and (d[knob] == (None,) or (knob == "algorithm" and value not in d[knob])):
                    raise invalid_value(knob, value, list(d[knob]), f"not applicable under mechanism {self.mechanism} "
                                        f"with this run's capabilities")

    def process_env(self, chosen: dict[str, list[int]]) -> dict[str, str]:
        """``process_env``: NCCL's variables for the process-scope knobs of a plan."""
        return process_env(chosen)
