"""Device model of the simulated GPU cluster: how long compute and communication kernels take, alone
and when they share one GPU.

This is the simulator's hardware, and nothing here is visible to the engine: the search only
ever sees the timings the simulated backend reports (``lagom_megatron.sim.backend``). What NCCL
*chooses* to run (algorithm, protocol, channels, threads) is NCCL's own model
(``sim.channel_defaults`` over ``nccl.tuning_model``); how long it takes is this module's.

Compute kernels (GEMM, attention, element-wise, norm) are described by FLOPs, HBM bytes and the
SMs they can use. Their time follows a roofline with imperfect overlap of math and memory::

    t_math = flops / (peak_flops * eff_kind) * waves(sms_free) / waves(sms)   (SMs lost to comm CTAs)
    t_mem  = hbm_bytes / hbm_free_bw * (1 + kappa_mem * share)       (HBM lost to comm, queueing)
    t      = max(t_math, t_mem) + overlap_gamma * min(t_math, t_mem)

Communication kernels hold ``n_channels`` CTAs (one SM each; NCCL CTAs never share an SM with
compute, nccl#689) for their whole duration and move data at::

    bw = softmin(n_channels * cta_gbs(arch, algorithm, protocol, threads, chunk), link(path, protocol))

A CTA's rate when the link is not the limit (``cta_gbs``) is the fastest speed NCCL's search ever
gives one search channel, over the two CTAs NCCL runs per search channel, capped per protocol by
NCCL's per-channel tables (``sim.constants``: ``cta_gbs_sm80/86/90``; ``nccl.tuning_model``). The link
is NVLink in an NVSwitch node, PCIe (or PCIe in both directions around NVLink-bridged pairs), or
the network across nodes (``net_gbps_per_gpu`` times the group's ranks per node, since NCCL runs
one ring per NIC). Each wire byte costs ``HBM_MULT[op kind][protocol]`` bytes of HBM traffic
(NVLink bytes x2-3, nccl#1428), scaled by the chunk size (large chunks spill L2). When compute
and communication together ask for more HBM bandwidth than the device has, both get a
proportional share (the sharing rule).

Every constant is either NCCL's (``nccl.tuning_model``, file:line), a public figure (cited here), or
ranged in ``sim.constants`` with its reasoning (``lagom bench simulated --sensitivity``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.sim import channel_defaults as nccl
from lagom_megatron.nccl import tuning_model as nm
from lagom_megatron.sim.channel_defaults import cta_efficiency_applies  # noqa: F401  (part of this module's API)
from lagom_megatron.sim.constants import CONSTANTS, get

KIB = 1024
MIB = 1024 * 1024
SAT_P = CONSTANTS["sat_p"].value
"""The central saturation sharpness (``sat_p`` in ``sim.constants``; a cluster's ``bw_saturation_p`` wins)."""
THREAD_EXPONENT = CONSTANTS["threads_exp"].value
"""The central per-channel thread exponent (``threads_exp``; a cluster's ``channel_thread_exponent`` wins)."""

COMPUTE_EFF: dict[str, float] = {"gemm": 0.60, "attention": 0.45, "elementwise": 0.05, "norm": 0.05}
"""Achieved fraction of peak bf16 FLOP/s per kernel kind on Hopper. Large square GEMMs reach ~70% of
peak; transformer GEMMs and the small kernels this model leaves out (softmax, dropout, rotary,
bias) bring a GPT-3 175B iteration to Megatron-LM's reported "up to 47%" MFU on H100 (calibration
test). On Ampere (A100, A40) the GEMM value is the ranged ``gemm_eff_ampere``."""
HBM_EFF = 0.85
"""Achievable fraction of the HBM datasheet bandwidth (STREAM-style copies reach 80-90%)."""

PROTOCOL_LINK_EFF: dict[int, float] = {90: 0.82, 80: 0.76}
"""Ring/Simple bus bandwidth as a fraction of the NVLink line rate (sm arch): H100 ~370 of 450 GB/s
(nccl-tests#212: "~20% protocol overhead"); A100 ~200-230 of 300 GB/s (nccl-tests#149, #178). LL128
runs at 0.92 of it and LL at 0.5 (NCCL's own factors, tuning.cc:327-329)."""
NET_EFF: dict[str, float] = {"Simple": 0.94, "LL128": 0.94 * nm.LL128_BUS_FACTOR, "LL": 0.94 * nm.LL_BUS_FACTOR}
"""Fraction of a NIC's line rate: 46-48 GB/s per 400 Gb/s NIC (nccl-tests#290); LL128 and LL by
NCCL's factors."""
NVLS_BUSBW_FACTOR = 1.07
"""NVLS all-reduce bus bandwidth / NVLink line rate: ~480 GB/s busbw on 8xH100 (nccl-tests#212)."""
HBM_MULT: dict[str, dict[str, float]] = {
    "reduce": {"Simple": 3.0, "LL128": 3.2, "LL": 4.0},
    "copy": {"Simple": 2.0, "LL128": 2.2, "LL": 3.0},
}
"""HBM bytes per wire byte: reductions read two operands and write one; copies read and write
(NVLink bytes "multiplied by at least 2x ... can be 3x", nccl#1428); LL128 and LL also write and
poll their flags (8 of 128 and 8 of 16 bytes). NVLS: ``nvls_hbm_mult`` (ranged)."""
BUSBW_FACTOR_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    """One GPU of a cluster, in the simulator's units (GB/s, TFLOP/s)."""

    sms: int
    hbm_gbs: float
    peak_tflops: float
    nvlink_gbs: float
    """Intra-node link per direction, per GPU: NVLink to the NVSwitch, or the PCIe link."""
    net_gbs: float
    """Network line rate per GPU (the node's NICs shared by its GPUs), GB/s."""
    gpus_per_node: int
    sm_arch: int
    nvswitch: bool
    nvlink_latency_us: float
    net_latency_us: float
    max_channels: int
    intra_link: str = "nvlink"
    """nvlink or pcie (``ClusterSpec.intra_link``): decides NCCL's paths and default channels."""
    bridge_gbs: float = 0.0
    """NVLink bridge per direction between GPU pairs on a PCIe node, GB/s (0 = none)."""
    nics_per_node: int | None = None
    """NICs per node; None = one per GPU."""
    nccl: tuple[int, int, int] = (2, 30, 7)
    """NCCL version (``ClusterSpec.nccl``): its point-to-point rule changed in 2.29 (``engine.p2p``)."""
    kappa_mem: float | None = None
    kappa_compute: float | None = None
    """Contention constants a cluster file fitted (``lagom calibrate contention``); None = the
    simulator's (``sim.constants``)."""
    per_channel: Mapping[str, float] = field(default_factory=dict)
    """Measured GB/s per channel by protocol (``ClusterSpec.per_channel_gbps``, ``lagom calibrate
    bandwidth``); a protocol left out keeps the simulator's (``cta_gbs``)."""
    link_eff: Mapping[str, float] = field(default_factory=dict)
    """Measured intra-node ceiling over ``nvlink_gbps`` by protocol (``ClusterSpec.link_eff``)."""
    net_eff: Mapping[str, float] = field(default_factory=dict)
    """Measured share of the network by protocol (``ClusterSpec.net_eff``); else ``NET_EFF``."""
    fit_sat_p: float | None = None
    """Measured saturation sharpness (``ClusterSpec.bw_saturation_p``); None = ``sat_p`` (``sim.constants``)."""
    fit_thread_exponent: float | None = None
    """Measured per-channel thread scaling (``ClusterSpec.channel_thread_exponent``); None = ``threads_exp``."""

    @classmethod
    def from_cluster(cls, spec: Any) -> "Gpu":
        """Builds the device from a ``ClusterSpec`` (configs/clusters/*.yaml)."""
        major, minor = (int(x) for x in str(spec.nccl_version).split(".")[:2])

        def opt(key: str) -> float | None:
            v = getattr(spec, key, None)
            return None if v is None else float(v)

        return cls(
            sms=int(spec.sms_per_gpu), hbm_gbs=float(spec.hbm_gbps), peak_tflops=float(spec.peak_bf16_tflops),
            nvlink_gbs=float(spec.nvlink_gbps_per_gpu), net_gbs=float(spec.net_gbps_per_gpu),
            gpus_per_node=int(spec.gpus_per_node), sm_arch=int(spec.sm_arch), nvswitch=bool(spec.nvswitch),
            nvlink_latency_us=float(getattr(spec, "nvlink_latency_us", 1.0)),
            net_latency_us=float(getattr(spec, "net_latency_us", 5.0)),
            max_channels=64 if (major, minor) >= (2, 25) else 32,
            intra_link=str(getattr(spec, "intra_link", "nvlink")),
            bridge_gbs=float(getattr(spec, "nvlink_bridge_gbps", None) or 0.0),
            nics_per_node=getattr(spec, "nics_per_node", None), nccl=tuple(spec.nccl),
            kappa_mem=opt("kappa_mem"), kappa_compute=opt("kappa_compute"),
            per_channel=dict(getattr(spec, "per_channel_gbps", None) or {}),
            link_eff=dict(getattr(spec, "link_eff", None) or {}), net_eff=dict(getattr(spec, "net_eff", None) or {}),
            fit_sat_p=opt("bw_saturation_p"), fit_thread_exponent=opt("channel_thread_exponent"),
        )

    @property
    def arch_key(self) -> int:
        """90 (Hopper and later), 86 (GA102: A40, A6000) or 80 (A100)."""
        return 90 if self.sm_arch >= 90 else (86 if self.sm_arch == 86 else 80)

    @property
    def table_key(self) -> int:
        """The row of NCCL's per-architecture tables: 90, or 80 for every Ampere part (tuning.cc:263-266)."""
        return 90 if self.sm_arch >= 90 else 80

    @property
    def sat_p(self) -> float:
        """The saturation sharpness in force: the cluster's measured one, else ``sat_p``."""
        return get("sat_p") if self.fit_sat_p is None else self.fit_sat_p

    @property
    def thread_exponent(self) -> float:
        """The per-channel thread exponent in force: the cluster's measured one, else ``threads_exp``."""
        return get("threads_exp") if self.fit_thread_exponent is None else self.fit_thread_exponent

    def kappa(self, name: str) -> float:
        """``kappa_mem`` / ``kappa_compute``: the cluster's fitted value, else the simulator's."""
        v = getattr(self, name)
        return get(name) if v is None else v


# ---------------------------------------------------------------------------------------- compute


@dataclass(frozen=True, slots=True)
class ComputeKernel:
    """A compute kernel: ``flops`` (FLOP), ``hbm_bytes`` (bytes), ``kind`` (gemm, attention,
    elementwise, norm), ``max_sms`` (None = all SMs of the device), ``tiles`` (CTAs of one launch,
    0 = so many that waves do not matter), ``persistent`` (a persistent kernel launches one CTA
    per SM and loops over tiles: when SMs are taken, the CTAs that find no SM run after the others,
    pytorch#143988)."""

    name: str
    kind: str
    flops: float
    hbm_bytes: float
    max_sms: int | None = None
    tiles: int = 0
    persistent: bool = False


def wave_factor(sms: int, sms_free: float, k: "ComputeKernel") -> float:
    """Math-time factor of ``k`` on ``sms_free`` of ``sms`` SMs relative to all of them.

    Tiles run in waves of one CTA per free SM: ``ceil(tiles / free) / ceil(tiles / sms)`` (a GEMM of
    exactly one wave slows 2x when one SM is taken); a persistent kernel's ``sms`` CTAs take
    ``ceil(sms / free)`` rounds (2x at 10% of the SMs taken, pytorch#143988); without tiles the
    factor is ``sms / free`` (linear in free SMs).
    """
    free = max(1, int(math.floor(sms_free + 1e-9)))
    if free >= sms:
        return 1.0
    if k.persistent:
        return float(math.ceil(sms / free))
    if k.tiles > 0:
        return math.ceil(k.tiles / free) / math.ceil(k.tiles / sms)
    return sms / max(1.0, sms_free)


def compute_time_us(gpu: Gpu, k: ComputeKernel, *, sms_free: float | None = None, hbm_gbs: float | None = None,
                    comm_hbm_share: float = 0.0) -> float:
    """Duration in microseconds of ``k`` given the SMs and HBM bandwidth (GB/s) left to it and the
    fraction of HBM bandwidth concurrent collectives draw (``kappa_compute`` on math,
    ``kappa_mem`` on memory time, ``sim.constants``); SMs count in waves (``wave_factor``)."""
    sms = gpu.sms if sms_free is None else max(1.0, sms_free)
    full = gpu.sms
    if k.max_sms is not None:
        sms, full = min(sms, k.max_sms), min(full, k.max_sms)
    bw = gpu.hbm_gbs * HBM_EFF if hbm_gbs is None else max(1.0, hbm_gbs)
    eff = get("gemm_eff_ampere") if (k.kind == "gemm" and gpu.sm_arch < 90) else COMPUTE_EFF[k.kind]
    t_math = (k.flops / (gpu.peak_tflops * 1e6 * eff * full / gpu.sms) * wave_factor(full, sms, k)
              * (1.0 + gpu.kappa("kappa_compute") * comm_hbm_share))
    t_mem = k.hbm_bytes / (bw * 1e3) * (1.0 + gpu.kappa("kappa_mem") * comm_hbm_share)
    return max(t_math, t_mem) + get("overlap_gamma") * min(t_math, t_mem) + 1.0


def hbm_demand_gbs(gpu: Gpu, k: ComputeKernel, *, sms_free: float | None = None) -> float:
    """HBM bandwidth (GB/s) the kernel draws when it runs unhindered on ``sms_free`` SMs."""
    return k.hbm_bytes / (compute_time_us(gpu, k, sms_free=sms_free) * 1e3)


# ---------------------------------------------------------------------------------- communication


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective call as the device sees it: op, full message bytes, group shape."""

    op: str
    nbytes: int
    group_size: int
    n_nodes: int = 1
    stride: int = 1
    """Rank stride of the group (1 = consecutive GPUs): on NVLink-bridged nodes it decides which hops
    are bridges (``channel_defaults.path``)."""
    registered: bool = False
    """Buffers registered with NCCL (user buffers); Megatron-Core does so only with NCCL UB on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    """A ``CommConfig`` with every knob decided (what NCCL would actually run)."""

    algorithm: str
    protocol: str
    n_channels: int
    n_threads: int
    chunk_size: int


DEFAULT_CHUNK = {"Simple": 512 * KIB, "LL128": 576000, "LL": 32 * KIB}
"""NCCL's chunk per protocol with default buffers (4 MiB Simple buffer over NCCL_STEPS 8, init.cc:813)."""


def resolve_config(gpu: Gpu, c: Collective, cfg: CommConfig) -> Resolved:
    """What NCCL runs for ``c`` under ``cfg``: requested knobs where NCCL honours them, its own
    choice (``sim.channel_defaults``: NCCL's model) elsewhere. An algorithm or protocol NCCL cannot
    run for the op is ignored (NCCL keeps its own choice when a tuner proposes an unavailable one);
    LL128 where NCCL does not enable it is ignored too (tuning.cc:518-535 zeroes its bandwidth, so
    NCCL never picks it)."""
    algs = nccl.algorithms(gpu, c)
    if algs == ("P2P",):
        alg = "P2P"
    elif cfg.algorithm in algs:
        alg = cfg.algorithm
    else:
        alg = nccl.default_algorithm(gpu, c, algs)
    if cfg.protocol in ("LL", "Simple") or (cfg.protocol == "LL128" and nccl.ll128_allowed(gpu, c)):
        proto = "Simple" if alg in ("NVLS", "P2P") else cfg.protocol
    else:
        proto = nccl.default_protocol(gpu, c, alg)
    nt = cfg.n_threads
    threads = nt if (nt and nt % 32 == 0 and 64 <= nt <= nm.MAX_THREADS[proto] and proto != "LL128") else None
    chunk = cfg.chunk_size if cfg.chunk_size and proto == "Simple" else DEFAULT_CHUNK[proto]
    if alg == "P2P":
        channels = nccl.p2p_channels(gpu, c, cta_bound=cfg.n_channels, net_peer=cfg.net_peer_channels)
        threads = threads or nm.MAX_THREADS["Simple"]  # as channel_defaults.default_channels for P2P
    elif cfg.n_channels is not None:
        channels = int(min(max(1, cfg.n_channels), gpu.max_channels))
        threads = threads or nm.default_threads(proto, alg, ring_busbw_gbs=nccl.collective_ctas(gpu, c, alg)[1])
    elif cfg.cta_policy == "EFFICIENCY" and nccl.cta_efficiency_applies(gpu, c):
        alg, proto = "NVLS", "Simple"
        channels, threads = nccl.default_channels(gpu, c, "NVLS", "Simple", threads)
    elif cfg.is_default() and nccl.ub_ctas(gpu, c) is not None:
        alg, proto, channels, threads = "SYMK", "Simple", nccl.ub_ctas(gpu, c), 512
    else:
        channels, threads = nccl.default_channels(gpu, c, alg, proto, threads)
    return Resolved(algorithm=alg, protocol=proto, n_channels=channels, n_threads=threads, chunk_size=chunk)


def cta_gbs(gpu: Gpu, algorithm: str, protocol: str, n_threads: int, chunk: int, n_nodes: int = 1) -> float:
    """GB/s one CTA moves when the link is not the limit (module docstring).

    Simple: ``cta_gbs_sm80/86/90`` (a cluster's measured ``per_channel_gbps`` wins, per protocol) at the protocol's
    most threads (512; LL128 640, device.h:95-114), scaled as ``(threads / most)^threads_exp``; LL128 at most 0.92
    of it and NCCL's per-channel cap over the two CTAs of a search channel (tuning.cc:328-329,
    185-190); LL half of it (tuning.cc:327); Tree NCCL's per-channel Tree caps the same way
    (tuning.cc:330-335). A chunk below
    NCCL's default costs per-step overhead (half rate at 64 KiB; no source, a shape assumption)."""
    simple = gpu.per_channel.get("Simple") or get(f"cta_gbs_sm{gpu.arch_key}")
    arch = gpu.table_key
    idx = 0 if n_nodes == 1 else (1 if n_nodes == 2 else 2)
    if algorithm == "Tree":
        base = min(simple, nm.PER_CH_MAX_TREE[arch][idx] / 2.0)
        if protocol == "LL128":
            base = min(base, nm.PER_CH_MAX_TREE_LL128[arch][idx] / 2.0)
    else:
        base = simple
        if protocol == "LL128":
            base = min(simple * nm.LL128_BUS_FACTOR, nm.PER_CH_MAX_RING_LL128[arch] / 2.0)
    if protocol == "LL":
        base = simple * nm.LL_BUS_FACTOR
    if algorithm != "Tree" and gpu.per_channel.get(protocol):
        base = gpu.per_channel[protocol]  # measured on this cluster (``lagom calibrate bandwidth``)
    threads = (min(n_threads, nm.MAX_THREADS[protocol]) / nm.MAX_THREADS[protocol]) ** gpu.thread_exponent
    ref = DEFAULT_CHUNK[protocol]
    step = (chunk / (chunk + 64 * KIB)) / (ref / (ref + 64 * KIB))
    return base * threads * step


def softmin(rate: float, link: float, p: float | None = None) -> float:
    """``(rate^-p + link^-p)^(-1/p)`` with ``p = sat_p`` (``sim.constants``): the soft bandwidth ceiling, GB/s."""
    p = get("sat_p") if p is None else p
    return (rate ** -p + link ** -p) ** (-1.0 / p)


def busbw_factor(op: str, n: int) -> float:
    """Wire bytes per rank / message bytes (nccl-tests PERFORMANCE.md: all-reduce 2(n-1)/n,
    all-gather / reduce-scatter / all-to-all (n-1)/n, send/recv and broadcast 1)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _proto_factor(protocol: str) -> float:
    return {"Simple": 1.0, "LL128": nm.LL128_BUS_FACTOR, "LL": nm.LL_BUS_FACTOR}[protocol]


def intra_link_gbs(gpu: Gpu, c: Collective, protocol: str) -> float:
    """Intra-node bus bandwidth ceiling of ``c``, GB/s: NVLink x its Ring/Simple efficiency
    (nccl-tests figures), a bridge the same, PCIe x ``pcie_link_eff``, twice that around bridged
    pairs (rings in both directions each use one direction of a GPU's PCIe); LL128 and LL at
    NCCL's factors. A cluster's measured ``link_eff`` (the ring's ceiling over ``nvlink_gbps`` per
    protocol, as nccl-tests measured it on that cluster) replaces all of this."""
    p = nccl.path(gpu, c)
    if gpu.link_eff.get(protocol) and p != "bridge":
        return gpu.nvlink_gbs * gpu.link_eff[protocol]
    if p == "nvswitch":
        return gpu.nvlink_gbs * PROTOCOL_LINK_EFF[gpu.table_key] * _proto_factor(protocol)
    if p == "bridge":
        return gpu.bridge_gbs * PROTOCOL_LINK_EFF[80] * _proto_factor(protocol)
    return (2.0 if p == "bridged" else 1.0) * gpu.nvlink_gbs * get("pcie_link_eff") * _proto_factor(protocol)


def _link_gbs(gpu: Gpu, c: Collective, algorithm: str, protocol: str) -> float:
    """Link-limited bus bandwidth, GB/s."""
    nvl = intra_link_gbs(gpu, c, protocol)
    if algorithm == "NVLS":
        # all-reduce: nccl-tests#212's ~480 GB/s; gathers and reduce-scatters: no public figure, the ring's
        nvl = gpu.nvlink_gbs * (NVLS_BUSBW_FACTOR if c.op == "all_reduce" else PROTOCOL_LINK_EFF[90])
    if c.n_nodes <= 1:
        return nvl
    per_node = max(1, c.group_size // c.n_nodes)
    net_eff = gpu.net_eff.get(protocol) or NET_EFF[protocol]
    net = gpu.net_gbs * net_eff * per_node
    if c.op in ("send", "recv", "all_to_all"):
        net = gpu.net_gbs * net_eff
    if algorithm == "Tree":
        net *= 0.92
    return min(nvl, net)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommCost:
    """A collective's standalone cost: latency (us), wire bytes per rank, bandwidth (GB/s), CTAs
    held and HBM bytes per wire byte."""

    latency_us: float
    wire_bytes: float
    bw_gbs: float
    ctas: int
    hbm_mult: float

    @property
    def t_alone_us(self) -> float:
        return self.latency_us + self.wire_bytes / (self.bw_gbs * 1e3)


def comm_cost(gpu: Gpu, c: Collective, r: Resolved) -> CommCost:
    """Standalone cost of ``c`` run as ``r`` (no compute beside it)."""
    wire = busbw_factor(c.op, c.group_size) * c.nbytes
    link = _link_gbs(gpu, c, r.algorithm, r.protocol)
    proto = r.protocol
    rate = r.n_channels * cta_gbs(gpu, r.algorithm, proto, r.n_threads, r.chunk_size, c.n_nodes)
    if r.algorithm == "SYMK":  # symmetric kernels on registered buffers: their CTAs fill the link (UB_CTAS)
        rate = 1.5 * link
    elif r.algorithm == "NVLS":
        # the switch reduces: NCCL's NVLS bandwidth per channel is its link speed x nvlsEfficiency,
        # twice for all-reduce, which pipelines two operations, else x (ranks - 1) / ranks
        # (tuning.cc:311-318)
        ppn = max(1, c.group_size // max(1, c.n_nodes))
        rate *= nm.NVLS_EFFICIENCY[90] * (2.0 if c.op == "all_reduce" else (ppn - 1) / ppn)
    bw = softmin(rate, link, gpu.sat_p)
    kind = "nvls" if r.algorithm == "NVLS" else ("reduce" if c.op in ("all_reduce", "reduce_scatter") else "copy")
    mult = get("nvls_hbm_mult") if kind == "nvls" else HBM_MULT[kind][proto]
    if proto == "Simple":
        w = get("chunk_hbm_weight")
        mult *= (1.0 - w) + w * min(r.chunk_size, 4 * MIB) / DEFAULT_CHUNK["Simple"]
    return CommCost(latency_us=nccl.latency_us(gpu, c, r.algorithm, r.protocol), wire_bytes=wire, bw_gbs=max(bw, 1e-3), ctas=r.n_channels,
                    hbm_mult=mult)


def busbw_gbs(gpu: Gpu, c: Collective, cfg: CommConfig = CommConfig()) -> float:
    """Bus bandwidth (GB/s) of ``c`` alone under ``cfg``, as nccl-tests reports it:
    ``busbw = factor(op, n) * nbytes / time``."""
    cost = comm_cost(gpu, c, resolve_config(gpu, c, cfg))
    return cost.wire_bytes / (cost.t_alone_us * 1e3)
