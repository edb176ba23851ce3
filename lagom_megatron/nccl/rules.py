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

Where NCCL itself clamps silently (``NCCL_NTHREADS=480`` -> 512), lagom refuses instead: a value
that NCCL would change behind our back makes the cost model's prediction wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import (
    ALGORITHMS, ALGORITHMS_FOR_OP, CGA_CLUSTER_SIZES, CTA_POLICIES, KNOB_ORDER, N_THREADS, P2P_OPS, PROTOCOLS,
    PROTOCOLS_FOR_ALGORITHM, CommConfig, Scope, chunk_domain, invalid_value, max_channels,
)
from lagom_megatron.nccl.budget import channel_cap, group_share
from lagom_megatron.nccl.capabilities import Capabilities, fixed_knob_warning, restrict_domains
from lagom_megatron.nccl.tuner_abi import (  # noqa: F401 (public here too)
    LAGOM_TUNER_ABI_MIN, TUNER_ABI_SINCE, check_mechanism, default_mechanism, tuner_abi,
)

MECHANISMS: tuple[str, ...] = ("tuner", "communicator", "env")
"""How a plan reaches NCCL (module docstring); ``tuner`` is the default."""

BACKENDS: tuple[str, ...] = ("nccl", "sim")
"""Profile / plan labels these rules serve: real NCCL, and the simulated cluster that models it."""

_ALGORITHM_SINCE: dict[str, tuple[int, int, int]] = {
    "Ring": (2, 0, 0), "Tree": (2, 4, 0), "NVLS": (2, 17, 0), "NVLSTree": (2, 18, 0),
    "CollNetDirect": (2, 14, 0), "CollNetChain": (2, 14, 0), "PAT": (2, 23, 0),
}
"""First NCCL release of each algorithm."""

CHUNK_RULES: dict[str, dict[str, int]] = {
    "Simple": {"min": 4096, "max": 524288, "multiple": 0},
    "LL": {"min": 1024, "max": 32768, "multiple": 0},
    "LL128": {"min": 3840, "max": 576000, "multiple": 120},
}
"""Chunk sizes NCCL can use per protocol, bytes. Simple and LL: powers of two up to one step of
the default buffer (NCCL_BUFFSIZE 4 MiB / NCCL_STEPS 8; LL buffer 512 KiB of 16-byte lines half of
which are flags, / 8 steps); LL128: multiples of 120 data bytes per 128-byte line up to one step
of its 4,915,200-byte buffer (x 120/128 / 8). NCCL clamps larger values to the buffer (tuner v6)."""


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


def algorithms_for(*, op: str, cluster: ClusterSpec, n_nodes: int = 1, group_size: int = 2) -> tuple[str, ...]:
    """Algorithms NCCL can run for ``op`` on ``cluster`` (empty for point-to-point ops).

    NVLS/NVLSTree need NVSwitch and sm90+ (NVLSTree only across nodes, NVLS across nodes only with
    CollNet); CollNet needs IB SHARP and more than one node; PAT needs one rank per node and is
    never offered for reduce-scatter (NCCL 2.30 ``src/enqueue.cc:2010-2012`` skips it when the
    reduction is AVG, and Megatron's gradient reduce-scatter averages when
    ``average_in_collective`` is set; sites do not record the reduction); each algorithm needs its
    first NCCL version.
    """
    if op not in ALGORITHMS_FOR_OP:
        return ()
    v = cluster.nccl
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
        if alg == "NVLS" and n_nodes > 1 and not cluster.collnet:
            continue  # NCCL disables NVLS across nodes without CollNet (2.30 src/enqueue.cc:2008)
        if alg.startswith("CollNet") and not (cluster.collnet and n_nodes > 1):
            continue
        if alg == "PAT" and group_size != n_nodes:
            continue
        if alg == "PAT" and op == "reduce_scatter":
            continue  # NCCL skips PAT for reduce-scatter with AVG (src/enqueue.cc:2010-2012); sites do not record the op
        out.append(alg)
    return tuple(out)


