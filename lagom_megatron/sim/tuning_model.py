"""NCCL's own tuning model, which the simulated NCCL chooses its defaults with. NVIDIA/nccl @v2.30.7-1 ``src/`` (same
values at v2.27.5-1 unless noted); GB/s, us, bytes. A "search channel" is a channel of NCCL's topology graph, run as
two CTAs (``src/graph/connect.cc:460``)."""

from __future__ import annotations

import math

KIB = 1024
MIB = 1024 * 1024
PROTOS = ("LL", "LL128", "Simple")

BASE_LATENCY_US: dict[str, tuple[float, float, float]] = {
    "Tree": (6.8, 14.0, 8.4),
    "Ring": (6.6, 14.0, 8.4),
    "NVLS": (0.0, 0.0, 0.0),
    "PAT": (8.0, 8.0, 8.0),
}
"""baseLatencies[algo][LL, LL128, Simple] (ncclTunerConstantsDefaults, tuning.cc:148-211; :150-155)."""
HW_LATENCY_US: dict[str, dict[str, tuple[float, float, float]]] = {
    "nvlink": {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4), "NVLS": (0.0, 0.0, 25.0), "PAT": (0.0, 0.0, 4.0)},
    "pci": {"Tree": (1.0, 1.9, 4.0), "Ring": (1.0, 2.5, 5.7), "NVLS": (0.0, 0.0, 0.0), "PAT": (0.0, 0.0, 4.0)},
    "net": {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0), "NVLS": (0.0, 0.0, 18.0), "PAT": (0.0, 0.0, 14.0)},
}
"""hwLatencies[NVLINK | PCI | NET][algo][proto], per algorithm step (tuning.cc:157-176)."""
LL_MAX_BW: dict[int, tuple[float, float, float]] = {
    0: (39.0, 39.0, 20.4),
    80: (87.7, 22.5, 19.0),
    90: (141.0, 45.0, 35.0),
}
"""llMaxBws (tuning.cc:178-183): row: GPU arch on 1 node, else CPU (0: Intel); columns 1 / 2 / more nodes (:267-272)."""
PER_CH_MAX_RING_LL128: dict[int, float] = {80: 20.0, 90: 36.7}
"""perChMaxRingLL128Bws, per search channel, same for 1/2/4 nodes (tuning.cc:185-190)."""
PER_CH_MAX_TREE_LL128: dict[int, tuple[float, float, float]] = {80: (20.0, 20.0, 20.0), 90: (36.7, 36.7, 29.0)}
"""perChMaxTreeLL128Bws (tuning.cc:192-197)."""
PER_CH_MAX_TREE: dict[int, tuple[float, float, float]] = {80: (24.0, 23.6, 17.8), 90: (38.7, 41.4, 36.0)}
"""perChMaxTreeBws (tuning.cc:199-204)."""
NVLS_EFFICIENCY: dict[int, float] = {80: 0.0, 90: 0.85}
"""nvlsEfficiency (tuning.cc:139-144): Ampere has no NVLS."""
LL128_BUS_FACTOR = 0.92
"""Ring/LL128 bus bandwidth relative to Simple, 120 of 128 bytes (tuning.cc:329)."""
LL_BUS_FACTOR = 0.5
"""Ring/LL bus bandwidth relative to Simple, half of each 8-byte word is a flag (tuning.cc:327)."""

