"""NCCL's own tuning model, as the simulated NCCL uses it to choose its defaults.

Everything here is NCCL's, read at tag ``v2.30.7-1`` of ``NVIDIA/nccl`` (file:line at that tag;
the same values at v2.27.5-1 unless noted): the latencies and per-channel bandwidth caps of its
tuning tables, which protocol it enables on which path, how it picks an algorithm and protocol
for a size, and how many channels and threads a call runs with (point-to-point channel counts:
``engine.p2p``). The simulator's *hardware* (what a CTA really moves, ``sim.device``) is separate: NCCL's
model decides what NCCL runs, the device model how long that takes.

Units: GB/s, microseconds, bytes. "Search channel" is a channel of NCCL's topology graph; NCCL
launches two CTAs per search channel (``src/graph/connect.cc:460`` duplicates every channel).
"""

from __future__ import annotations

import math

KIB = 1024
MIB = 1024 * 1024
PROTOS = ("LL", "LL128", "Simple")

# --- src/graph/tuning.cc:148-211 (ncclTunerConstantsDefaults) -----------------------------------
BASE_LATENCY_US: dict[str, tuple[float, float, float]] = {
    "Tree": (6.8, 14.0, 8.4), "Ring": (6.6, 14.0, 8.4), "NVLS": (0.0, 0.0, 0.0), "PAT": (8.0, 8.0, 8.0),
}
"""baseLatencies[algo][LL, LL128, Simple] (tuning.cc:150-155)."""
HW_LATENCY_US: dict[str, dict[str, tuple[float, float, float]]] = {
    "nvlink": {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4), "NVLS": (0.0, 0.0, 25.0), "PAT": (0.0, 0.0, 4.0)},
    "pci": {"Tree": (1.0, 1.9, 4.0), "Ring": (1.0, 2.5, 5.7), "NVLS": (0.0, 0.0, 0.0), "PAT": (0.0, 0.0, 4.0)},
    "net": {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0), "NVLS": (0.0, 0.0, 18.0), "PAT": (0.0, 0.0, 14.0)},
}
"""hwLatencies[NVLINK | PCI | NET][algo][proto], per algorithm step (tuning.cc:157-176)."""
LL_MAX_BW: dict[int, tuple[float, float, float]] = {0: (39.0, 39.0, 20.4), 80: (87.7, 22.5, 19.0), 90: (141.0, 45.0, 35.0)}
"""llMaxBws (tuning.cc:178-183): one node indexes the GPU generation, several nodes the CPU (row 0
Intel, which the simulator assumes); columns 1 node / 2 nodes / more (tuning.cc:267-272)."""
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

# --- src/graph/topo.h:19-25, topo.cc:545-556, search.cc:1051-1058 --------------------------------
NVLINK_BW: dict[int, float] = {80: 20.0, 86: 12.0, 90: 20.6}
"""GB/s NCCL counts per NVLink link (SM80_NVLINK_BW, SM86_NVLINK_BW, SM90_NVLINK_BW; topo.h:21-23)."""
NVLINK_LINK_GBS: dict[int, float] = {80: 25.0, 86: 14.0625, 90: 25.0}
"""Datasheet GB/s per link and direction: NVLink 3 on A100 (12 links, 300 GB/s), on GA102 (4 links,
the A40 bridge's 112.5 GB/s both ways), NVLink 4 on H100 (18 links, 450 GB/s)."""
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

# --- src/include/comm.h:49-51, device.h:93-114, tuning.cc:244-257, 587-595 ----------------------
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}
"""Bytes per thread before NCCL adds a channel or threads (comm.h:49-51); Ring/LL is multiplied by
the rank count (tuning.cc:593)."""
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}
"""NCCL_LL_MAX_NTHREADS, NCCL_LL128_MAX_NTHREADS, NCCL_SIMPLE_MAX_NTHREADS (device.h:95-114)."""

# --- point to point: NCCL's rule (paths.cc:918-1007, enqueue.cc:915-925, 1141-1146, init.cc:818-843)
# is ``engine.p2p``, the one implementation the cost model and the simulator share.


def ll128_enabled(*, sm_arch: int, intra_nvlink: bool, n_nodes: int) -> bool:
    """Whether NCCL enables LL128 by default (tuning.cc:518-535).

    LL128 needs every intra-node hop of the graph on NVLink (``typeIntra <= PATH_NVB``,
    tuning.cc:531): never on PCIe, on a ring through NVLink-bridged pairs only when the group is
    one bridged pair. Across nodes the GPU-NIC path must be at most PXB before Hopper, PXN from
    Hopper (tuning.cc:520-530); the clusters modelled attach NICs by PCIe switch (PXB), so that
    part holds. Mixed compute capabilities are not modelled (tuning.cc:533).
    """
    del n_nodes  # the GPU-NIC path type is PXB on every modelled cluster (docstring)
    return intra_nvlink and sm_arch >= 70


