"""How many channels (CTAs) NCCL runs a point-to-point call on, and how a communicator's CTA bounds
and ``nChannelsPerNetPeer`` reach that count.

NCCL never asks the tuner plugin about send/recv, and all-to-all is lowered to send/recv, so the
only per-communicator handles on these calls are the communicator's channel count and, across
nodes, its channels per network peer. NCCL derives the P2P channel count in five steps (NVIDIA/nccl
v2.30.7 unless a line says otherwise):

1. ``comm->nChannels``: the topology's count, cut to ``maxCTAs`` and duplicated up to ``minCTAs``
   (``src/graph/connect.cc:494-505``). A pool entry made with ``min_ctas = max_ctas = n`` has
   exactly ``n`` channels.
2. ``comm->p2pnChannels = min(nChannels, NCCL_MAX_P2P_NCHANNELS)``, at least
   ``NCCL_MIN_P2P_NCHANNELS``, rounded up to a power of two, at most 64 (``src/graph/paths.cc:977-991``;
   v2.27.5 ``paths.cc:842-866``). The channels above ``nChannels`` are initialised for P2P only
   (``paths.cc:1007``), so a bound of 6 gives 8 P2P channels.
3. ``comm->p2pnChannelsPerPeer``: the least over the communicator's peers of the channels its path
   wants (``ncclTopoGetNchannels``, ``paths.cc:918-954``): NVLink ``2 x max(1, path bw / link bw)``,
   PCIe 2, a network peer ``nChannelsPerNetPeer`` when set (``ncclConfig_t`` field, NCCL 2.28+;
   ``NCCL_NCHANNELS_PER_NET_PEER`` overrides it, ``src/init.cc:2038-2047``), else at least one per
   NIC and ``divUp((int)netBw, NCCL_P2P_PER_CHANNEL_NET_BW = 14)`` with ``netBw`` the sum of the
   GPU's NICs (``ncclTopoGetLocalNetCountByBw``, ``src/graph/topo.cc:1974-2000``; NCCL 2.29+).
   Rounded up to a power of two; across nodes without ``nChannelsPerNetPeer`` halved until
   ``perPeer x ceil(peers / 8) <= p2pnChannels``, else cut to ``p2pnChannels`` (``paths.cc:961-1003``).
   NCCL 2.21-2.28 instead start the network peer at 2, halve it while ``2 x nRanks > 4 x
   p2pnChannels`` (the count of step 2 before its rounding: the rule runs inside
   ``ncclTopoComputeP2pChannels`` before ``pow2Up``), keep at least the NIC count, and cut the least
   at ``p2pnChannels`` (v2.27.5 ``paths.cc:798-867``).

Nodes are NCCL's (``comm->nNodes``): one per NVLink domain (``ClusterSpec.nccl_nodes``), so hosts
of one multi-node NVLink domain are NVLink peers here and use the NVLink chunk (``src/init.cc:830-837``).
4. Per send or receive task, ``nChannelsMin`` = ``perPeer`` halved while ``nChannelsMin x nRanks >
   p2pnChannels`` (``src/enqueue.cc:1141-1146``); a task takes ``min(nChannelsMin, ceil(bytes /
   minPart))`` channels, doubled while a part exceeds ``maxPart`` and the count stays within
   ``perPeer`` (``enqueue.cc:915-925``), with ``minPart`` / ``maxPart`` = chunk / 8 and chunk x 32
   inside a node, chunk / 2 and chunk across nodes, chunk = ``NCCL_P2P_NVL_CHUNKSIZE`` (512 KiB) on
   NVLink, ``NCCL_P2P_PCI_CHUNKSIZE`` (128 KiB) on PCIe, ``NCCL_P2P_NET_CHUNKSIZE`` (128 KiB) across
   nodes (``src/init.cc:818-843``).
5. The tasks of one call start at different channels (``ncclP2pChannelBaseForRound``,
   ``src/include/channel.h:21-33``) and the kernel runs one CTA per channel used, at most
   ``p2pnChannels``.

All functions are elementwise over numpy arrays (the cost model's hot path) and accept scalars.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAXCHANNELS = 64
"""``MAXCHANNELS`` (``src/include/device.h:91``): the most channels a communicator has."""
P2P_PER_CHANNEL_NET_GBS = 14.0
"""``NCCL_P2P_PER_CHANNEL_NET_BW`` default, GB/s per channel to a network peer (NCCL 2.29+, ``paths.cc:918``)."""
WORK_P2P_PER_BATCH = 8
"""``NCCL_MAX_DEV_WORK_P2P_PER_BATCH`` (``src/include/device.h:391``): P2P tasks one channel runs at once."""
NVLINK_LINK_GBS: dict[int, float] = {60: 18.0, 70: 20.0, 80: 20.0, 86: 12.0, 90: 20.6, 100: 40.1}
"""NCCL's bandwidth of one NVLink by compute capability (``SM*_NVLINK_BW``, ``src/graph/topo.h:19-24``)."""
P2P_CHUNK_BYTES: dict[str, int] = {"nvlink": 1 << 19, "pcie": 1 << 17, "net": 1 << 17}
"""``NCCL_P2P_NVL_CHUNKSIZE``, ``NCCL_P2P_PCI_CHUNKSIZE``, ``NCCL_P2P_NET_CHUNKSIZE`` defaults, bytes (``src/init.cc:818-820``)."""


