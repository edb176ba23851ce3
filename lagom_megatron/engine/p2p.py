"""CTAs NCCL runs a point-to-point call on (no tuner is asked; all-to-all is lowered to send/recv), elementwise;
NVIDIA/nccl v2.30.7 unless said otherwise: 1. ``comm->nChannels`` is cut to ``maxCTAs`` and duplicated to ``minCTAs``
(src/graph/connect.cc:494-505); 2. ``p2p_channels``, 3. ``peer_channels``, 4. ``task_channels``, 5. ``kernel_ctas``."""

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
"""``NCCL_P2P_NVL_CHUNKSIZE``, ``_PCI_``, ``_NET_`` defaults, bytes (``src/init.cc:818-820``)."""


def pow2_up(x: Any) -> np.ndarray:
    """Smallest power of two >= ``x`` (>= 1), elementwise: NCCL's ``pow2Up``."""
    x = np.maximum(np.asarray(x, dtype=float), 1.0)
    return np.exp2(np.ceil(np.log2(x)))


def p2p_channels(
    comm_channels: Any, *, min_p2p: int = 1, max_p2p: int = MAXCHANNELS, rounded: bool = True
) -> np.ndarray:
    """``comm->p2pnChannels``: within ``NCCL_MIN/MAX_P2P_NCHANNELS``, power of two unless not ``rounded``, <= 64
    (src/graph/paths.cc:977-991; v2.27.5 paths.cc:842-866); those above ``nChannels`` serve P2P only (:1007)."""
    c = np.maximum(np.minimum(np.asarray(comm_channels, dtype=float), float(max_p2p)), float(min_p2p))
    return np.minimum(pow2_up(c), float(MAXCHANNELS)) if rounded else c


def link_kind(*, intra_link: str, n_nodes: Any) -> np.ndarray:
    """P2P transport per ``n_nodes``: ``net`` across nodes, else ``intra_link``; it picks ``P2P_CHUNK_BYTES``."""
    return np.where(np.asarray(n_nodes) > 1, "net", intra_link)


def peer_channels(
    *,
    p2p: Any,
    n_nodes: Any,
    group_size: Any,
    intra_link: str,
    sm_arch: int,
    nvlink_gbps: float,
    nics_per_gpu: int = 1,
    nic_gbps: float = 25.0,
    net_peer_channels: Any = None,
    nccl: tuple[int, int, int] = (2, 30, 7),
    comm_channels: Any = None,
) -> np.ndarray:
    """``comm->p2pnChannelsPerPeer``, elementwise: a power of two <= ``p2p``. Least over peers (paths.cc:918-954):
    NVLink 2 x max(1, path / link bw), PCIe 2, network ``net_peer_channels`` (2.28+; overridden by
    NCCL_NCHANNELS_PER_NET_PEER, src/init.cc:2038-2047) else >= NICs and divUp(netBw, 14) (2.29+,
    src/graph/topo.cc:1974-2000); rounded up, halved across nodes while perPeer x ceil(peers / 8) > ``p2p``
    (paths.cc:961-1003). NCCL 2.21-2.28 (v2.27.5 paths.cc:798-867): 2 per network peer, 1 where 2 nRanks > 4 x
    unrounded ``p2p`` (``comm_channels``), at least the NICs."""
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
    unrounded = p2p if comm_channels is None else p2p_channels(comm_channels, rounded=False)
    net_auto = np.where(2.0 * ranks > 4.0 * unrounded, 1.0, 2.0)
    net_auto = np.maximum(net_auto, float(nics_per_gpu))
    net = np.where(npc_set, npc if npc is not None else 0.0, net_auto)
    least = np.minimum(p2p, np.where(multi, np.where(has_local_peer, np.minimum(intra, net), net), intra))
    return np.minimum(pow2_up(least), p2p)


def task_channels(nbytes: Any, *, per_peer: Any, p2p: Any, n_ranks: Any, chunk: Any, multi_node: Any) -> np.ndarray:
    """Channels of one send or receive task of ``nbytes``, elementwise (src/enqueue.cc:1141-1146, 915-925);
    parts of ``chunk`` / 8 .. x32 in a node, / 2 .. x1 across nodes (src/init.cc:818-843)."""
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
    """CTAs of one call's P2P kernel: one per channel its ``tasks`` use, <= ``p2p`` (src/include/channel.h:21-33)."""
    return np.minimum(
        np.asarray(p2p, dtype=float), np.asarray(task_ch, dtype=float) * np.maximum(np.asarray(tasks, dtype=float), 1.0)
    )


class P2PModel:
    """The P2P rule for one cost model's sites; nodes are NCCL's, one per NVLink domain (src/init.cc:830-837)."""

    def __init__(
        self,
        cluster: Any,
        *,
        op_p2p_S: np.ndarray,
        a2a_S: np.ndarray,
        nbytes_S: np.ndarray,
        group_size_S: np.ndarray,
        n_nodes_S: np.ndarray,
    ) -> None:
        self.mask_S = np.asarray(op_p2p_S, dtype=bool)
        self.any = bool(self.mask_S.any())
        self.cluster = cluster
        self.ranks_S = np.maximum(np.asarray(group_size_S, dtype=float), 1.0)
        nccl_nodes = getattr(cluster, "nccl_nodes", None)
        self.nodes_S = np.array(
            [
                float(nccl_nodes(int(h), int(r)) if nccl_nodes else h)
                for h, r in zip(np.asarray(n_nodes_S, dtype=float).ravel(), self.ranks_S.ravel())
            ]
        )
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
        """CTAs of the P2P kernel of sites ``i`` on a communicator of ``comm_channels`` channels."""
        c = self.cluster
        p2p = p2p_channels(comm_channels)
        per = peer_channels(
            p2p=p2p,
            n_nodes=self.nodes_S[i],
            group_size=self.ranks_S[i],
            intra_link=getattr(c, "intra_link", "nvlink"),
            sm_arch=int(c.sm_arch),
            nvlink_gbps=float(c.nvlink_gbps_per_gpu),
            nics_per_gpu=self.nics_per_gpu,
            nic_gbps=self.nic_gbps,
            net_peer_channels=self.net_peer_S[i],
            nccl=c.nccl,
            comm_channels=comm_channels,
        )
        task = task_channels(
            self.task_bytes_S[i],
            per_peer=per,
            p2p=p2p,
            n_ranks=self.ranks_S[i],
            chunk=self.chunk_S[i],
            multi_node=self.nodes_S[i] > 1,
        )
        return kernel_ctas(task, tasks=self.tasks_S[i], p2p=p2p)
