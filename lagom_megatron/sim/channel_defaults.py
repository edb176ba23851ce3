"""What NCCL runs by default on a simulated topology: algorithm, protocol, channels and threads
(the simulator's NCCL side), from NCCL's own model (``nccl.tuning_model``, NCCL v2.30.7).

Channels come from NCCL's ring search where a link's capacity sets it, and from NCCL's logs where
NVSwitch does:

* **PCIe nodes** (``intra_link: pcie``): one GPU's PCIe Gen4 x16 is 24 GB/s in NCCL's units
  (topo.cc:545-556). The search finds one ring at 20 GB/s, then keeps lowering the speed (0.49
  rule) and finds two at 12 GB/s, which fill the 24 (search.cc:1198, 1245): 2 search channels,
  4 CTAs after ``connect.cc:460`` doubles them.
* **NVLink-bridged pairs on PCIe** (``nvlink_bridge_gbps``): a ring through the node alternates
  bridge and PCIe hops, so each GPU's PCIe carries one direction of a ring and rings in both
  directions fit: capacity 48, 24 per ring (the PCIe hop): 4 search channels at 12 GB/s, 8 CTAs.
  A group of one bridged pair rings over the bridge alone (4 links x 12 GB/s, topo.h:23).
* **Across nodes behind shared NICs**: the GPU-NIC path limits each ring (``maxBw``): one 100
  Gb/s NIC (12.5 GB/s) gives one ring at 12 GB/s, 2 CTAs, and 256 threads because 12 <= PCI_BW
  (tuning.cc:244-245): an NCCL maintainer in nccl#689, a PCIe system with one NIC "should just
  launch 2 SMs". One 200 Gb/s NIC: one ring at 24, 2 CTAs, 512 threads; two 400 Gb/s NICs behind
  bridged pairs: two rings at 24, 4 CTAs.
* **NVSwitch nodes**: NCCL INFO logs "24 coll channels" on DGX A100 (the search gives the same:
  6 rings at 40 GB/s over 12 links x 20, doubled twice) and "32 coll channels" on DGX H100
  (the reduced search gives 24 there: the log is kept); about 16 across nodes with one NIC per
  GPU (nccl#689). NVLS runs 16 channels (``nvlsChannels`` on sm90, 2.26 and later).

Then NCCL's size rule (``tuning_model.size_rule``, enqueue.cc:2093-2105) drops channels and threads
for small messages. Point-to-point calls use NCCL's per-peer channels and its P2P size rule
(``p2p_channels``, paths.cc:919-1004 and enqueue.cc:918-925, 1143-1146).
"""

from __future__ import annotations

from typing import Any

from lagom_megatron.engine import p2p as p2p_rule
from lagom_megatron.nccl import tuning_model as nm

NVSWITCH_CHANNELS = {90: 32, 80: 24}
"""Collective CTAs in one NVSwitch node by SM architecture (NCCL INFO logs of DGX H100 / DGX A100)."""
NVLINK_INTER_NODE_CHANNELS = 16
"""Collective CTAs across NVSwitch nodes with one NIC per GPU (nccl#689: about 16 SMs)."""
NVLS_CHANNELS = 16
"""NVLS CTAs on sm90 (``NCCL_NVLS_NCHANNELS`` default, research notes: 16 on sm90 in 2.26)."""


def nvlinks(gpu: Any) -> int:
    """NVLink links per GPU: NVSwitch links, or the bridge's, from datasheet GB/s per link."""
    arch = 86 if gpu.sm_arch == 86 else (90 if gpu.sm_arch >= 90 else 80)
    gbs = gpu.bridge_gbs if gpu.intra_link == "pcie" else gpu.nvlink_gbs
    return max(0, round(gbs / nm.NVLINK_LINK_GBS[arch]))