def ring_graph(capacity_gbs: float, *, sm_arch: int, inter: bool, max_bw: float | None = None) -> tuple[int, float]:
    """The ring graph NCCL's search finds where every ring costs each GPU its speed out of
    ``capacity_gbs`` (search.cc:1074-1265 reduced to one capacity): (search channels, speed).

    Pass 1 (search.cc:1170-1251) starts at the fastest speed of the table at or below the
    capacity, keeps the graph with the most ``channels x speed`` (search.cc:457, ties keep the
    first), stops once that reaches the capacity (search.cc:1198), and otherwise lowers the speed
    while the next speed is above 0.49 of the best graph's (search.cc:1245). Then
    ``ncclTopoDupChannels`` doubles the channels at half the speed when the speed is >= 25 GB/s
    (search.cc:1036-1049). Pass 2 never finds a faster graph when the capacity is the only limit.

    Args:
        capacity_gbs: what a GPU can give all rings, in NCCL's units (PCIe Gen4 x16 24; twice
            that when NVLink bridges carry every other hop; the NIC's rate across nodes).
        sm_arch: 80, 86 or 90 (sm86 uses the Ampere table, search.cc:1157).
        inter: the graph spans nodes (speedArrayInter).
        max_bw: the fastest single path (``system->maxBw``, search.cc:1170: across nodes the
            GPU-NIC path); None = the capacity.

    Returns:
        (search channels >= 1, speed GB/s).
    """
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
    best_n = max(1, best_n)
    if best_s >= 25.0 and not (sm_arch > 80 and best_s < 50.0 and best_n > 4):
        best_n, best_s = 2 * best_n, best_s / 2.0
    return best_n, best_s


def comm_ctas(search_channels: int, *, max_channels: int = 64) -> int:
    """CTAs of a communicator for a graph of ``search_channels``: doubled when the rings are
    connected (connect.cc:460), at most MAXCHANNELS (64 from NCCL 2.25)."""
    return min(max_channels, 2 * search_channels)


def default_threads(protocol: str, algorithm: str, *, ring_busbw_gbs: float) -> int:
    """Threads per CTA NCCL launches with before the size rule (tuning.cc:244-257): Ring/Simple
    256 when its graph's ``speed x channels`` is at most PCI_BW (12 GB/s), else 512; Tree/Simple
    512; LL 512; LL128 640."""
    if protocol == "Simple" and algorithm == "Ring":
        return 256 if ring_busbw_gbs <= PCI_BW + 1e-9 else MAX_THREADS["Simple"]
    return MAX_THREADS[protocol]


def size_rule(nbytes: int, *, channels: int, threads: int, protocol: str, algorithm: str, n_ranks: int) -> tuple[int, int]:
    """Channels and threads NCCL runs a Ring or Tree call of ``nbytes`` with (enqueue.cc:2093-2105):
    it drops channels while ``nbytes < nc x nt x threshold``, then halves the threads (a multiple
    of 128) while the same holds. ``nbytes`` is the full message (``ncclFuncMaxSendRecvCount``:
    all ranks' data for all-gather and reduce-scatter, enqueue.h:39-41)."""
    thr = THREAD_THRESHOLD[protocol] * (n_ranks if (protocol == "LL" and algorithm == "Ring") else 1)
    nc, nt = max(1, channels), threads
    while nbytes < nc * nt * thr and nc >= 2:
        nc -= 1
    while nbytes < nc * nt * thr and nt % 128 == 0:
        nt //= 2
    return nc, max(nt, 96)


def ring_latency_us(protocol: str, *, op: str, n_ranks: int, n_nodes: int, intra: str) -> float:
    """NCCL's Ring latency for one call (tuning.cc:384-413): base + per-step hardware latency,
    the inter-node steps at the network's (plus its flush on Simple) and, across nodes, at least
    the network's post overhead per step (1 us on Intel, x3 for Simple; tuning.cc:228-233, 404-410)."""
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
    return BASE_LATENCY_US["Tree"][p] + 2 * ((per_node - 1) * HW_LATENCY_US[intra]["Tree"][p]
                                             + log_nodes * HW_LATENCY_US["net"]["Tree"][p])


def model_busbw_gbs(algorithm: str, protocol: str, *, op: str, graph_channels: int, graph_speed: float,
                    sm_arch: int, n_nodes: int) -> float:
    """NCCL's predicted bus bandwidth of an (algorithm, protocol) (tuning.cc:306-336): channels x
    speed, then LL at half (capped by llMaxBw), LL128 at 0.92 capped per channel, Tree at 0.92
    capped per channel (1/3.8 for LL, 7/9 for LL128 on one node). 0 = not available."""
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
            return min(bus * (7.0 / 9.0 if n_nodes == 1 else 120.0 / 128.0), graph_channels * PER_CH_MAX_TREE_LL128[arch][idx])
        return bus
    return 0.0


def algo_time_us(nbytes: int, *, op: str, busbw_gbs: float, latency_us: float, n_ranks: int, algorithm: str) -> float:
    """NCCL's predicted time of one call (tuning.cc:376-382, 630-654): latency plus bytes over
    the algorithm bandwidth (bus bandwidth x nRanks / nsteps for Ring; x 0.5 for Tree); inf when
    the bandwidth is 0. The Tree correction factors of medium sizes are left out."""
    if busbw_gbs <= 0:
        return math.inf
    steps = 2 * (n_ranks - 1) if op == "all_reduce" else n_ranks - 1
    ratio = (n_ranks / max(1, steps)) if algorithm in ("Ring", "NVLS") else 0.5
    return latency_us + nbytes / (1000.0 * busbw_gbs * ratio)