def pow2_up(x: Any) -> np.ndarray:
    """Smallest power of two >= ``x`` (>= 1), elementwise: NCCL's ``pow2Up``."""
    x = np.maximum(np.asarray(x, dtype=float), 1.0)
    return np.exp2(np.ceil(np.log2(x)))


def p2p_channels(comm_channels: Any, *, min_p2p: int = 1, max_p2p: int = MAXCHANNELS, rounded: bool = True) -> np.ndarray:
    """``comm->p2pnChannels`` of a communicator with ``comm_channels`` channels (step 2 of the module
    docstring; ``min_p2p`` / ``max_p2p``: ``NCCL_MIN_P2P_NCHANNELS`` / ``NCCL_MAX_P2P_NCHANNELS``);
    ``rounded`` False: the count before its rounding to a power of two."""
    c = np.maximum(np.minimum(np.asarray(comm_channels, dtype=float), float(max_p2p)), float(min_p2p))
    return np.minimum(pow2_up(c), float(MAXCHANNELS)) if rounded else c


def link_kind(*, intra_link: str, n_nodes: Any) -> np.ndarray:
    """Transport of a communicator's P2P: ``net`` across nodes, else the node's link (``nvlink`` or
    ``pcie``), elementwise over ``n_nodes``. It picks the default P2P chunk (``P2P_CHUNK_BYTES``)."""
    return np.where(np.asarray(n_nodes) > 1, "net", intra_link)