def domains(*, cluster: ClusterSpec, op: str, n_nodes: int = 1, group_size: int = 2, mechanism: str = "tuner") -> dict[str, tuple]:
    """The values the search scans for each knob of one site (``(None,)`` = left to NCCL).

    These are subsets of what ``validate_config`` accepts, chosen so that a scan of each knob is
    short (the search cost is linear in the sum of domain sizes): channels on a roughly
    geometric grid up to the NCCL maximum, four chunk sizes (Simple's grid), all thread counts,
    protocols without forcing LL128 where NCCL would not enable it, the op's algorithms.
    A knob whose scope is None under ``mechanism`` gets ``(None,)``.

    Raises:
        ValueError: unknown mechanism.
    """
    scope = {k: knob_scope(k, mechanism=mechanism, nccl_version=cluster.nccl) for k in KNOB_ORDER}
    out: dict[str, tuple] = {k: (None,) for k in KNOB_ORDER}
    if op in P2P_OPS:
        return out  # NCCL's tuner is not consulted for point-to-point; CTAs not capped (nccl#1598)
    cap = max_channels(cluster)
    out["n_channels"] = tuple(c for c in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64) if c <= cap)
    if scope["chunk_size"] is not None:
        out["chunk_size"] = (None,) + chunk_domain(None)
    out["n_threads"] = N_THREADS
    if mechanism == "env":
        return out  # a process-wide algorithm or protocol would hit every op: never searched
    algs = algorithms_for(op=op, cluster=cluster, n_nodes=n_nodes, group_size=group_size)
    if scope["algorithm"] is not None and algs:
        out["algorithm"] = algs
    protos = ("LL", "LL128", "Simple") if cluster.sm_arch >= 80 else ("LL", "Simple")
    if mechanism != "tuner":
        protos = tuple(p for p in protos if p != "LL128")  # never force LL128 through NCCL_PROTO
    if scope["protocol"] is not None:
        out["protocol"] = protos
    return out


def validate_config(config: CommConfig, *, op: str, cluster: ClusterSpec, mechanism: str = "tuner", n_nodes: int = 1,
                    group_size: int | None = None) -> None:
    """Checks every set knob of ``config`` against NCCL's documented domain for ``op`` on ``cluster``.

    Rules (research notes, ecosystem section 5): algorithm and protocol names as NCCL spells
    them, algorithm implemented for the op and the hardware, protocol run by the algorithm,
    LL128 never forced through the environment (silent corruption, nccl#786/#1261), n_threads
    in {64, 128, 256, 512}, 1 <= n_channels <= 64 (32 before NCCL 2.25), chunk size within the
    protocol's buffer step and granularity, CTA policy name, CGA cluster size 0..8 (sm90+).

    Raises:
        ValueError: the first offending knob, with its value and the allowed set.
    """
    mech = mechanism
    group_size = group_size or max(2, n_nodes * getattr(cluster, "gpus_per_node", 1))  # whole nodes
    c = config
    if c.algorithm is not None:
        if c.algorithm not in ALGORITHMS:
            raise invalid_value("algorithm", c.algorithm, list(ALGORITHMS), "unknown NCCL algorithm")
        if op not in ALGORITHMS_FOR_OP:
            raise invalid_value("algorithm", c.algorithm, [None], f"op {op!r} is point-to-point")
        if c.algorithm not in ALGORITHMS_FOR_OP[op]:
            raise invalid_value("algorithm", c.algorithm, list(ALGORITHMS_FOR_OP[op]), f"not implemented for {op}")
        ok = algorithms_for(op=op, cluster=cluster, n_nodes=n_nodes, group_size=group_size)
        if c.algorithm not in ok:
            raise invalid_value("algorithm", c.algorithm, list(ok),
                        f"not available on {cluster.name} (sm{cluster.sm_arch}, NCCL {cluster.nccl_version}, {n_nodes} node(s))")
    if c.protocol is not None:
        if c.protocol not in PROTOCOLS:
            raise invalid_value("protocol", c.protocol, list(PROTOCOLS), "unknown NCCL protocol")
        if op in P2P_OPS:
            raise invalid_value("protocol", c.protocol, [None], f"op {op!r} is point-to-point")
        if c.protocol == "LL128" and mech != "tuner":
            raise invalid_value("protocol", c.protocol, ["LL", "Simple"],
                        "forcing LL128 through NCCL_PROTO can corrupt data silently; only the tuner plugin may prefer it")
        if c.algorithm is not None and c.protocol not in PROTOCOLS_FOR_ALGORITHM[c.algorithm]:
            raise invalid_value("protocol", c.protocol, list(PROTOCOLS_FOR_ALGORITHM[c.algorithm]), f"with algorithm {c.algorithm}")
    if c.n_threads is not None and (isinstance(c.n_threads, bool) or c.n_threads not in N_THREADS):
        raise invalid_value("n_threads", c.n_threads, list(N_THREADS), "NCCL_NTHREADS")
    if c.n_channels is not None:
        cap = max_channels(cluster)
        if isinstance(c.n_channels, bool) or not isinstance(c.n_channels, int) or not 1 <= c.n_channels <= cap:
            raise invalid_value("n_channels", c.n_channels, f"integers 1..{cap} (NCCL {cluster.nccl_version})")
        if op in P2P_OPS and mech == "tuner":
            raise invalid_value("n_channels", c.n_channels, [None], f"the tuner plugin cannot cap {op} (nccl#1598)")
    if c.chunk_size is not None:
        if mech != "tuner" or cluster.nccl < (2, 30, 0):
            raise invalid_value("chunk_size", c.chunk_size, [None], f"per-call chunk size needs the tuner plugin v6 (NCCL >= 2.30); have NCCL {cluster.nccl_version}, mechanism {mech}")
        _check_chunk(c.chunk_size, c.protocol or "Simple")
    if c.cta_policy is not None and c.cta_policy not in CTA_POLICIES:
        raise invalid_value("cta_policy", c.cta_policy, list(CTA_POLICIES))
    if c.cga_cluster_size is not None:
        if isinstance(c.cga_cluster_size, bool) or c.cga_cluster_size not in CGA_CLUSTER_SIZES:
            raise invalid_value("cga_cluster_size", c.cga_cluster_size, "integers 0..8")
        if cluster.sm_arch < 90 and c.cga_cluster_size != 0:
            raise invalid_value("cga_cluster_size", c.cga_cluster_size, [0], f"thread-block clusters need sm90+; {cluster.name} is sm{cluster.sm_arch}")


