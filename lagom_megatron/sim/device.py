"""The simulated GPU: compute t = max(t_math, t_mem) + overlap_gamma * min(...), math slowed by SMs lost to comm CTAs
(waves), both by comm's HBM share; comm holds ``n_channels`` SMs (nccl#689) at softmin(n_channels * cta_gbs, link), a
wire byte costing ``HBM_MULT`` HBM bytes (nccl#1428); over-asked HBM is shared proportionally."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.sim import channel_defaults as nccl
from lagom_megatron.sim import tuning_model as nm
from lagom_megatron.sim.constants import CONSTANTS, get

KIB = 1024
MIB = 1024 * 1024
SAT_P = CONSTANTS["sat_p"].value
THREAD_EXPONENT = CONSTANTS["threads_exp"].value

COMPUTE_EFF: dict[str, float] = {"gemm": 0.60, "attention": 0.45, "elementwise": 0.05, "norm": 0.05}
"""Fraction of peak bf16 FLOP/s on Hopper, fitted to Megatron-LM's "up to 47%" MFU (GPT-3 175B, H100)."""
HBM_EFF = 0.85
"""Achievable fraction of HBM datasheet bandwidth (STREAM copies reach 80-90%)."""

PROTOCOL_LINK_EFF: dict[int, float] = {90: 0.82, 80: 0.76}
"""Ring/Simple busbw / NVLink rate: H100 ~370/450 (nccl-tests#212), A100 ~200-230/300 (nccl-tests#149, #178)."""
NET_EFF: dict[str, float] = {"Simple": 0.94, "LL128": 0.94 * nm.LL128_BUS_FACTOR, "LL": 0.94 * nm.LL_BUS_FACTOR}
"""Fraction of a NIC's line rate: 46-48 GB/s per 400 Gb/s NIC (nccl-tests#290)."""
NVLS_BUSBW_FACTOR = 1.07
"""NVLS all-reduce busbw / NVLink line rate: ~480 GB/s on 8xH100 (nccl-tests#212)."""
HBM_MULT: dict[str, dict[str, float]] = {
    "reduce": {"Simple": 3.0, "LL128": 3.2, "LL": 4.0},
    "copy": {"Simple": 2.0, "LL128": 2.2, "LL": 3.0},
}
"""HBM bytes per wire byte (nccl#1428: "at least 2x ... can be 3x"); LL128 / LL add flag writes and polls."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    """One GPU of a cluster (GB/s, TFLOP/s); the fitted fields (None / empty: the simulator's) override constants."""

    sms: int
    hbm_gbs: float
    peak_tflops: float
    nvlink_gbs: float
    """Intra-node link per direction per GPU (NVLink to the switch, or PCIe)."""
    net_gbs: float
    gpus_per_node: int
    sm_arch: int
    nvswitch: bool
    nvlink_latency_us: float
    net_latency_us: float
    max_channels: int
    intra_link: str = "nvlink"
    bridge_gbs: float = 0.0
    """NVLink bridge per direction between GPU pairs on a PCIe node, GB/s (0: none)."""
    nics_per_node: int | None = None
    """None: one per GPU."""
    nccl: tuple[int, int, int] = (2, 30, 7)
    """Point-to-point rule changed in 2.29 (``engine.p2p``)."""
    kappa_mem: float | None = None
    kappa_compute: float | None = None
    per_channel: Mapping[str, float] = field(default_factory=dict)
    link_eff: Mapping[str, float] = field(default_factory=dict)
    """Intra-node ceiling / ``nvlink_gbs`` by protocol."""
    net_eff: Mapping[str, float] = field(default_factory=dict)
    fit_sat_p: float | None = None
    fit_thread_exponent: float | None = None

    @classmethod
    def from_cluster(cls, spec: Any) -> Gpu:
        major, minor = (int(x) for x in str(spec.nccl_version).split(".")[:2])

        def opt(key: str) -> float | None:
            v = getattr(spec, key, None)
            return None if v is None else float(v)

        return cls(
            sms=int(spec.sms_per_gpu),
            hbm_gbs=float(spec.hbm_gbps),
            peak_tflops=float(spec.peak_bf16_tflops),
            nvlink_gbs=float(spec.nvlink_gbps_per_gpu),
            net_gbs=float(spec.net_gbps_per_gpu),
            gpus_per_node=int(spec.gpus_per_node),
            sm_arch=int(spec.sm_arch),
            nvswitch=bool(spec.nvswitch),
            nvlink_latency_us=float(getattr(spec, "nvlink_latency_us", 1.0)),
            net_latency_us=float(getattr(spec, "net_latency_us", 5.0)),
            max_channels=64 if (major, minor) >= (2, 25) else 32,
            intra_link=str(getattr(spec, "intra_link", "nvlink")),
            bridge_gbs=float(getattr(spec, "nvlink_bridge_gbps", None) or 0.0),
            nics_per_node=getattr(spec, "nics_per_node", None),
            nccl=tuple(spec.nccl),
            kappa_mem=opt("kappa_mem"),
            kappa_compute=opt("kappa_compute"),
            per_channel=dict(getattr(spec, "per_channel_gbps", None) or {}),
            link_eff=dict(getattr(spec, "link_eff", None) or {}),
            net_eff=dict(getattr(spec, "net_eff", None) or {}),
            fit_sat_p=opt("bw_saturation_p"),
            fit_thread_exponent=opt("channel_thread_exponent"),
        )

    @property
    def arch_key(self) -> int:
        """90 (Hopper and later), 86 (GA102: A40, A6000) or 80 (A100)."""
        return 90 if self.sm_arch >= 90 else (86 if self.sm_arch == 86 else 80)

    @property
    def table_key(self) -> int:
        """Row of NCCL's per-arch tables: 90, or 80 for every Ampere part (tuning.cc:263-266)."""
        return 90 if self.sm_arch >= 90 else 80

    @property
    def sat_p(self) -> float:
        return get("sat_p") if self.fit_sat_p is None else self.fit_sat_p

    @property
    def thread_exponent(self) -> float:
        return get("threads_exp") if self.fit_thread_exponent is None else self.fit_thread_exponent

    def kappa(self, name: str) -> float:
        v = getattr(self, name)
        return get(name) if v is None else v


@dataclass(frozen=True, slots=True)
class ComputeKernel:
    """``tiles``: CTAs per launch (0: waves do not matter); ``persistent``: one CTA per SM looping (pytorch#143988)."""

    name: str
    kind: str
    flops: float
    hbm_bytes: float
    max_sms: int | None = None
    tiles: int = 0
    persistent: bool = False


def wave_factor(sms: int, sms_free: float, k: ComputeKernel) -> float:
    """Math-time factor of ``k`` on ``sms_free`` of ``sms`` SMs (persistent kernels: pytorch#143988)."""
    free = max(1, int(math.floor(sms_free + 1e-9)))
    if free >= sms:
        return 1.0
    if k.persistent:
        return float(math.ceil(sms / free))
    if k.tiles > 0:
        return math.ceil(k.tiles / free) / math.ceil(k.tiles / sms)
    return sms / max(1.0, sms_free)


def compute_time_us(
    gpu: Gpu,
    k: ComputeKernel,
    *,
    sms_free: float | None = None,
    hbm_gbs: float | None = None,
    comm_hbm_share: float = 0.0,
) -> float:
    """Duration (us) of ``k`` given the SMs and HBM GB/s left to it and the HBM share collectives draw."""
    sms = gpu.sms if sms_free is None else max(1.0, sms_free)
    full = gpu.sms
    if k.max_sms is not None:
        sms, full = min(sms, k.max_sms), min(full, k.max_sms)
    bw = gpu.hbm_gbs * HBM_EFF if hbm_gbs is None else max(1.0, hbm_gbs)
    eff = get("gemm_eff_ampere") if (k.kind == "gemm" and gpu.sm_arch < 90) else COMPUTE_EFF[k.kind]
    t_math = (
        k.flops
        / (gpu.peak_tflops * 1e6 * eff * full / gpu.sms)
        * wave_factor(full, sms, k)
        * (1.0 + gpu.kappa("kappa_compute") * comm_hbm_share)
    )
    t_mem = k.hbm_bytes / (bw * 1e3) * (1.0 + gpu.kappa("kappa_mem") * comm_hbm_share)
    return max(t_math, t_mem) + get("overlap_gamma") * min(t_math, t_mem) + 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One collective call: op, full message bytes, group shape."""

    op: str
    nbytes: int
    group_size: int
    n_nodes: int = 1
    stride: int = 1
    """Rank stride of the group (1: consecutive GPUs); decides bridge hops (``channel_defaults.path``)."""
    registered: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    """A ``CommConfig`` with every knob decided, as NCCL runs it."""

    algorithm: str
    protocol: str
    n_channels: int
    n_threads: int
    chunk_size: int
    path: Any = None
    """``engine.registered.LowSmPath`` when NCCL runs its symmetric kernel or copy engines (SYMK, CE)."""


DEFAULT_CHUNK = {"Simple": 512 * KIB, "LL128": 576000, "LL": 32 * KIB}
"""NCCL's chunk bytes per protocol with default buffers (4 MiB Simple over NCCL_STEPS 8, init.cc:813)."""


def resolve_config(gpu: Gpu, c: Collective, cfg: CommConfig) -> Resolved:
    """What NCCL runs for ``c``: ``cfg``'s knobs it can run, else its model (LL128 where enabled, tuning.cc:518-535)."""
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
    path = nccl.low_sm_path(gpu, c, copy_engine=cfg.cta_policy == "ZERO")
    efficiency = cfg.cta_policy == "EFFICIENCY" and nccl.cta_efficiency_applies(gpu, c)
    plain = replace(cfg, cta_policy=None).is_default() and not efficiency  # symmetric kernels ask no tuner
    if path is not None and (path.ctas == 0 or plain):
        return Resolved(
            algorithm="CE" if path.ctas == 0 else "SYMK",
            protocol="Simple",
            n_channels=path.ctas,
            n_threads=512,
            chunk_size=chunk,
            path=path,
        )
    if alg == "P2P":
        channels = nccl.p2p_channels(gpu, c, cta_bound=cfg.n_channels, net_peer=cfg.net_peer_channels)
        threads = threads or nm.MAX_THREADS["Simple"]  # as channel_defaults.default_channels for P2P
    elif cfg.n_channels is not None:
        channels = int(min(max(1, cfg.n_channels), gpu.max_channels))
        threads = threads or nm.default_threads(proto, alg, ring_busbw_gbs=nccl.collective_ctas(gpu, c, alg)[1])
    elif cfg.cta_policy == "EFFICIENCY" and nccl.cta_efficiency_applies(gpu, c):
        alg, proto = "NVLS", "Simple"
        channels, threads = nccl.default_channels(gpu, c, "NVLS", "Simple", threads)
    else:
        channels, threads = nccl.default_channels(gpu, c, alg, proto, threads)
    return Resolved(algorithm=alg, protocol=proto, n_channels=channels, n_threads=threads, chunk_size=chunk)


def cta_gbs(gpu: Gpu, algorithm: str, protocol: str, n_threads: int, chunk: int, n_nodes: int = 1) -> float:
    """GB/s one CTA moves when the link is not the limit: x ``(threads / most)^threads_exp`` (device.h:95-114); LL128
    caps: tuning.cc:328-329, 185-190; LL: tuning.cc:327; Tree: tuning.cc:330-335. Chunks below default pay a per-step
    overhead (half rate at 64 KiB; no source)."""
    simple = gpu.per_channel.get("Simple") or get(f"cta_gbs_sm{gpu.arch_key}")
    if not gpu.per_channel.get("Simple"):
        if algorithm == "NVLS":
            simple *= get("nvls_cta_mult")
        elif n_nodes > 1 and gpu.nvswitch:
            simple = max(simple, net_graph_cta_gbs(gpu.sm_arch))
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
        base = gpu.per_channel[protocol]  # measured (``lagom calibrate bandwidth``)
    threads = (min(n_threads, nm.MAX_THREADS[protocol]) / nm.MAX_THREADS[protocol]) ** gpu.thread_exponent
    ref = DEFAULT_CHUNK[protocol]
    step = (chunk / (chunk + 64 * KIB)) / (ref / (ref + 64 * KIB))
    return base * threads * step


def net_graph_cta_gbs(sm_arch: int) -> float:
    """GB/s NCCL's ring graph asks of one CTA across NVSwitch nodes of one NIC per GPU: one channel per NIC at the inter
    table's top speed (48, search.cc:1052, 1058) through ``ncclTopoDupChannels`` (8 channels: sm90 keeps 48,
    :1040), two CTAs per channel (connect.cc:460): 24 sm90 (16 CTAs, nccl-tests#290's 46-48 GB/s per NIC), 12 sm80."""
    return nm.dup_channels(8, nm.SPEED_INTER[90 if sm_arch >= 90 else 80][0], sm_arch=sm_arch)[1] / 2.0


def softmin(rate: float, link: float, p: float | None = None) -> float:
    """``(rate^-p + link^-p)^(-1/p)`` (p default ``sat_p``): the soft bandwidth ceiling, GB/s."""
    p = get("sat_p") if p is None else p
    return (rate**-p + link**-p) ** (-1.0 / p)


def busbw_factor(op: str, n: int) -> float:
    """Wire bytes per rank / message bytes (nccl-tests PERFORMANCE.md)."""
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
    """Intra-node busbw ceiling of ``c``, GB/s: ``link_eff``, else link x ``PROTOCOL_LINK_EFF`` / ``pcie_link_eff``."""
    p = nccl.path(gpu, c)
    if gpu.link_eff.get(protocol) and p != "bridge":
        return gpu.nvlink_gbs * gpu.link_eff[protocol]
    if p == "nvswitch":
        return gpu.nvlink_gbs * PROTOCOL_LINK_EFF[gpu.table_key] * _proto_factor(protocol)
    if p == "bridge":
        return gpu.bridge_gbs * PROTOCOL_LINK_EFF[80] * _proto_factor(protocol)
    return (2.0 if p == "bridged" else 1.0) * gpu.nvlink_gbs * get("pcie_link_eff") * _proto_factor(protocol)


def _link_gbs(gpu: Gpu, c: Collective, algorithm: str, protocol: str) -> float:
    nvl = intra_link_gbs(gpu, c, protocol)
    if algorithm == "NVLS":
        # all-reduce: nccl-tests#212's ~480 GB/s; gathers and reduce-scatters: nccl#1506's ~300 (``nvls_gather_link_eff``)
        nvl = gpu.nvlink_gbs * (NVLS_BUSBW_FACTOR if c.op == "all_reduce" else get("nvls_gather_link_eff"))
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
    """A collective's standalone cost (wire bytes per rank; hbm_mult: HBM bytes per wire byte)."""

    latency_us: float
    wire_bytes: float
    bw_gbs: float
    ctas: int
    hbm_mult: float

    @property
    def t_alone_us(self) -> float:
        return self.latency_us + self.wire_bytes / (self.bw_gbs * 1e3)


def comm_cost(gpu: Gpu, c: Collective, r: Resolved) -> CommCost:
    wire = busbw_factor(c.op, c.group_size) * c.nbytes
    link = _link_gbs(gpu, c, r.algorithm, r.protocol)
    proto = r.protocol
    rate = r.n_channels * cta_gbs(gpu, r.algorithm, proto, r.n_threads, r.chunk_size, c.n_nodes)
    if r.path is not None:  # registered buffers: NCCL's own estimate of its symmetric kernel or copy engines
        moving = max(r.path.time_us - r.path.latency_us, 1e-3)
        kind = "reduce" if c.op in ("all_reduce", "reduce_scatter") else "copy"
        return CommCost(
            latency_us=r.path.latency_us,
            wire_bytes=wire,
            bw_gbs=wire / (moving * 1e3),
            ctas=r.n_channels,
            hbm_mult=HBM_MULT[kind]["Simple"],
        )
    if r.algorithm == "NVLS":
        # link speed x nvlsEfficiency, x2 for all-reduce, else x (ranks - 1) / ranks (tuning.cc:311-318)
        ppn = max(1, c.group_size // max(1, c.n_nodes))
        rate *= nm.NVLS_EFFICIENCY[90] * (2.0 if c.op == "all_reduce" else (ppn - 1) / ppn)
    bw = softmin(rate, link, gpu.sat_p)
    kind = "nvls" if r.algorithm == "NVLS" else ("reduce" if c.op in ("all_reduce", "reduce_scatter") else "copy")
    mult = get("nvls_hbm_mult") if kind == "nvls" else HBM_MULT[kind][proto]
    if proto == "Simple":
        w = get("chunk_hbm_weight")
        mult *= (1.0 - w) + w * min(r.chunk_size, 4 * MIB) / DEFAULT_CHUNK["Simple"]
    return CommCost(
        latency_us=nccl.latency_us(gpu, c, r.algorithm, r.protocol),
        wire_bytes=wire,
        bw_gbs=max(bw, 1e-3),
        ctas=r.n_channels,
        hbm_mult=mult,
    )


def busbw_gbs(gpu: Gpu, c: Collective, cfg: CommConfig = CommConfig()) -> float:
    """Bus bandwidth (GB/s) of ``c`` alone under ``cfg``, as nccl-tests reports it."""
    cost = comm_cost(gpu, c, resolve_config(gpu, c, cfg))
    return cost.wire_bytes / (cost.t_alone_us * 1e3)