NVLINK_BW: dict[int, float] = {80: 20.0, 86: 12.0, 90: 20.6}
"""GB/s NCCL counts per NVLink link (SM80_NVLINK_BW, SM86_NVLINK_BW, SM90_NVLINK_BW; topo.h:21-23)."""
NVLINK_LINK_GBS: dict[int, float] = {80: 25.0, 86: 14.0625, 90: 25.0}
"""Datasheet GB/s per link and direction: A100 (NVLink 3, 12 links), GA102 (4, A40 bridge), H100 (NVLink 4, 18)."""
PCI_BW = 12.0
"""PCI Gen3 x16 in NCCL's units (topo.h:25): Ring/Simple defaults to 256 threads at or below it."""
PCIE_GEN4_X16 = 24.0
"""16 GT/s x 16 lanes in NCCL's units: 120 x 16 / 80 (kvDictPciGen, topo.cc:545-556)."""
SPEED_INTRA: dict[int, tuple[float, ...]] = {
    80: (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    90: (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
}
"""speedArrayIntra / sm90SpeedArrayIntra (search.cc:1051, 1057): ring speeds the search tries."""
SPEED_INTER: dict[int, tuple[float, ...]] = {
    80: (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12),
    90: (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
}
"""speedArrayInter / sm90SpeedArrayInter (search.cc:1052-1053, 1058-1059)."""

THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}
"""Bytes per thread before NCCL adds channels or threads (comm.h:49-51); Ring/LL x ranks (tuning.cc:587-595)."""
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}
"""NCCL_LL_MAX_NTHREADS, NCCL_LL128_MAX_NTHREADS, NCCL_SIMPLE_MAX_NTHREADS (device.h:95-114)."""
# point to point (paths.cc:918-1007, enqueue.cc:915-925, 1141-1146, init.cc:818-843): ``engine.p2p``


def ll128_enabled(*, sm_arch: int, intra_nvlink: bool, n_nodes: int) -> bool:
    """Whether NCCL enables LL128 by default (tuning.cc:518-535): all intra-node hops NVLink (:531); the GPU-NIC path
    (:520-530) is PXB on every modelled cluster; mixed compute capabilities (:533) are not modelled."""
    del n_nodes
    return intra_nvlink and sm_arch >= 70


def ring_graph(capacity_gbs: float, *, sm_arch: int, inter: bool, max_bw: float | None = None) -> tuple[int, float]:
    """(search channels >= 1, speed) of NCCL's ring graph when a ring costs a GPU its speed of ``capacity_gbs``:
    search.cc:1074-1265, pass 1 (:1170-1251; :457, :1198, :1245), ``ncclTopoDupChannels`` (:1036-1049); ``max_bw``:
    ``system->maxBw`` (:1170), None = the capacity; sm86 uses the Ampere table (:1157)."""
    table = (SPEED_INTER if inter else SPEED_INTRA)[90 if sm_arch >= 90 else 80]
    top = capacity_gbs if max_bw is None else min(capacity_gbs, max_bw)
    i = next((k for k, s in enumerate(table) if s <= top + 1e-9), len(table) - 1)
    best_n, best_s = 0, 0.0
    while True:
        s = table[i]
        n = max(0, int(math.floor(capacity_gbs / s + 1e-9)))
        if n * s > best_n * best_s + 1e-9:
            best_n, best_s = n, s
        if best_n * best_s >= capacity_gbs - 1e-9 or i + 1 >= len(table) or table[i + 1] / best_s <= 0.49:
            break
        i += 1
    return dup_channels(max(1, best_n), best_s, sm_arch=sm_arch)


def dup_channels(n: int, speed: float, *, sm_arch: int) -> tuple[int, float]:
    """``ncclTopoDupChannels`` (search.cc:1036-1047): a ring graph of >= 25 GB/s gets twice the channels at half the
    speed (:1039, :1045), unless sm > 80 and it is under 50 GB/s with more than 4 channels (:1040)."""
    if speed >= 25.0 and not (sm_arch > 80 and speed < 50.0 and n > 4):
        return 2 * n, speed / 2.0
    return n, speed


def comm_ctas(search_channels: int, *, max_channels: int = 64) -> int:
    """CTAs of a communicator for ``search_channels``: twice (connect.cc:460), at most MAXCHANNELS (64 from 2.25)."""
    return min(max_channels, 2 * search_channels)


def default_threads(protocol: str, algorithm: str, *, ring_busbw_gbs: float) -> int:
    """Threads per CTA before the size rule (tuning.cc:244-257): Ring/Simple 256 at ``speed x channels`` <= PCI_BW."""
    if protocol == "Simple" and algorithm == "Ring":
        return 256 if ring_busbw_gbs <= PCI_BW + 1e-9 else MAX_THREADS["Simple"]
    return MAX_THREADS[protocol]


def size_rule(
    nbytes: int, *, channels: int, threads: int, protocol: str, algorithm: str, n_ranks: int
) -> tuple[int, int]:
    """(channels, threads) of a Ring / Tree call (enqueue.cc:2093-2105); ``nbytes``: full message (enqueue.h:39-41)."""
    thr = THREAD_THRESHOLD[protocol] * (n_ranks if (protocol == "LL" and algorithm == "Ring") else 1)
    nc, nt = max(1, channels), threads
    while nbytes < nc * nt * thr and nc >= 2:
        nc -= 1
    while nbytes < nc * nt * thr and nt % 128 == 0:
        nt //= 2
    return nc, max(nt, 96)


def ring_latency_us(protocol: str, *, op: str, n_ranks: int, n_nodes: int, intra: str) -> float:
    """NCCL's Ring latency of one call, us (tuning.cc:384-413; network post overhead per step, :228-233, 404-410)."""
    p = PROTOS.index(protocol)
    steps = 2 * (n_ranks - 1) if op == "all_reduce" else n_ranks - 1
    lat = BASE_LATENCY_US["Ring"][p]
    intra_lat = HW_LATENCY_US[intra]["Ring"][p]
    if n_nodes <= 1:
        return lat + steps * intra_lat
    inter_lat = HW_LATENCY_US["net"]["Ring"][p]
    intra_lat = max(intra_lat, 3.0 if protocol == "Simple" else 1.0)
    inter_steps = 2 * (n_nodes - 1) if op == "all_reduce" else n_nodes - 1
    return lat + (steps - inter_steps) * intra_lat + inter_steps * inter_lat


def tree_latency_us(protocol: str, *, n_ranks: int, n_nodes: int, intra: str) -> float:
    """NCCL's Tree all-reduce latency (tuning.cc:414-417): 2 x (intra steps + log2(nodes) net steps)."""
    p = PROTOS.index(protocol)
    per_node = max(1, n_ranks // max(1, n_nodes))
    log_nodes = int(math.log2(max(1, n_nodes)))
    return BASE_LATENCY_US["Tree"][p] + 2 * (
        (per_node - 1) * HW_LATENCY_US[intra]["Tree"][p] + log_nodes * HW_LATENCY_US["net"]["Tree"][p]
    )


def model_busbw_gbs(
    algorithm: str, protocol: str, *, op: str, graph_channels: int, graph_speed: float, sm_arch: int, n_nodes: int
) -> float:
    """NCCL's predicted bus bandwidth of an (algorithm, protocol), GB/s (tuning.cc:306-336); 0 = not available."""
    arch = 90 if sm_arch >= 90 else 80
    idx = 0 if n_nodes == 1 else (1 if n_nodes == 2 else 2)
    ll_max = LL_MAX_BW[arch if n_nodes == 1 else 0][idx]
    bus = graph_channels * graph_speed
    if algorithm == "Ring":
        if protocol == "LL":
            return min(ll_max, bus * LL_BUS_FACTOR)
        if protocol == "LL128":
            return min(bus * LL128_BUS_FACTOR, graph_channels * PER_CH_MAX_RING_LL128[arch])
        return bus
    if algorithm == "Tree" and op == "all_reduce":
        bus = min(bus * 0.92, graph_channels * PER_CH_MAX_TREE[arch][idx])
        if protocol == "LL":
            return min(bus / 3.8, ll_max)
        if protocol == "LL128":
            return min(
                bus * (7.0 / 9.0 if n_nodes == 1 else 120.0 / 128.0), graph_channels * PER_CH_MAX_TREE_LL128[arch][idx]
            )
        return bus
    return 0.0


def algo_time_us(nbytes: int, *, op: str, busbw_gbs: float, latency_us: float, n_ranks: int, algorithm: str) -> float:
    """NCCL's predicted time of one call, us (tuning.cc:376-382, 630-654; no Tree correction); inf at 0 bandwidth."""
    if busbw_gbs <= 0:
        return math.inf
    steps = 2 * (n_ranks - 1) if op == "all_reduce" else n_ranks - 1
    ratio = (n_ranks / max(1, steps)) if algorithm in ("Ring", "NVLS") else 0.5
    return latency_us + nbytes / (1000.0 * busbw_gbs * ratio)