def _check_chunk(chunk: int, protocol: str) -> None:
    rule = CHUNK_RULES[protocol]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not rule["min"] <= chunk <= rule["max"]:
        raise invalid_value("chunk_size", chunk, f"{rule['min']}..{rule['max']} bytes for protocol {protocol}")
    if rule["multiple"]:
        if chunk % rule["multiple"]:
            raise invalid_value("chunk_size", chunk, f"multiples of {rule['multiple']} bytes for protocol {protocol} (120 data bytes per 128-byte line)")
    elif chunk & (chunk - 1):
        raise invalid_value("chunk_size", chunk, f"powers of two for protocol {protocol}")


def validate_cta_range(min_ctas: int | None, max_ctas: int | None, *, cluster: ClusterSpec) -> None:
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
            raise invalid_value(name, value, f"integers 1..{cap} (NCCL {cluster.nccl_version})")
    if min_ctas > max_ctas:
        raise ValueError(f"min_ctas ({min_ctas}) must be <= max_ctas ({max_ctas})")


def applicable(config: CommConfig, *, op: str) -> CommConfig:
    """``config`` without the knobs that do not apply to ``op`` on NCCL (probe configs are applied
    to all sites at once; a send/recv site keeps only what NCCL's P2P path honours)."""
    if op in P2P_OPS:
        return CommConfig(n_threads=config.n_threads)
    if config.algorithm is not None and config.algorithm not in ALGORITHMS_FOR_OP.get(op, ()):
        return CommConfig(**{**config.to_dict(), "algorithm": None})
    return config


