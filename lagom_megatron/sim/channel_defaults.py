"""What NCCL v2.30.7 runs by default on a simulated topology (algorithm, protocol, channels, threads). PCIe Gen4 x16 =
24 GB/s (topo.cc:545-556); ring search 2 x 12 GB/s (search.cc:1198, 1245), CTAs doubled (connect.cc:460): PCIe 4 CTAs,
bridged pairs 8; bridge 4 links x 12 GB/s (topo.h:23). Across nodes the GPU-NIC path caps each ring (100 Gb/s NIC:
2 CTAs, 256 threads, tuning.cc:244-245; nccl#689). NVSwitch: INFO logs 24 (DGX A100) / 32 (DGX H100) coll channels,
~16 across nodes (nccl#689); NVLS 16 (``nvlsChannels`` sm90, 2.26+). Size rule: enqueue.cc:2093-2105; P2P:
paths.cc:919-1004, enqueue.cc:918-925, 1143-1146."""

from __future__ import annotations

from typing import Any

from lagom_megatron.engine import p2p as p2p_rule
from lagom_megatron.sim import tuning_model as nm

NVSWITCH_CHANNELS = {90: 32, 80: 24}
"""Collective CTAs in one NVSwitch node by SM arch (NCCL INFO logs of DGX H100 / DGX A100)."""
NVLINK_INTER_NODE_CHANNELS = 16
"""Collective CTAs across NVSwitch nodes with one NIC per GPU (nccl#689)."""
NVLS_CHANNELS = 16
"""NVLS CTAs on sm90 (``NCCL_NVLS_NCHANNELS`` default in 2.26)."""


def nvlinks(gpu: Any) -> int:
    """NVLink links per GPU (NVSwitch or bridge), from datasheet GB/s per link."""
    arch = 86 if gpu.sm_arch == 86 else (90 if gpu.sm_arch >= 90 else 80)
    gbs = gpu.bridge_gbs if gpu.intra_link == "pcie" else gpu.nvlink_gbs
    return max(0, round(gbs / nm.NVLINK_LINK_GBS[arch]))


def path(gpu: Any, c: Any) -> str:
    """``nvswitch``, ``bridge`` (one NVLink-bridged pair), ``bridged`` (ring alternating bridge / PCIe) or ``pcie``."""
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
    nics = gpu.nics_per_node or gpu.gpus_per_node
    return gpu.net_gbs * gpu.gpus_per_node / nics


def ring_graph(gpu: Any, c: Any) -> tuple[int, float]:
    """NCCL's ring graph for ``c`` on a PCIe-class node: (search channels, speed GB/s)."""
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
    """A communicator's CTAs for ``algorithm`` before the size rule, and its ring graph's channels x speed."""
    if algorithm == "NVLS":
        return NVLS_CHANNELS, 1e9
    if gpu.intra_link != "pcie":
        n = NVSWITCH_CHANNELS[90 if gpu.sm_arch >= 90 else 80] if c.n_nodes == 1 else NVLINK_INTER_NODE_CHANNELS
        return min(n, gpu.max_channels), 1e9
    ch, speed = ring_graph(gpu, c)
    return nm.comm_ctas(ch, max_channels=gpu.max_channels), ch * speed


