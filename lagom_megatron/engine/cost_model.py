"""Cost model of an overlap region (docs/engine.md; fit: ``fit.py``; ours), us, GB/s; gloo: threads = CTAs, DRAM = HBM.
T_region = max(T_comm, T_comp + T_comm s / (1 + s));  T_comm = calls (alpha latency + beta wire_bytes / bw)
bw = softmin(n_eff per_channel_bw, link_bw);  s = a n_eff / (SMs - n_eff) + b hbm_bytes / T_comm / HBM bw"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lagom_megatron.engine import cost_terms
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_terms import (  # noqa: F401  (re-exported: the model's constants and terms)
    _A2A,
    _AG,
    _ALG_CH_MULT,
    _ALG_HBM,
    _ALG_LINK_EFF,
    _AR,
    _BCAST,
    _CNCHAIN,
    _CNDIRECT,
    _LL,
    _LL128,
    _NVLS,
    _NVLSTREE,
    _OP,
    _PAT,
    _PROTO_CH_EFF,
    _PROTO_CHUNK_HALF,
    _PROTO_DEFAULT_CHUNK,
    _PROTO_HBM,
    _PROTO_LAT,
    _PROTO_LINK_EFF,
    _RECV,
    _RING,
    _RS,
    _SEND,
    _SIMPLE,
    _TREE,
    ALG_NONE,
    CHUNK_L2_FLOOR,
    DEFAULT_THREADS,
    GLOO_CALL_US,
    MAX_CALL_LEVELS,
    NCCL_BASE_LATENCY_US,
    NVLS_ALLREDUCE_LINK,
    NVLS_GATHER_MULT,
    PER_CHANNEL_PRIOR_GBS,
    PRIOR_A,
    PRIOR_B,
    PROTO_NONE,
    RING_SIMPLE_CHUNK_STEPS,
    SOFTMIN_P,
    _softmin,
    call_levels,
    region_time_us,
    sm_term,
    wire_bytes,
)
from lagom_megatron.engine.knobs import ALGORITHMS, GLOO_DEFAULT_THREADS, PROTOCOLS, CommConfig, max_channels
from lagom_megatron.engine.p2p import P2PModel
from lagom_megatron.engine.profile import CollectiveSite


@dataclass
class CostModel:
    """A fitted cost model for fixed sites on one cluster (``fit.fit_cost_model`` or ``from_priors``)."""

    cluster: ClusterSpec
    backend: str
    sites: list[CollectiveSite]
    t_comp_us_S: np.ndarray
    alpha_S: np.ndarray
    beta_S: np.ndarray
    a_S: np.ndarray
    b_S: np.ndarray
    gamma_S: np.ndarray | None = None
    """Per-channel bandwidth relative to the ClusterSpec prior; 1 if None."""
    corr_SC: np.ndarray | None = None
    """Per site and channel count 0..64, a factor on s (``fit._channel_correction``); none if None."""
    queued_S: np.ndarray | None = None
    comp_levels_SL: np.ndarray | None = None
    """Shape (S, L), L <= ``MAX_CALL_LEVELS``: compute alone (us) of one call per level; None: one region per site."""
    comp_weights_SL: np.ndarray | None = None
    """Calls per iteration each level stands for (a row sums to the site's calls)."""
    slow_SL: np.ndarray | None = None
    wait_S: np.ndarray | None = None
    """Per site, us per iteration its collectives wait for SMs at normal priority (in T_comm; ``queues``)."""
    offset_S: np.ndarray | None = None
    """Per site, us other groups' collectives add to its window (``cross.window_offsets``)."""
    hp_S: np.ndarray | None = None
    call_level: list = field(default_factory=list)
    mape: float = float("nan")
    """T_region MAPE on the fitted samples, % (``mape_comm``: T_comm's; ``wape``: sum |error| / sum measured)."""
    mape_comm: float = float("nan")
    wape: float = float("nan")
    mape_floor: float = float("nan")
    """Lowest T_region MAPE this model form can reach on the fitted samples (``_indistinct_keys`` groups), %."""
    n_points: int = 0
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {s.site_id: i for i, s in enumerate(self.sites)}
        c, sites = self.cluster, self.sites
        self.op_S = np.array([_OP[s.op] for s in sites], dtype=np.int64)
        self.nbytes_S = np.array([float(s.nbytes) for s in sites])
        self.n_S = np.array([float(max(s.group_size, 1)) for s in sites])
        self.nodes_S = np.array([float(s.n_nodes) for s in sites])
        self.calls_S = np.array([float(s.calls_per_iter) for s in sites])
        inter = self.nodes_S > 1
        # bus bandwidth across nodes: NIC share x ranks per node, capped by the intra-node link; P2P: one GPU's share
        per_node = np.maximum(1.0, np.floor(self.n_S / np.maximum(self.nodes_S, 1.0)))
        p2p = np.isin(self.op_S, [_A2A, _SEND, _RECV])
        net = np.where(p2p, c.net_gbps_per_gpu, np.minimum(c.nvlink_gbps_per_gpu, c.net_gbps_per_gpu * per_node))
        self.link_S = np.where(inter, net, c.nvlink_gbps_per_gpu)
        self.hop_S = np.where(inter, c.net_latency_us, c.nvlink_latency_us)
        self.gloo = self.backend == "gloo"
        measured = (getattr(c, "per_channel_gbps", None) or {}).get("Simple")
        self.pcb = (
            c.nvlink_gbps_per_gpu / 2.0
            if self.gloo
            else float(measured)
            if measured
            else PER_CHANNEL_PRIOR_GBS[90 if c.sm_arch >= 90 else 80]
        )
        self.max_channels = max_channels(c)
        if self.gamma_S is None:
            self.gamma_S = np.ones(len(sites))
        self.p2p = P2PModel(
            c,
            op_p2p_S=p2p & (not self.gloo),
            a2a_S=self.op_S == _A2A,
            nbytes_S=self.nbytes_S,
            group_size_S=self.n_S,
            n_nodes_S=self.nodes_S,
        )
        self._static_tables()

    def _static_tables(self) -> None:
        """Per site and algorithm code: algorithm steps and wire bytes of one call (S x 8)."""
        i = np.arange(len(self.sites))[:, None]
        alg = np.arange(ALG_NONE + 1)[None, :]
        op, n, nb, nodes = self.op_S[i], self.n_S[i], self.nbytes_S[i], self.nodes_S[i]
        frac = (n - 1.0) / n
        log2n = np.ceil(np.log2(np.maximum(n, 2.0)))
        ring_steps = np.where(op == _AR, 2.0 * (n - 1.0), np.where(np.isin(op, [_SEND, _RECV]), 1.0, n - 1.0))
        steps = np.select(
            [
                alg == _TREE,
                alg == _NVLS,
                alg == _NVLSTREE,
                (alg == _CNDIRECT) | (alg == _CNCHAIN),
                alg == _PAT,
                (alg == ALG_NONE) & (op == _A2A),
            ],
            [
                2.0 * log2n,
                np.where(op == _AR, 2.0, 1.0),
                2.0 + 2.0 * np.log2(np.maximum(nodes, 1.0)),
                4.0,
                log2n,
                1.0 + log2n,
            ],
            default=ring_steps,
        )
        wire_factor = np.select(
            [op == _AR, np.isin(op, [_AG, _RS, _A2A])],
            [
                np.where((alg == _NVLS) | (alg == _NVLSTREE), 1.5 * frac, np.where(alg >= _CNDIRECT, frac, 2.0 * frac)),
                frac,
            ],
            default=1.0,
        )
        wire = wire_factor * nb
        self.steps_SA = np.broadcast_to(steps, (len(self.sites), ALG_NONE + 1)).copy()
        self.wire_SA = np.broadcast_to(wire, (len(self.sites), ALG_NONE + 1)).copy()

    def default_codes(self) -> tuple[np.ndarray, ...]:
        """NCCL's own choice per site as codes ``(alg_S, proto_S, nc_S, nt_S, chunk_S)``: our approximation."""
        S = len(self.sites)
        if self.gloo:
            return (
                np.full(S, ALG_NONE),
                np.full(S, PROTO_NONE),
                np.full(S, float(GLOO_DEFAULT_THREADS)),
                np.full(S, 512.0),
                np.zeros(S),
            )
        c = self.cluster
        nb, op, inter = self.nbytes_S, self.op_S, self.nodes_S > 1
        p2p = np.isin(op, [_A2A, _SEND, _RECV])
        nvls_ok = c.nvswitch and c.sm_arch >= 90 and c.nccl >= (2, 17, 0)
        alg = np.full(S, _RING)
        alg = np.where((op == _AR) & ~inter & nvls_ok & (nb >= 262144), _NVLS, alg)
        alg = np.where((op == _AR) & inter & (nb < 8 * 2**20), _TREE, alg)
        alg = np.where(p2p, ALG_NONE, alg)
        ll128 = (c.sm_arch >= 80) and getattr(
            c, "intra_link", "nvlink"
        ) != "pcie"  # NCCL: NVLink paths only (tuning.cc:531)
        proto = np.where(nb < 65536, _LL, np.where((nb < 4 * 2**20) & ~inter & ll128, _LL128, _SIMPLE))
        proto = np.where(np.isin(alg, [_NVLS, _NVLSTREE, _CNDIRECT, _CNCHAIN, _PAT]), _SIMPLE, proto)
        proto = np.where(p2p, PROTO_NONE, proto)
        cap = np.where(inter, 16, 32 if c.sm_arch >= 90 else 24)  # ~16 SMs on an 8-NIC node (nccl#689)
        if getattr(c, "intra_link", "nvlink") == "pcie":
            cap = np.full(S, 2)  # one ring below 25 GB/s, not duplicated, doubled once (nccl#689: 2 SMs)
        one, many = getattr(c, "coll_channels", None), getattr(c, "coll_channels_inter", None)
        if one is not None or many is not None:
            cap = np.where(inter, many or one or cap, one or cap)
        # NCCL drops a channel while bytes < channels x threads x (64 B Simple, 8 LL128, 8 x ranks Ring/LL)
        # (NCCL v2.30.7 src/enqueue.cc:2093-2096, src/include/comm.h:49-51, src/graph/tuning.cc:593)
        per_ch = np.where(proto == _SIMPLE, 512.0 * 64, np.where(proto == _LL128, 640.0 * 8, 512.0 * 8 * self.n_S))
        nc = np.clip(np.floor(nb / per_ch), 1, np.minimum(cap, self.max_channels))
        # P2P: the communicator's own channel count (no size rule: p2pnChannels follows comm->nChannels)
        nc = np.where(p2p, np.minimum(cap, self.max_channels), nc)
        return (alg.astype(np.int64), proto.astype(np.int64), nc.astype(float), np.full(S, 512.0), np.zeros(S))

    def encode(self, i: int, config: CommConfig) -> tuple[int, int, float, float, float]:
        """Codes of ``config`` for site ``i`` with NCCL's choice filled in where a knob is None."""
        d_alg, d_proto, d_nc, d_nt, _ = (x[i] for x in self.default_codes_cached())
        if self.gloo:
            return (ALG_NONE, PROTO_NONE, float(config.n_channels or d_nc), 512.0, float(config.chunk_size or 0))
        alg = ALGORITHMS.index(config.algorithm) if config.algorithm else int(d_alg)
        if config.protocol:
            proto = PROTOCOLS.index(config.protocol)
            if not config.algorithm and alg not in (_RING, _TREE, ALG_NONE) and proto != _SIMPLE:
                alg = _RING  # NCCL falls back to an algorithm that runs the requested protocol
        elif config.algorithm and alg not in (_RING, _TREE):
            proto = _SIMPLE
        else:
            proto = int(d_proto) if int(d_proto) != PROTO_NONE or alg == ALG_NONE else _SIMPLE
        nc = float(config.n_channels or d_nc)
        nt = float(config.n_threads or d_nt)
        return (alg, proto, nc, nt, float(config.chunk_size or 0))

    def default_codes_cached(self) -> tuple[np.ndarray, ...]:
        if not hasattr(self, "_defaults"):
            self._defaults = self.default_codes()
        return self._defaults

    def decode(self, alg: int, proto: int, nc: float, nt: float, chunk: float) -> CommConfig:
        """The CommConfig of a code tuple (code ``none``/0 become ``None``)."""
        if self.gloo:
            return CommConfig(n_channels=int(nc), chunk_size=int(chunk) or None)
        return CommConfig(
            algorithm=None if alg == ALG_NONE else ALGORITHMS[int(alg)],
            protocol=None if proto == PROTO_NONE else PROTOCOLS[int(proto)],
            n_channels=None if alg == ALG_NONE else int(nc),
            n_threads=int(nt),
            chunk_size=int(chunk) or None,
        )

    def prior_parts(self, i, alg, proto, nc, nt, chunk):
        """Per call under codes: latency us, transfer us, CTAs, wire bytes, HBM per wire byte (before alpha, beta)."""
        n, nb = self.n_S[i], self.nbytes_S[i]
        steps = self.steps_SA[i, alg]
        wire = self.wire_SA[i, alg]
        if self.gloo:
            pieces = np.maximum(1.0, np.where(chunk > 0, np.ceil(nb / np.maximum(chunk, 1.0)), 1.0))
            n_eff = np.minimum(nc, pieces)
            lat = GLOO_CALL_US * pieces + self.hop_S[i] * steps * np.ceil(pieces / n_eff)
            bw = _softmin(n_eff * self.pcb * self.gamma_S[i], self.link_S[i])
            return lat, wire / (bw * 1e3), n_eff, wire, np.ones_like(n_eff)
        p = np.where(proto == PROTO_NONE, _SIMPLE, proto)
        own = _PROTO_DEFAULT_CHUNK[p] * np.where((p == _SIMPLE) & (alg == _RING), RING_SIMPLE_CHUNK_STEPS, 1)
        chunk_eff_bytes = np.where(chunk > 0, chunk, own)
        # An explicit chunk leaves channels idle when one loop (n ranks x chunk) covers the message.
        n_eff = np.where(chunk > 0, np.minimum(nc, np.maximum(1.0, np.ceil(nb / (n * np.maximum(chunk, 1.0))))), nc)
        if self.p2p.any:
            n_eff = np.where(self.p2p.mask_S[i], self.p2p.ctas(i, nc), n_eff)
        half = _PROTO_CHUNK_HALF[p]
        chunk_eff = (chunk_eff_bytes / (chunk_eff_bytes + half)) / (own / (own + half))  # 1 at NCCL's own chunk
        # NCCL_NTHREADS sets Ring/Tree with Simple/LL only (NCCL 2.30.7 src/graph/tuning.cc:246-254); others: own
        threads_on = ((p == _LL) | (p == _SIMPLE)) & ((alg == _RING) | (alg == _TREE))
        nt_eff = np.where(threads_on, nt, DEFAULT_THREADS)
        # never profiled (process scope): a deliberately pessimistic prior, throughput ~ threads^0.6
        thr_eff = (nt_eff / DEFAULT_THREADS) ** 0.6
        alg_mult = np.where(
            np.isin(alg, [_NVLS, _NVLSTREE]) & (self.op_S[i] != _AR), NVLS_GATHER_MULT * (n - 1) / n, _ALG_CH_MULT[alg]
        )
        per_ch = self.pcb * self.gamma_S[i] * _PROTO_CH_EFF[p] * alg_mult * thr_eff * chunk_eff
        # NVLS all-reduce ~480 GB/s bus bandwidth vs Ring ~370 on 8 x H100 (nccl-tests#212); gathers: Ring's
        link_mult = np.where((alg == _NVLS) & (self.op_S[i] == _AR), NVLS_ALLREDUCE_LINK, _ALG_LINK_EFF[alg])
        link = self.link_S[i] * link_mult * _PROTO_LINK_EFF[p]
        bw = _softmin(n_eff * per_ch, link)
        lat = NCCL_BASE_LATENCY_US * np.where(p == _SIMPLE, 1.0, 0.5) + steps * self.hop_S[i] * _PROTO_LAT[p]
        # a CTA holds a whole SM (nccl#689); smaller chunks stay in L2, so less reaches HBM (our design, after Lagom)
        l2 = CHUNK_L2_FLOOR + (1.0 - CHUNK_L2_FLOOR) * np.sqrt(chunk_eff_bytes / own)
        return lat, wire / (bw * 1e3), n_eff, wire, _PROTO_HBM[p] * _ALG_HBM[alg] * l2

    def fit_summary(self) -> str:
        """Several lines on the fit: points, T_region MAPE, its floor, time-weighted error, T_comm MAPE."""
        return (
            f"cost model fit on {self.n_points} samples of {len(self.sites)} sites ({self.backend}):\n"
            f"  T_region MAPE {self.mape:.1f}% (floor for this model form on these samples {self.mape_floor:.1f}%: "
            f"spread of samples it cannot tell apart)\n"
            f"  T_region time-weighted error {self.wape:.1f}% (sum |error| / sum measured)\n"
            f"  T_comm MAPE {self.mape_comm:.1f}%"
        )

    def dispatch_wait(self, i, hp=None):
        """us per iteration sites ``i`` wait for SMs (``wait_S``); 0 where ``hp`` is 1 (None = ``hp_S``)."""
        if self.wait_S is None:
            return 0.0
        if hp is None:
            hp = 0.0 if self.hp_S is None else self.hp_S[i]
        return self.wait_S[i] * (1.0 - np.asarray(hp, dtype=float))

    def evaluate(self, i, alg, proto, nc, nt, chunk, hp=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """T_comm (us, with the dispatch wait), s, T_region (us) of sites ``i`` under codes; ``hp`` None = ``hp_S``."""
        return self.combine(i, *self.prior_parts(i, alg, proto, nc, nt, chunk), hp=hp)

    def combine(self, i, lat, xfer, ctas, wire, hbm_mult, hp=None, sm_free=False, fitted=True):
        """T_comm, s, T_region of sites ``i`` from one call's parts (``prior_parts``, or NCCL's own model of a path
        the warm-up cannot probe, ``engine.registered``: ``fitted`` False, no alpha / beta fitted on another path);
        ``sm_free``: the call holds no SM, so it never waits for one."""
        calls = self.calls_S[i]
        t_run = calls * ((self.alpha_S[i] * lat + self.beta_S[i] * xfer) if fitted else (lat + xfer))
        wait = 0.0 if sm_free else self.dispatch_wait(i, hp)
        t_comm = t_run + wait
        hbm_share = hbm_mult * (wire * calls / np.maximum(t_run, 1e-9)) * 1e-3 / self.cluster.hbm_gbps
        s = self.a_S[i] * sm_term(ctas, self.cluster.sms_per_gpu, self.gloo) + self.b_S[i] * hbm_share
        if self.corr_SC is not None:
            s = s * self.corr_SC[i, np.clip(np.rint(ctas), 0, self.corr_SC.shape[1] - 1).astype(np.intp)]
        if self.comp_levels_SL is None:
            region = region_time_us(t_run, self.t_comp_us_S[i], s, wait)
        else:  # one region per call (``set_call_levels``), each call a calls-th of T_comm
            t_call = np.asarray(t_run / calls)[..., None]
            w_call = np.asarray(wait / calls)[..., None]
            s_l = np.asarray(s)[..., None] * self.slow_SL[i]
            region = np.sum(
                self.comp_weights_SL[i] * region_time_us(t_call, self.comp_levels_SL[i], s_l, w_call), axis=-1
            )
        if self.queued_S is not None and self.queued_S.any():
            region = cost_terms.queued_region(self, i, region, t_comm)
        if self.offset_S is not None:
            region = region + self.offset_S[i]
        return t_comm, s, region

    def set_call_levels(self, per_call_us: Sequence[Sequence[float]]) -> None:
        """One region per call, not per site; ``per_call_us``: per site, compute alone per call (us); ValueError."""
        if len(per_call_us) != len(self.sites):
            raise ValueError(f"per_call_us must have one entry per site ({len(self.sites)}); got {len(per_call_us)}")
        levels, weights, self.call_level = call_levels(
            per_call_us, self.t_comp_us_S, self.calls_S, [s.site_id for s in self.sites]
        )
        multi = levels.shape[1] > 1
        if multi:
            several = weights[:, 1] > 0
            self.t_comp_us_S = np.where(several, (levels * weights).sum(axis=1), self.t_comp_us_S)
        self.comp_levels_SL, self.comp_weights_SL = (levels, weights) if multi else (None, None)
        self.slow_SL = np.ones_like(levels) if multi else None

    def mark_queues(self, empty_share: float = 0.01, queue_share: float = 0.25) -> None:
        """Flags the sites of every communicator where collectives queue (``cost_terms.mark_queues``)."""
        cost_terms.mark_queues(self, empty_share=empty_share, queue_share=queue_share)

    def _site(self, site: CollectiveSite | str) -> int:
        key = site if isinstance(site, str) else site.site_id
        if key not in self.index:
            raise ValueError(f"site {key!r} is not in this cost model ({len(self.sites)} sites)")
        return self.index[key]

    def t_comm_us(self, site: CollectiveSite | str, cfg: CommConfig) -> float:
        """Predicted collective time of ``site`` under ``cfg``, microseconds per iteration."""
        i = self._site(site)
        return float(self.evaluate(i, *self.encode(i, cfg), hp=self._hp(cfg))[0])

    def slowdown(self, site: CollectiveSite | str, cfg: CommConfig) -> float:
        """Predicted fractional compute slowdown s while ``site``'s collective runs under ``cfg``."""
        i = self._site(site)
        return float(self.evaluate(i, *self.encode(i, cfg), hp=self._hp(cfg))[1])

    def t_region_us(self, site: CollectiveSite | str, cfg: CommConfig) -> float:
        """Predicted overlap-region time of ``site`` under ``cfg``, microseconds."""
        i = self._site(site)
        return float(self.evaluate(i, *self.encode(i, cfg), hp=self._hp(cfg))[2])

    @staticmethod
    def _hp(cfg: CommConfig) -> float | None:
        return 1.0 if cfg.high_priority_stream else None

    @classmethod
    def from_priors(
        cls,
        sites: Sequence[CollectiveSite],
        t_comp_us: Sequence[float],
        cluster: ClusterSpec,
        *,
        backend: str | None = None,
        alpha=1.0,
        beta=1.0,
        a=PRIOR_A,
        b=PRIOR_B,
        gamma=1.0,
    ) -> CostModel:
        """A model from ClusterSpec priors; ``alpha`` .. ``gamma`` scalar or per site; ValueError on a bad t_comp_us."""
        S = len(sites)
        if len(t_comp_us) != S:
            raise ValueError(f"t_comp_us must have one value per site ({S}); got {len(t_comp_us)}")

        def arr(x):
            return np.broadcast_to(np.asarray(x, dtype=float), (S,)).copy()

        return cls(
            cluster=cluster,
            backend=backend or cluster.backend,
            sites=list(sites),
            t_comp_us_S=arr(t_comp_us),
            alpha_S=arr(alpha),
            beta_S=arr(beta),
            a_S=arr(a),
            b_S=arr(b),
            gamma_S=arr(gamma),
        )