def path(gpu: Any, c: Any) -> str:
    """How the ranks of ``c`` are joined inside a node: ``nvswitch``, ``bridge`` (one NVLink-bridged
    pair), ``bridged`` (a ring alternating bridge and PCIe hops), ``pcie``."""
    if gpu.intra_link != "pcie":
        return "nvswitch"
    per_node = max(1, c.group_size // max(1, c.n_nodes))
    if gpu.bridge_gbs > 0 and c.stride == 1:
        if per_node == 2:
            return "bridge"
        if per_node >= 4 and per_node % 2 == 0:
            return "bridged"
    return "pcie"


def nic_gbs(gpu: Any) -> float:
    """One NIC's GB/s: the per-GPU share times the GPUs sharing a NIC."""
    nics = gpu.nics_per_node or gpu.gpus_per_node
    return gpu.net_gbs * gpu.gpus_per_node / nics


def ring_graph(gpu: Any, c: Any) -> tuple[int, float]:
    """NCCL's ring graph for ``c`` on a PCIe-class node (module docstring): (search channels, speed)."""
    p = path(gpu, c)
    if p == "bridge":
        cap, top = nvlinks(gpu) * nm.NVLINK_BW[86 if gpu.sm_arch == 86 else 80], None
    elif p == "bridged":
        cap, top = 2 * nm.PCIE_GEN4_X16, nm.PCIE_GEN4_X16
    else:
        cap, top = nm.PCIE_GEN4_X16, None
    if c.n_nodes > 1:
        nics = gpu.nics_per_node or gpu.gpus_per_node
        top = min(top or nm.PCIE_GEN4_X16, nic_gbs(gpu))
        cap = min(cap, nics * nic_gbs(gpu))
    return nm.ring_graph(cap, sm_arch=gpu.sm_arch, inter=c.n_nodes > 1, max_bw=top)


def collective_ctas(gpu: Any, c: Any, algorithm: str) -> tuple[int, float]:
    """A communicator's CTAs for ``algorithm`` before the size rule, and its ring graph's
    ``channels x speed`` (NCCL's units; decides the default thread count)."""
    if algorithm == "NVLS":
        return NVLS_CHANNELS, 1e9
    if gpu.intra_link != "pcie":
        n = NVSWITCH_CHANNELS[90 if gpu.sm_arch >= 90 else 80] if c.n_nodes == 1 else NVLINK_INTER_NODE_CHANNELS
        return min(n, gpu.max_channels), 1e9
    ch, speed = ring_graph(gpu, c)
    return nm.comm_ctas(ch, max_channels=gpu.max_channels), ch * speed


def p2p_channels(gpu: Any, c: Any, *, cta_bound: int | None = None, net_peer: int | None = None) -> int:
    """CTAs of one point-to-point call (send/recv, or one all-to-all) under NCCL's rule
    (``engine.p2p``, the one implementation the cost model uses too; NVIDIA/nccl v2.30.7
    ``src/graph/paths.cc:918-1007``, ``src/enqueue.cc:915-925, 1141-1146``): the communicator's
    channels give ``p2pnChannels``, the least the peers' paths want is cut to it (NVLink 2 per link,
    PCIe 2, a network peer by the GPU's NICs or ``net_peer``), and each task takes channels by its
    bytes; the kernel runs one CTA per channel used.

    ``cta_bound``: the communicator was created with ``minCTAs = maxCTAs = cta_bound`` (a pool
    entry), so its collective channels, and with them ``p2pnChannels = pow2Up(nChannels)``
    (paths.cc:984-990), follow the bound; None = NCCL's own channel count. ``net_peer``:
    ``NCCL_NCHANNELS_PER_NET_PEER`` (``nChannelsPerNetPeer``) across nodes. A group of one
    NVLink-bridged pair (``path`` ``bridge``) is all NVLink: the bridge's links and NVLink's chunk
    (``src/init.cc:830-837``, ``comm->isAllNvlink``); a ring through bridged pairs also has PCIe peers."""
    comm = cta_bound if cta_bound is not None else collective_ctas(gpu, c, "Ring")[0]
    comm = min(max(1, int(comm)), gpu.max_channels)
    p2p = p2p_rule.p2p_channels(comm)
    link = path(gpu, c)
    nvl = link in ("nvswitch", "bridge")
    nics = gpu.nics_per_node
    per = p2p_rule.peer_channels(p2p=p2p, n_nodes=c.n_nodes, group_size=c.group_size,
                                 intra_link="nvlink" if nvl else "pcie", sm_arch=gpu.sm_arch,
                                 nvlink_gbps=gpu.nvlink_gbs if link == "nvswitch" else gpu.bridge_gbs,
                                 nics_per_gpu=1 if nics is None else max(1, nics // gpu.gpus_per_node),
                                 nic_gbps=nic_gbs(gpu), net_peer_channels=net_peer, nccl=gpu.nccl, comm_channels=comm)
    a2a = c.op == "all_to_all"
    ranks = max(1, c.group_size)
    chunk = p2p_rule.P2P_CHUNK_BYTES["net" if c.n_nodes > 1 else ("nvlink" if nvl else "pcie")]
    task = p2p_rule.task_channels(c.nbytes / ranks if a2a else c.nbytes, per_peer=per, p2p=p2p, n_ranks=ranks,
                                  chunk=chunk, multi_node=c.n_nodes > 1)
    return int(p2p_rule.kernel_ctas(task, tasks=ranks if a2a else 1, p2p=p2p))


def default_protocol(gpu: Any, c: Any, algorithm: str) -> str:
    """The protocol NCCL's model predicts fastest for ``c`` under ``algorithm`` among those it
    enables (``tuning_model.ll128_enabled``; NVLS runs Simple only, tuning.cc:301)."""
    if algorithm in ("NVLS", "P2P"):
        return "Simple"
    best, best_t = "Simple", float("inf")
    for proto in nm.PROTOS:
        if proto == "LL128" and not ll128_allowed(gpu, c):
            continue
        t = model_time_us(gpu, c, algorithm, proto)
        if t < best_t:
            best, best_t = proto, t
    return best


def ll128_allowed(gpu: Any, c: Any) -> bool:
    """Whether NCCL enables LL128 by default for ``c`` (every intra-node hop on NVLink)."""
    return nm.ll128_enabled(sm_arch=gpu.sm_arch, intra_nvlink=path(gpu, c) in ("nvswitch", "bridge"), n_nodes=c.n_nodes)


def model_time_us(gpu: Any, c: Any, algorithm: str, protocol: str) -> float:
    """NCCL's predicted time for ``c`` (``tuning_model.algo_time_us``) on its graph of this topology."""
    n, nodes = c.group_size, c.n_nodes
    intra = "nvlink" if path(gpu, c) in ("nvswitch", "bridge") else "pci"
    if algorithm == "NVLS":
        link = nvlinks(gpu) * nm.NVLINK_BW[90]
        bus = link * nm.NVLS_EFFICIENCY[90] * (NVLS_CHANNELS - 1) / NVLS_CHANNELS * (2.0 if c.op == "all_reduce" else (n - 1) / n)
        lat = nm.HW_LATENCY_US["nvlink"]["NVLS"][2]
        return nm.algo_time_us(c.nbytes, op=c.op, busbw_gbs=bus, latency_us=lat, n_ranks=n, algorithm="NVLS")
    if gpu.intra_link == "pcie":
        ch, speed = ring_graph(gpu, c)
    else:
        ctas = collective_ctas(gpu, c, "Ring")[0]
        ch = max(1, ctas // 2)
        link = nvlinks(gpu) * nm.NVLINK_BW[90 if gpu.sm_arch >= 90 else 80]
        if nodes > 1:
            link = min(link, nic_gbs(gpu) * max(1, n // nodes))
        speed = link / ch
    bus = nm.model_busbw_gbs(algorithm, protocol, op=c.op, graph_channels=ch, graph_speed=speed, sm_arch=gpu.sm_arch,
                             n_nodes=nodes)
    if algorithm == "Tree":
        lat = nm.tree_latency_us(protocol, n_ranks=n, n_nodes=nodes, intra=intra)
    else:
        lat = nm.ring_latency_us(protocol, op=c.op, n_ranks=n, n_nodes=nodes, intra=intra)
    return nm.algo_time_us(c.nbytes, op=c.op, busbw_gbs=bus, latency_us=lat, n_ranks=n, algorithm=algorithm)


def default_algorithm(gpu: Any, c: Any, algorithms: tuple[str, ...]) -> str:
    """NCCL's choice among ``algorithms`` (those the topology offers) for ``c``: the fastest by its
    model at the protocol it would pick; all-gather and reduce-scatter stay on Ring (NVLS for them
    needs registered buffers in the modelled versions, ``cta_efficiency_applies``)."""
    if algorithms == ("P2P",):
        return "P2P"
    cands = [a for a in algorithms if a in ("Ring", "Tree", "NVLS")]
    if c.op != "all_reduce":
        return "Ring"
    return min(cands, key=lambda a: model_time_us(gpu, c, a, default_protocol(gpu, c, a)))


def default_channels(gpu: Any, c: Any, algorithm: str, protocol: str, threads: int | None) -> tuple[int, int]:
    """(channels, threads) NCCL launches ``c`` with under ``algorithm`` / ``protocol``:
    the communicator's CTAs, then the size rule; ``threads`` None = NCCL's default."""
    if algorithm == "P2P":
        return p2p_channels(gpu, c), threads or nm.MAX_THREADS["Simple"]
    ctas, ring_bus = collective_ctas(gpu, c, algorithm)
    nt = threads or nm.default_threads(protocol, algorithm, ring_busbw_gbs=ring_bus)
    if algorithm == "NVLS":
        return ctas, nt
    return nm.size_rule(c.nbytes, channels=ctas, threads=nt, protocol=protocol, algorithm=algorithm, n_ranks=c.group_size)


UB_CTAS = {(1, "all_gather"): 4, (1, "reduce_scatter"): 5, (2, "all_gather"): 16, (2, "reduce_scatter"): 16}
"""SMs NCCL's kernels take for DP/FSDP gathers and reduce-scatters on registered (symmetric) buffers,
by (one NVLink domain = 1 | NVLink + IB = 2, op): Megatron-Core's ``nccl_ub`` docstring
(``DistributedDataParallelConfig``, ``--use-nccl-ub``): NVL 4/5, NVL+IB 16/16."""


def ub_ctas(gpu: Any, c: Any) -> int | None:
    """CTAs of ``c`` on registered buffers (``--use-nccl-ub``) under NCCL's defaults, or None where
    registration changes nothing modelled: it needs NCCL's symmetric kernels (sm90 NVSwitch
    nodes, NCCL 2.27+) and an all-gather or reduce-scatter."""
    if not (c.registered and gpu.nvswitch and gpu.sm_arch >= 90 and c.op in ("all_gather", "reduce_scatter")):
        return None
    return UB_CTAS[(1 if c.n_nodes == 1 else 2, c.op)]


def latency_us(gpu: Any, c: Any, algorithm: str, protocol: str) -> float:
    """NCCL's own latency model of the call (``nccl.tuning_model``: tuning.cc:384-435): Ring and Tree by
    steps and path, NVLS one 25 us NVLink step (18 us more across nodes). Point-to-point calls,
    which NCCL's model does not cover, take Ring/Simple's base plus one step of their path."""
    intra = "nvlink" if path(gpu, c) in ("nvswitch", "bridge") else "pci"
    n = c.group_size
    if algorithm == "P2P":
        hw = nm.HW_LATENCY_US["net" if c.n_nodes > 1 else intra]["Ring"][2]
        return nm.BASE_LATENCY_US["Ring"][2] + hw
    if algorithm == "NVLS":
        return nm.HW_LATENCY_US["nvlink"]["NVLS"][2] + (nm.HW_LATENCY_US["net"]["NVLS"][2] if c.n_nodes > 1 else 0.0)
    if algorithm == "Tree":
        return nm.tree_latency_us(protocol, n_ranks=n, n_nodes=c.n_nodes, intra=intra)
    return nm.ring_latency_us(protocol, op=c.op, n_ranks=n, n_nodes=c.n_nodes, intra=intra)


def nvls_ok(gpu: Any, c: Any) -> bool:
    """NVLS runs here: an sm90 NVSwitch node, one node, more than two ranks."""
    return gpu.nvswitch and gpu.sm_arch >= 90 and c.n_nodes == 1 and c.group_size > 2


def algorithms(gpu: Any, c: Any) -> tuple[str, ...]:
    """The algorithms NCCL can run for ``c`` here (P2P for point-to-point ops)."""
    if c.op in ("send", "recv", "all_to_all"):
        return ("P2P",)
    algs = ["Ring"]
    if c.op == "all_reduce":
        algs.append("Tree")
    if nvls_ok(gpu, c) and c.op in ("all_reduce", "all_gather", "reduce_scatter"):
        algs.append("NVLS")
    return tuple(algs)


def cta_efficiency_applies(gpu: Any, c: Any) -> bool:
    """Whether ``NCCL_CTA_POLICY=EFFICIENCY`` changes anything for ``c``.

    NCCL 2.27+ acts on the policy in one place (``src/enqueue.cc:2152-2170``, NCCL 2.30.7): with
    no tuner plugin, no NCCL_ALGO / NCCL_PROTO, an all-gather or reduce-scatter on *registered*
    user buffers, and NVLS available (one NVSwitch node on sm90+), it switches to NVLS / Simple
    with the channels NVLS registration needs. Everything else keeps NCCL's default. Megatron-Core
    registers its buffers only with NCCL user buffers enabled (``--use-nccl-ub``).
    """
    return c.registered and nvls_ok(gpu, c) and c.op in ("all_gather", "reduce_scatter")
