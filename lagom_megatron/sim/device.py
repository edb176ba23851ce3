"""Device model of the simulated GPU cluster: how long compute and communication kernels take, alone
and when they share one GPU.

This is the simulator's hardware, and nothing here is visible to the engine: the search only
ever sees the timings the simulated backend reports (``lagom_megatron.sim.backend``).

Compute kernels (GEMM, attention, element-wise, norm) are described by FLOPs, HBM bytes and the
SMs they can use. Their time follows a roofline with imperfect overlap of math and memory
(our design, constant ``OVERLAP_GAMMA``)::

    t_math = flops / (peak_flops * eff_kind) * waves(sms_free) / waves(sms)   (SMs lost to comm CTAs)
    t_mem  = hbm_bytes / hbm_free_bw * (1 + KAPPA_MEM * share)      (HBM lost to comm, queueing)
    t      = max(t_math, t_mem) + OVERLAP_GAMMA * min(t_math, t_mem)

Communication kernels hold ``n_channels`` CTAs (one SM each; NCCL CTAs never share an SM with
compute, nccl#689) for their whole duration and move data at::

    bw = softmin(n_channels * per_channel_gbs(protocol, n_threads, chunk), link_gbs * protocol_eff)

where the link is NVLink inside a node and the network across nodes (``net_gbps_per_gpu`` times
the group's ranks per node, since NCCL runs one ring per NIC). Each wire byte costs
``HBM_MULT[op kind][protocol]`` bytes of HBM traffic (NVLink bytes x2-3, nccl#1428), scaled by
the chunk size (large chunks spill L2). When compute and communication together ask for more HBM
bandwidth than the device has, both get a proportional share (the sharing rule).

Defaults that NCCL would choose (``resolve_config``) follow NCCL's documented behaviour in broad
strokes: NVLS for intra-node all-reduce on sm90 NVSwitch systems, Ring otherwise; LL below 64 KiB,
LL128 below 4 MiB, Simple above; channels from the topology (``sim.channel_defaults``: 32 / 24 in an
NVSwitch node, 16 across nodes, 2 on PCIe).
The constants are calibrated, not derived: tests/sim/test_calibration.py checks them against the
public figures cited there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.p2p import P2P_CHUNK_BYTES, kernel_ctas, p2p_channels, peer_channels, task_channels
from lagom_megatron.sim.channel_defaults import topology_channels

KIB = 1024
MIB = 1024 * 1024

KAPPA_COMPUTE = 0.8
"""Memory-system interference on compute: math runs ``1 + KAPPA_COMPUTE * share`` slower, with
``share`` the fraction of HBM bandwidth the running collectives draw (L2 pollution, DRAM row
conflicts; nccl#1433: both sides slow down even with spare SMs). Our calibration."""
KAPPA_COMM = 0.5
"""The same on communication: bandwidth divided by ``1 + KAPPA_COMM * share`` of compute's HBM draw."""
KAPPA_MEM = 3.0
"""Queueing of a memory-bound kernel's HBM requests behind a collective's: its memory time runs
``1 + KAPPA_MEM * share`` slower on top of the proportional share. Calibrated on nccl#1428 (A100,
GPT training, all-gather overlapped): element-wise kernels 2.5x and attention 1.83x slower, GEMMs
1.76x; the maintainer: the collective's HBM traffic is its NVLink bytes "multiplied by at least 2x
... can be 3x". With 3.0 a 2 GiB element-wise kernel beside a 256 MiB all-gather on 8 A100 slows
about 2.1x (tests/sim/test_physics.py checks the public 1.8-2.5x range)."""
SAT_P = 8.0
"""Sharpness of bandwidth saturation: ``bw = (rate^-p + link^-p)^(-1/p)``. A shape assumption, not a
measurement (nccl-tests channel sweeps approach the link gradually rather than at a knee); at
NCCL's default channel counts it changes bus bandwidth by < 0.1%. A cluster file's
``bw_saturation_p`` (``lagom calibrate bandwidth``) wins."""
THREAD_EXPONENT = 0.6
"""Per-channel bandwidth scales as ``(threads / 512) ** THREAD_EXPONENT``; a cluster file's
``channel_thread_exponent`` (``lagom calibrate bandwidth``) wins."""
TILE_M, TILE_N = 128, 256
"""Output tile of a bf16 GEMM kernel (CUTLASS / cuBLAS Hopper and Ampere tiles): one CTA per tile."""
OVERLAP_GAMMA = 0.25
"""Fraction of the shorter of (math, memory) time that a kernel fails to hide (our calibration)."""

COMPUTE_EFF: dict[str, float] = {"gemm": 0.60, "attention": 0.45, "elementwise": 0.05, "norm": 0.05}
"""Achieved fraction of peak bf16 FLOP/s per kernel kind. Large square GEMMs reach ~70% of peak;
transformer GEMMs and the small kernels this model leaves out (softmax, dropout, rotary, bias)
bring a GPT-3 175B iteration to Megatron-LM's reported "up to 47%" MFU on H100 (calibration test)."""
HBM_EFF = 0.85
"""Achievable fraction of the HBM datasheet bandwidth."""

PROTOCOL_LINK_EFF: dict[tuple[int, str], float] = {
    (90, "Simple"): 0.82, (90, "LL128"): 0.78, (90, "LL"): 0.42,
    (80, "Simple"): 0.76, (80, "LL128"): 0.72, (80, "LL"): 0.40,
}
"""Fraction of the NVLink line rate each protocol reaches (sm arch, protocol): H100 Simple ~370 of
450 GB/s (nccl-tests#212: "~20% protocol overhead"); A100 ~200-230 of 300 GB/s (nccl-tests#149,
#178); LL spends half of each 8-byte word on a flag."""
NET_EFF: dict[str, float] = {"Simple": 0.94, "LL128": 0.90, "LL": 0.45}
"""Fraction of a NIC's line rate: 46-48 GB/s per 400 Gb/s NIC (nccl-tests#290)."""
PER_CHANNEL_GBS: dict[tuple[int, str], float] = {
    (90, "Simple"): 22.0, (90, "LL128"): 20.0, (90, "LL"): 9.0,
    (80, "Simple"): 15.0, (80, "LL128"): 13.0, (80, "LL"): 6.5,
}
"""GB/s one channel moves at 512 threads and the protocol's default chunk (sm arch, protocol)."""
NVLS_BUSBW_FACTOR = 1.07
"""NVLS all-reduce bus bandwidth / NVLink line rate: ~480 GB/s busbw on 8xH100 (nccl-tests#212)."""
LATENCY_US: dict[str, float] = {"LL": 4.0, "LL128": 6.0, "Simple": 9.0}
"""Launch + first-step latency of a collective, per protocol (microseconds)."""
HOP_SCALE: dict[str, float] = {"LL": 0.5, "LL128": 0.8, "Simple": 1.0}
"""Per-step latency relative to the cluster's nvlink/net latency, per protocol."""
HBM_MULT: dict[str, dict[str, float]] = {
    "reduce": {"Simple": 3.0, "LL128": 3.2, "LL": 4.0},
    "copy": {"Simple": 2.0, "LL128": 2.2, "LL": 3.0},
    "nvls": {"Simple": 1.2, "LL128": 1.2, "LL": 1.2},
}
"""HBM bytes per wire byte: reductions read two operands and write one; copies read and write;
NVLS reduces in the switch (NVLink bytes x2-3 for HBM, nccl#1428)."""
BUSBW_FACTOR_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    """One GPU of a cluster, in the simulator's units (GB/s, TFLOP/s)."""

    sms: int
    hbm_gbs: float
    peak_tflops: float
    nvlink_gbs: float
    """Per direction, per GPU."""
    net_gbs: float
    """Network line rate per GPU (one NIC per GPU), GB/s."""
    gpus_per_node: int
    sm_arch: int
    nvswitch: bool
    nvlink_latency_us: float
    net_latency_us: float
    max_channels: int
    intra_link: str = "nvlink"
    """nvlink or pcie (``ClusterSpec.intra_link``): decides NCCL's default channels."""
    nccl: tuple[int, int, int] = (2, 30, 7)
    """NCCL version (``ClusterSpec.nccl``): its point-to-point rule changed in 2.29 (``engine.p2p``)."""
    nics_per_node: int | None = None
    """``ClusterSpec.nics_per_node`` (None = one per GPU): channels per network peer (``engine.p2p``)."""
    kappa_mem: float = KAPPA_MEM
    kappa_compute: float = KAPPA_COMPUTE
    """Contention constants; a cluster file's fitted values (``lagom calibrate contention``) win."""
    per_channel: Mapping[str, float] = field(default_factory=dict)
    """Measured GB/s per channel by protocol (``ClusterSpec.per_channel_gbps``); a protocol left
    out keeps ``PER_CHANNEL_GBS``."""
    link_eff: Mapping[str, float] = field(default_factory=dict)
    """Measured share of the intra-node link by protocol (``ClusterSpec.link_eff``); else ``PROTOCOL_LINK_EFF``."""
    net_eff: Mapping[str, float] = field(default_factory=dict)
    """Measured share of the network by protocol (``ClusterSpec.net_eff``); else ``NET_EFF``."""
    sat_p: float = SAT_P
    """Saturation sharpness (``ClusterSpec.bw_saturation_p``); else ``SAT_P``."""
    thread_exponent: float = THREAD_EXPONENT
    """Per-channel thread scaling (``ClusterSpec.channel_thread_exponent``); else ``THREAD_EXPONENT``."""

    @classmethod
    def from_cluster(cls, spec: Any) -> "Gpu":
        """Builds the device from a ``ClusterSpec`` (configs/clusters/*.yaml)."""
        major, minor = (int(x) for x in str(spec.nccl_version).split(".")[:2])
        return cls(
            sms=int(spec.sms_per_gpu), hbm_gbs=float(spec.hbm_gbps), peak_tflops=float(spec.peak_bf16_tflops),
            nvlink_gbs=float(spec.nvlink_gbps_per_gpu), net_gbs=float(spec.net_gbps_per_gpu),
            gpus_per_node=int(spec.gpus_per_node), sm_arch=int(spec.sm_arch), nvswitch=bool(spec.nvswitch),
            nvlink_latency_us=float(getattr(spec, "nvlink_latency_us", 1.0)),
            net_latency_us=float(getattr(spec, "net_latency_us", 5.0)),
            max_channels=64 if (major, minor) >= (2, 25) else 32,
            intra_link=str(getattr(spec, "intra_link", "nvlink")),
            nccl=tuple(spec.nccl), nics_per_node=getattr(spec, "nics_per_node", None),
            kappa_mem=KAPPA_MEM if getattr(spec, "kappa_mem", None) is None else float(spec.kappa_mem),
            kappa_compute=KAPPA_COMPUTE if getattr(spec, "kappa_compute", None) is None else float(spec.kappa_compute),
            per_channel=dict(getattr(spec, "per_channel_gbps", None) or {}),
            link_eff=dict(getattr(spec, "link_eff", None) or {}), net_eff=dict(getattr(spec, "net_eff", None) or {}),
            sat_p=SAT_P if getattr(spec, "bw_saturation_p", None) is None else float(spec.bw_saturation_p),
            thread_exponent=(THREAD_EXPONENT if getattr(spec, "channel_thread_exponent", None) is None
                             else float(spec.channel_thread_exponent)),
        )

    @property
    def arch_key(self) -> int:
        return 90 if self.sm_arch >= 90 else 80


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
    fraction of HBM bandwidth concurrent collectives draw (``KAPPA_COMPUTE`` on math,
    ``KAPPA_MEM`` on memory time); SMs count in waves (``wave_factor``)."""
    sms = gpu.sms if sms_free is None else max(1.0, sms_free)
    full = gpu.sms
    if k.max_sms is not None:
        sms, full = min(sms, k.max_sms), min(full, k.max_sms)
    bw = gpu.hbm_gbs * HBM_EFF if hbm_gbs is None else max(1.0, hbm_gbs)
    t_math = (k.flops / (gpu.peak_tflops * 1e6 * COMPUTE_EFF[k.kind] * full / gpu.sms) * wave_factor(full, sms, k)
              * (1.0 + gpu.kappa_compute * comm_hbm_share))
    t_mem = k.hbm_bytes / (bw * 1e3) * (1.0 + gpu.kappa_mem * comm_hbm_share)
    return max(t_math, t_mem) + OVERLAP_GAMMA * min(t_math, t_mem) + 1.0


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


def _algorithms(gpu: Gpu, c: Collective) -> tuple[str, ...]:
    if c.op in ("send", "recv", "all_to_all"):
        return ("P2P",)
    algs = ["Ring"]
    if c.op == "all_reduce":
        algs.append("Tree")
    nvls_ok = gpu.nvswitch and gpu.sm_arch >= 90 and c.n_nodes == 1 and c.group_size > 2
    if nvls_ok and c.op in ("all_reduce", "all_gather", "reduce_scatter"):
        algs.append("NVLS")
    return tuple(algs)


def _default_channels(gpu: Gpu, c: Collective, algorithm: str, protocol: str) -> int:
    base = topology_channels(intra_link=gpu.intra_link, sm_arch_key=gpu.arch_key, n_nodes=c.n_nodes, algorithm=algorithm)
    # NCCL lowers the channel count for small messages (each channel needs a few chunks)
    per_rank = max(1, c.nbytes // max(1, c.group_size))
    by_size = max(1, per_rank // (DEFAULT_CHUNK[protocol] // 2))
    return int(min(base, by_size, gpu.max_channels))


def p2p_kernel_channels(gpu: Gpu, c: Collective, cta_bound: int | None, net_peer: int | None = None) -> int:
    """CTAs of a send/recv or all-to-all on a communicator with CTA bounds ``min = max = cta_bound``
    (None: NCCL's own, the topology's channel count for a Ring). NCCL's rule (``engine.p2p``, NVIDIA/nccl
    v2.30.7 ``src/graph/paths.cc:918-1007``): the communicator's channels give ``p2pnChannels``, the
    channels each peer's path wants (PCIe 2, NVLink 2 per link, a network peer by its NICs or
    ``net_peer`` = nChannelsPerNetPeer when set) are cut to it, and each task of the call takes
    channels by its bytes; the kernel runs one CTA per channel used."""
    comm = cta_bound if cta_bound is not None else topology_channels(
        intra_link=gpu.intra_link, sm_arch_key=gpu.arch_key, n_nodes=c.n_nodes, algorithm="Ring")
    comm = min(max(1, int(comm)), gpu.max_channels)
    p2p = p2p_channels(comm)
    nics = gpu.nics_per_node
    per = peer_channels(p2p=p2p, n_nodes=c.n_nodes, group_size=c.group_size, intra_link=gpu.intra_link,
                        sm_arch=gpu.sm_arch, nvlink_gbps=gpu.nvlink_gbs,
                        nics_per_gpu=1 if nics is None else max(1, nics // gpu.gpus_per_node),
                        nic_gbps=gpu.net_gbs * (gpu.gpus_per_node / nics if nics else 1.0),
                        net_peer_channels=net_peer, nccl=gpu.nccl, comm_channels=comm)
    a2a = c.op == "all_to_all"
    ranks = max(1, c.group_size)
    kind = "net" if c.n_nodes > 1 else gpu.intra_link
    task = task_channels(c.nbytes / (ranks if a2a else 1), per_peer=per, p2p=p2p, n_ranks=ranks,
                         chunk=P2P_CHUNK_BYTES[kind], multi_node=c.n_nodes > 1)
    return int(kernel_ctas(task, tasks=ranks if a2a else 1, p2p=p2p))


def cta_efficiency_applies(gpu: Gpu, c: Collective) -> bool:
    """Whether ``NCCL_CTA_POLICY=EFFICIENCY`` changes anything for ``c``.

    NCCL 2.27+ acts on the policy in one place (``src/enqueue.cc:2152-2170``, NCCL 2.30.7): with
    no tuner plugin, no NCCL_ALGO / NCCL_PROTO, an all-gather or reduce-scatter on *registered*
    user buffers, and NVLS available (one NVSwitch node on sm90+), it switches to NVLS / Simple
    with the channels NVLS registration needs. Everything else keeps NCCL's default. Megatron-Core
    registers its buffers only with NCCL user buffers enabled, which no simulated preset does
    (``Collective.registered`` is False), so the policy is NCCL's default there.
    """
    nvls_ok = gpu.nvswitch and gpu.sm_arch >= 90 and c.n_nodes == 1 and c.group_size > 2
    return c.registered and nvls_ok and c.op in ("all_gather", "reduce_scatter")


def resolve_config(gpu: Gpu, c: Collective, cfg: CommConfig) -> Resolved:
    """What NCCL runs for ``c`` under ``cfg``: requested knobs where NCCL honours them, its own
    choice elsewhere. An algorithm or protocol NCCL cannot run for the op is ignored (NCCL keeps
    its own choice when a tuner proposes an unavailable one)."""
    algs = _algorithms(gpu, c)
    if algs == ("P2P",):
        alg = "P2P"
    elif cfg.algorithm in algs:
        alg = cfg.algorithm
    elif c.op == "all_reduce" and "NVLS" in algs and c.nbytes >= 1 * MIB:
        alg = "NVLS"
    else:
        alg = "Ring"
    if alg in ("NVLS", "P2P"):
        proto = "Simple"
    elif cfg.protocol in ("LL", "LL128", "Simple"):
        proto = cfg.protocol
    else:
        proto = "LL" if c.nbytes < 64 * KIB else ("LL128" if c.nbytes < 4 * MIB else "Simple")
    threads = cfg.n_threads if cfg.n_threads in (64, 128, 256, 512) and proto != "LL128" else 512
    chunk = cfg.chunk_size if cfg.chunk_size and proto == "Simple" else DEFAULT_CHUNK[proto]
    if alg == "P2P":
        channels = p2p_kernel_channels(gpu, c, cfg.n_channels, cfg.net_peer_channels)
    elif cfg.n_channels is not None:
        channels = int(min(max(1, cfg.n_channels), gpu.max_channels))
    elif cfg.cta_policy == "EFFICIENCY" and cta_efficiency_applies(gpu, c):
        alg, proto, channels = "NVLS", "Simple", _default_channels(gpu, c, "NVLS", "Simple")
    else:
        channels = _default_channels(gpu, c, alg, proto)
    return Resolved(algorithm=alg, protocol=proto, n_channels=channels, n_threads=threads, chunk_size=chunk)


def per_channel_gbs(gpu: Gpu, protocol: str, n_threads: int, chunk: int) -> float:
    """GB/s one channel moves: more threads and larger chunks (less per-step overhead) go faster."""
    base = gpu.per_channel.get(protocol) or PER_CHANNEL_GBS[(gpu.arch_key, protocol)]
    threads = (min(n_threads, 512) / 512.0) ** gpu.thread_exponent
    ref = DEFAULT_CHUNK[protocol]
    step = (chunk / (chunk + 64 * KIB)) / (ref / (ref + 64 * KIB))
    return base * threads * step


def softmin(rate: float, link: float, p: float = SAT_P) -> float:
    """``(rate^-p + link^-p)^(-1/p)`` (default ``p = SAT_P``): the soft bandwidth ceiling, GB/s."""
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


def _link_gbs(gpu: Gpu, c: Collective, algorithm: str, protocol: str) -> float:
    """Link-limited bus bandwidth, GB/s."""
    nvl = gpu.nvlink_gbs * (gpu.link_eff.get(protocol) or PROTOCOL_LINK_EFF[(gpu.arch_key, protocol)])
    if algorithm == "NVLS":
        nvl = gpu.nvlink_gbs * (NVLS_BUSBW_FACTOR if c.op == "all_reduce" else PROTOCOL_LINK_EFF[(90, "Simple")] * 1.05)
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
    n = c.group_size
    wire = busbw_factor(c.op, n) * c.nbytes
    link = _link_gbs(gpu, c, r.algorithm, r.protocol)
    proto = r.protocol
    rate = r.n_channels * per_channel_gbs(gpu, proto, r.n_threads, r.chunk_size)
    if r.algorithm == "NVLS":
        rate *= 1.6  # the switch does the reduction: fewer CTAs move more bus bytes
    bw = softmin(rate, link, gpu.sat_p)
    if c.op in ("all_reduce",):
        steps = 2 * (n - 1) if r.algorithm == "Ring" else 2 * max(1, math.ceil(math.log2(max(n, 2))))
    elif c.op in ("all_gather", "reduce_scatter", "all_to_all"):
        steps = n - 1
    else:
        steps = 1
    if r.algorithm == "NVLS":
        steps = 2
    hop = gpu.net_latency_us if c.n_nodes > 1 else gpu.nvlink_latency_us
    latency = LATENCY_US[proto] + steps * hop * HOP_SCALE[proto]
    kind = "nvls" if r.algorithm == "NVLS" else ("reduce" if c.op in ("all_reduce", "reduce_scatter") else "copy")
    mult = HBM_MULT[kind][proto]
    if proto == "Simple":
        mult *= 0.75 + 0.25 * min(r.chunk_size, 4 * MIB) / DEFAULT_CHUNK["Simple"]
    ctas = r.n_channels if r.algorithm != "P2P" else r.n_channels
    return CommCost(latency_us=latency, wire_bytes=wire, bw_gbs=max(bw, 1e-3), ctas=ctas, hbm_mult=mult)


def busbw_gbs(gpu: Gpu, c: Collective, cfg: CommConfig = CommConfig()) -> float:
    """Bus bandwidth (GB/s) of ``c`` alone under ``cfg``, as nccl-tests reports it:
    ``busbw = factor(op, n) * nbytes / time``."""
    cost = comm_cost(gpu, c, resolve_config(gpu, c, cfg))
    return cost.wire_bytes / (cost.t_alone_us * 1e3)