def peer_channels(*, p2p: Any, n_nodes: Any, group_size: Any, intra_link: str, sm_arch: int, nvlink_gbps: float,
                  nics_per_gpu: int = 1, nic_gbps: float = 25.0, net_peer_channels: Any = None,
                  nccl: tuple[int, int, int] = (2, 30, 7), comm_channels: Any = None) -> np.ndarray:
    """``comm->p2pnChannelsPerPeer`` (step 3 of the module docstring), elementwise.

    Args:
        p2p: ``p2p_channels`` of the communicator.
        n_nodes, group_size: nodes and ranks of the communicator (its peers are on other GPUs of
            the node and, with ``n_nodes`` > 1, across the network).
        intra_link: ``nvlink`` or ``pcie`` (``ClusterSpec.intra_link``).
        sm_arch, nvlink_gbps: the NVLink path's bandwidth in link units (``NVLINK_LINK_GBS``).
        nics_per_gpu, nic_gbps: NICs nearest each GPU and one NIC's GB/s (NCCL sums them).
        net_peer_channels: ``nChannelsPerNetPeer`` (None or 0 = unset).
        nccl: NCCL version (the network rule changed in 2.29).
        comm_channels: the communicator's channels, for NCCL 2.21-2.28's comparison with the
            unrounded ``p2pnChannels``; None = ``p2p``.

    Returns:
        Channels per peer, a power of two, <= ``p2p``.
    """
    p2p = np.asarray(p2p, dtype=float)
    multi = np.asarray(n_nodes) > 1
    ranks = np.maximum(np.asarray(group_size, dtype=float), 1.0)
    local_ranks = ranks / np.maximum(np.asarray(n_nodes, dtype=float), 1.0)
    if intra_link == "pcie":
        intra = 2.0
    else:
        link = NVLINK_LINK_GBS.get(sm_arch, NVLINK_LINK_GBS[90 if sm_arch >= 90 else 80])
        intra = 2.0 * max(1, int(nvlink_gbps / link))
    has_local_peer = local_ranks > 1
    npc = None if net_peer_channels is None else np.asarray(net_peer_channels, dtype=float)
    npc_set = np.zeros(np.shape(p2p), dtype=bool) if npc is None else npc > 0
    if nccl >= (2, 29, 0):
        net_bw = int(nics_per_gpu * nic_gbps)  # (int)netBw: the GPU's NICs together (topo.cc:1993-1998)
        net_auto = max(float(nics_per_gpu), float(-(-net_bw // int(P2P_PER_CHANNEL_NET_GBS))))
        net = np.where(npc_set, npc if npc is not None else 0.0, net_auto)
        least = np.where(multi, np.where(has_local_peer, np.minimum(intra, net), net), intra)
        per = pow2_up(least)
        spread = np.ceil(ranks / WORK_P2P_PER_BATCH)  # maxP2pPeers = nRanks unless configured
        reduce = multi & ~npc_set
        # halve while perPeer x ceil(peers / 8) > p2pnChannels (paths.cc:993-1001)
        steps = np.maximum(0.0, np.ceil(np.log2(np.maximum(per * spread / np.maximum(p2p, 1.0), 1.0))))
        reduced = np.maximum(1.0, per / np.exp2(steps))
        return np.where(reduce, reduced, np.minimum(p2p, per))
    # NCCL 2.21-2.28 (v2.27.5 paths.cc:798-867): 2 per network peer, 1 where 2 x nRanks > 4 x
    # p2pnChannels (NCCL compares with the count before its power-of-two rounding), at least the NICs
    unrounded = p2p if comm_channels is None else p2p_channels(comm_channels, rounded=False)
    net_auto = np.where(2.0 * ranks > 4.0 * unrounded, 1.0, 2.0)
    net_auto = np.maximum(net_auto, float(nics_per_gpu))
    net = np.where(npc_set, npc if npc is not None else 0.0, net_auto)
    least = np.minimum(p2p, np.where(multi, np.where(has_local_peer, np.minimum(intra, net), net), intra))
    return np.minimum(pow2_up(least), p2p)


def task_channels(nbytes: Any, *, per_peer: Any, p2p: Any, n_ranks: Any, chunk: Any, multi_node: Any) -> np.ndarray:
    """Channels of one send or receive task of ``nbytes`` (step 4 of the module docstring), elementwise.

    ``chunk`` is the communicator's P2P chunk (``P2P_CHUNK_BYTES`` of its transport unless a
    variable sets it); ``multi_node`` picks the network's part sizes.
    """
    per = np.asarray(per_peer, dtype=float)
    p2p = np.asarray(p2p, dtype=float)
    ranks = np.maximum(np.asarray(n_ranks, dtype=float), 1.0)
    # nChannelsMin: perPeer halved while nChannelsMin * nRanks > p2pnChannels, never below 1
    halvings = np.maximum(0.0, np.ceil(np.log2(np.maximum(per * ranks / np.maximum(p2p, 1.0), 1.0))))
    cmin = np.maximum(1.0, per / np.exp2(halvings))
    chunk = np.asarray(chunk, dtype=float)
    multi = np.asarray(multi_node, dtype=bool)
    min_part = np.where(multi, chunk / 2.0, chunk / 8.0)
    max_part = np.where(multi, chunk, chunk * 32.0)
    nb = np.maximum(np.asarray(nbytes, dtype=float), 1.0)
    c = np.minimum(cmin, np.ceil(nb / min_part))
    part = np.maximum(min_part, np.ceil(nb / c))
    # doubled while the part exceeds maxPart and the count can double within perPeer
    need = np.maximum(0.0, np.ceil(np.log2(np.maximum(part / max_part, 1.0))))
    room = np.maximum(0.0, np.floor(np.log2(np.maximum(per / c, 1.0))))
    return c * np.exp2(np.minimum(need, room))


def kernel_ctas(task_ch: Any, *, tasks: Any, p2p: Any) -> np.ndarray:
    """CTAs of the P2P kernel of one call whose ``tasks`` tasks take ``task_ch`` channels each: one per
    channel used, at most ``p2pnChannels`` (step 5 of the module docstring; tasks of successive
    rounds start at different channels)."""
    return np.minimum(np.asarray(p2p, dtype=float), np.asarray(task_ch, dtype=float) * np.maximum(np.asarray(tasks, dtype=float), 1.0))


class P2PModel:
    """The P2P channel rule of the module docstring for the point-to-point sites of one cost model.

    Args:
        cluster: the ``ClusterSpec`` (link, NVLink bandwidth, NICs, NCCL version).
        op_p2p_S, a2a_S: per site, whether its op runs as P2P, and whether it is an all-to-all
            (one task per rank of the group) rather than one send or receive.
        nbytes_S, group_size_S, n_nodes_S: per site, one call's bytes, the group's ranks and nodes.

    ``net_peer_S`` (per site ``nChannelsPerNetPeer``, 0 = unset) and ``chunk_S`` (per site P2P chunk,
    bytes) start at NCCL's defaults and may be set by the layer that decides those knobs.
    """

    def __init__(self, cluster: Any, *, op_p2p_S: np.ndarray, a2a_S: np.ndarray, nbytes_S: np.ndarray,
                 group_size_S: np.ndarray, n_nodes_S: np.ndarray) -> None:
        self.mask_S = np.asarray(op_p2p_S, dtype=bool)
        self.any = bool(self.mask_S.any())
        self.cluster = cluster
        self.ranks_S = np.maximum(np.asarray(group_size_S, dtype=float), 1.0)
        nccl_nodes = getattr(cluster, "nccl_nodes", None)  # NCCL's nodes: NVLink domains (module docstring)
        self.nodes_S = np.array([float(nccl_nodes(int(h), int(r)) if nccl_nodes else h)
                                 for h, r in zip(np.asarray(n_nodes_S, dtype=float).ravel(), self.ranks_S.ravel())])
        self.tasks_S = np.where(a2a_S, self.ranks_S, 1.0)
        self.task_bytes_S = np.asarray(nbytes_S, dtype=float) / np.where(a2a_S, self.ranks_S, 1.0)
        intra = getattr(cluster, "intra_link", "nvlink")
        self.kind_S = link_kind(intra_link=intra, n_nodes=self.nodes_S)
        self.chunk_S = np.array([float(P2P_CHUNK_BYTES[str(k)]) for k in self.kind_S])
        self.net_peer_S = np.zeros(len(self.mask_S))
        nics = getattr(cluster, "nics_per_node", None)
        gpn = max(1, int(cluster.gpus_per_node))
        self.nics_per_gpu = 1 if nics is None else max(1, int(nics) // gpn)
        self.nic_gbps = float(cluster.net_gbps_per_gpu) * (gpn / int(nics) if nics else 1.0)

    def ctas(self, i: Any, comm_channels: Any) -> np.ndarray:
        """CTAs of the P2P kernel of sites ``i`` on a communicator with ``comm_channels`` channels
        (broadcast like the cost model's codes)."""
        c = self.cluster
        p2p = p2p_channels(comm_channels)
        per = peer_channels(p2p=p2p, n_nodes=self.nodes_S[i], group_size=self.ranks_S[i],
                            intra_link=getattr(c, "intra_link", "nvlink"), sm_arch=int(c.sm_arch),
                            nvlink_gbps=float(c.nvlink_gbps_per_gpu), nics_per_gpu=self.nics_per_gpu,
                            nic_gbps=self.nic_gbps, net_peer_channels=self.net_peer_S[i], nccl=c.nccl,
                            comm_channels=comm_channels)
        task = task_channels(self.task_bytes_S[i], per_peer=per, p2p=p2p, n_ranks=self.ranks_S[i],
                             chunk=self.chunk_S[i], multi_node=self.nodes_S[i] > 1)
        return kernel_ctas(task, tasks=self.tasks_S[i], p2p=p2p)