def p2p_channels(gpu: Any, c: Any, *, cta_bound: int | None = None, net_peer: int | None = None) -> int:
    """CTAs of one send/recv or all-to-all (``src/graph/paths.cc:918-1007``, ``src/enqueue.cc:915-925, 1141-1146``).
    ``cta_bound``: a pool entry's ``minCTAs = maxCTAs`` (``p2pnChannels = pow2Up(nChannels)``, paths.cc:984-990);
    ``net_peer``: ``NCCL_NCHANNELS_PER_NET_PEER``. A bridged pair is all NVLink (``src/init.cc:830-837``)."""
    comm = cta_bound if cta_bound is not None else collective_ctas(gpu, c, "Ring")[0]
    comm = min(max(1, int(comm)), gpu.max_channels)
    p2p = p2p_rule.p2p_channels(comm)
    link = path(gpu, c)
    nvl = link in ("nvswitch", "bridge")
    nics = gpu.nics_per_node
    per = p2p_rule.peer_channels(
        p2p=p2p,
        n_nodes=c.n_nodes,
        group_size=c.group_size,
        intra_link="nvlink" if nvl else "pcie",
        sm_arch=gpu.sm_arch,
        nvlink_gbps=gpu.nvlink_gbs if link == "nvswitch" else gpu.bridge_gbs,
        nics_per_gpu=1 if nics is None else max(1, nics // gpu.gpus_per_node),
        nic_gbps=nic_gbs(gpu),
        net_peer_channels=net_peer,
        nccl=gpu.nccl,
        comm_channels=comm,
    )
    a2a = c.op == "all_to_all"
    ranks = max(1, c.group_size)
    chunk = p2p_rule.P2P_CHUNK_BYTES["net" if c.n_nodes > 1 else ("nvlink" if nvl else "pcie")]
    task = p2p_rule.task_channels(
        c.nbytes / ranks if a2a else c.nbytes,
        per_peer=per,
        p2p=p2p,
        n_ranks=ranks,
        chunk=chunk,
        multi_node=c.n_nodes > 1,
    )
    return int(p2p_rule.kernel_ctas(task, tasks=ranks if a2a else 1, p2p=p2p))


def default_protocol(gpu: Any, c: Any, algorithm: str) -> str:
    """The protocol NCCL's model predicts fastest for ``c`` among those enabled (NVLS: Simple, tuning.cc:301)."""
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
    """NCCL's predicted time (us) for ``c`` (``tuning_model.algo_time_us``) on its graph of this topology."""
    n, nodes = c.group_size, c.n_nodes
    intra = "nvlink" if path(gpu, c) in ("nvswitch", "bridge") else "pci"
    if algorithm == "NVLS":
        link = nvlinks(gpu) * nm.NVLINK_BW[90]
        bus = (
            link
            * nm.NVLS_EFFICIENCY[90]
            * (NVLS_CHANNELS - 1)
            / NVLS_CHANNELS
            * (2.0 if c.op == "all_reduce" else (n - 1) / n)
        )
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
    bus = nm.model_busbw_gbs(
        algorithm, protocol, op=c.op, graph_channels=ch, graph_speed=speed, sm_arch=gpu.sm_arch, n_nodes=nodes
    )
    if algorithm == "Tree":
        lat = nm.tree_latency_us(protocol, n_ranks=n, n_nodes=nodes, intra=intra)
    else:
        lat = nm.ring_latency_us(protocol, op=c.op, n_ranks=n, n_nodes=nodes, intra=intra)
    return nm.algo_time_us(c.nbytes, op=c.op, busbw_gbs=bus, latency_us=lat, n_ranks=n, algorithm=algorithm)


def default_algorithm(gpu: Any, c: Any, algorithms: tuple[str, ...]) -> str:
    """NCCL's model's choice among ``algorithms`` for ``c``; all-gather / reduce-scatter stay on Ring."""
    if algorithms == ("P2P",):
        return "P2P"
    cands = [a for a in algorithms if a in ("Ring", "Tree", "NVLS")]
    if c.op != "all_reduce":
        return "Ring"
    return min(cands, key=lambda a: model_time_us(gpu, c, a, default_protocol(gpu, c, a)))


def default_channels(gpu: Any, c: Any, algorithm: str, protocol: str, threads: int | None) -> tuple[int, int]:
    """(channels, threads) NCCL launches ``c`` with: the communicator's CTAs, then the size rule."""
    if algorithm == "P2P":
        return p2p_channels(gpu, c), threads or nm.MAX_THREADS["Simple"]
    ctas, ring_bus = collective_ctas(gpu, c, algorithm)
    nt = threads or nm.default_threads(protocol, algorithm, ring_busbw_gbs=ring_bus)
    if algorithm == "NVLS":
        return ctas, nt
    return nm.size_rule(
        c.nbytes, channels=ctas, threads=nt, protocol=protocol, algorithm=algorithm, n_ranks=c.group_size
    )


def low_sm_path(gpu: Any, c: Any, *, copy_engine: bool = False) -> Any:
    """What NCCL runs ``c`` on when its buffers are registered (``engine.registered``: NCCL's own estimates): with
    ``copy_engine`` (CTA policy ZERO) an all-gather inside one NVSwitch node runs on copy engines (NCCL 2.28+,
    ``ce_coll.cc:93-131`` @v2.30.7); otherwise NCCL's symmetric kernel on an sm90+ NVSwitch node (2.27+,
    ``sym_kernels.cc:591-597``; across nodes they need GIN kernels, not modelled). None: NCCL's usual algorithms."""
    from lagom_megatron.engine.registered import copy_engine_all_gather, symmetric_kernel

    if not (c.registered and gpu.nvswitch and c.n_nodes == 1 and gpu.nccl >= (2, 27, 0)):
        return None
    multicast = gpu.sm_arch >= 90 and c.group_size > 2
    if copy_engine and c.op == "all_gather" and gpu.nccl >= (2, 28, 0):
        return copy_engine_all_gather(n_ranks=c.group_size, nbytes=c.nbytes, sm_arch=gpu.sm_arch, multicast=multicast)
    if gpu.sm_arch < 90 or c.op not in ("all_reduce", "all_gather", "reduce_scatter"):
        return None
    return symmetric_kernel(c.op, n_ranks=c.group_size, nbytes=c.nbytes, sm_arch=gpu.sm_arch, multicast=multicast)


def latency_us(gpu: Any, c: Any, algorithm: str, protocol: str) -> float:
    """NCCL's latency model (us) of the call (tuning.cc:384-435); P2P: Ring/Simple base plus one step of its path."""
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
    """``NCCL_CTA_POLICY=EFFICIENCY`` acts: registered NVLS AG/RS; no tuner, ALGO, PROTO (src/enqueue.cc:2152-2170)."""
    return c.registered and nvls_ok(gpu, c) and c.op in ("all_gather", "reduce_scatter")