def probe_configs(cluster: ClusterSpec) -> list[CommConfig]:
    """The few configs the warm-up applies to every site at once, one per probe iteration.

    Each probe gives every region one more measured point; together with the default iteration
    they span what the cost model fits: channel count (bandwidth growth and SM share), protocol
    (HBM traffic per wire byte) and, where settable, chunk size. All are valid for every
    collective op (``applicable`` strips them for point-to-point sites).
    """
    cap = max_channels(cluster)
    probes = [CommConfig(n_channels=2), CommConfig(n_channels=8), CommConfig(protocol="Simple", n_channels=min(16, cap))]
    if cluster.nccl >= (2, 30, 0):
        probes.append(CommConfig(protocol="Simple", n_channels=4, chunk_size=131072))
    return probes


def process_env(chosen: dict[str, list[int]]) -> dict[str, str]:
    """NCCL's launch environment for a plan's process-scope knobs (``chosen``: knob -> the values
    picked for the sites it governs; one process-wide value must serve them all).

    ``n_threads`` -> ``NCCL_NTHREADS`` = the largest picked, left unset when every site keeps
    NCCL's 512; ``n_channels`` (``env`` mechanism) -> ``NCCL_MIN_CTAS=1`` and ``NCCL_MAX_CTAS`` =
    the largest picked, both ends always set (NCCL PR 2256: a one-sided range fails).
    """
    env: dict[str, str] = {}
    if chosen.get("n_threads") and set(chosen["n_threads"]) != {512}:
        env["NCCL_NTHREADS"] = str(max(chosen["n_threads"]))
    if chosen.get("n_channels"):
        env["NCCL_MIN_CTAS"], env["NCCL_MAX_CTAS"] = "1", str(max(chosen["n_channels"]))
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
        """``knob_scope`` under this mechanism and the cluster's NCCL version."""
        return knob_scope(knob, mechanism=self.mechanism, nccl_version=self.cluster.nccl)

    def domains(self, *, op: str, n_nodes: int = 1, group_size: int = 2) -> dict[str, tuple]:
        """``domains`` of one site of ``op`` spanning ``n_nodes`` nodes and ``group_size``
        ranks, cut to the run's capabilities when there are any, channels cut to ``channel_cap``."""
        d = domains(cluster=self.cluster, op=op, n_nodes=n_nodes, group_size=group_size, mechanism=self.mechanism)
        if self.capabilities is not None:
            d, _ = restrict_domains(d, self.capabilities, op=op, n_nodes=n_nodes, mechanism=self.mechanism)
        cap = self.channel_cap()
        if cap is not None and d["n_channels"] != (None,):
            d["n_channels"] = tuple(n for n in d["n_channels"] if n is None or n <= cap) or (None,)
        return d

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

    def call_key(self, *, group: str, op: str, nbytes: int) -> tuple[str, str, int] | None:
        """Which sites NCCL cannot tell apart under this mechanism (``SearchProblem.tie_indistinguishable``).

        With the tuner plugin every non-default site of a group runs on one pool entry, and NCCL
        hands the plugin only the collective and its byte count (``getCollInfo``), so sites of one
        (group, op, bytes) share a table row: key ``(group, op, nbytes)``. Communicator and env
        mechanisms give each distinct config its own communicator (or one value per job): None.
        """
        return tuner_call_key(group=group, op=op, nbytes=nbytes) if self.mechanism == "tuner" else None

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
        probes = probe_configs(self.cluster)
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

    def validate(self, config: CommConfig, *, op: str, n_nodes: int = 1, group_size: int | None = None) -> None:
        """``validate_config`` under this mechanism on the cluster; with capabilities, also refuses
        a knob whose domain they empty (names the knob and why).

        Raises:
            ValueError: the first knob that cannot be applied.
        """
        validate_config(config, op=op, cluster=self.cluster, mechanism=self.mechanism, n_nodes=n_nodes, group_size=group_size)
        if self.capabilities is not None:
            d = self.domains(op=op, n_nodes=n_nodes, group_size=group_size or 2)
            for knob, value in config.to_dict().items():
                if knob in d and (d[knob] == (None,) or (knob == "algorithm" and value not in d[knob])):
                    raise invalid_value(knob, value, list(d[knob]), f"not applicable under mechanism {self.mechanism} "
                                        f"with this run's capabilities")

    def process_env(self, chosen: dict[str, list[int]]) -> dict[str, str]:
        """``process_env``: NCCL's variables for the process-scope knobs of a plan."""
        return process_env(chosen)
