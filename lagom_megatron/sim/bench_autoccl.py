"""AutoCCL (Xu et al., NSDI'25; ``gbxu/autoccl``) as its code behaves: ``lagom bench simulated``'s ``autoccl``.

One job per (communicator, collective, bytes) (``isNewWorkload``); per-call threads and chunk (``fork=True``);
``TUNER_MAXCHANNELS`` (``run.sh``); ``TUNER_MODE`` 5: random pretraining then coordinate descent, pruning at
3x / 1.5x (``NcclCombinedJob``); cost ``meanOfTopPercent(75)``; budgets ``optimizer.h`` (20 + 50).
"""

from __future__ import annotations

import random
from typing import Any

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.nccl.rules import NcclRules

PRETRAIN_STEPS = 20
TRAIN_STEPS = 50
MAX_CHANNELS = 32
THREADS = tuple(range(96, 641, 32))
SIMPLE_CHUNKS = (65536, 131072, 262144, 524288, 1048576, 2097152)
TOP_PERCENT = 0.75
PRUNE_EXTREME, PRUNE_SLOW = 3.0, 1.5
DIMS = ("n_channels", "n_threads", "chunk_size")


def _grid(proto: str, max_channels: int) -> dict[str, tuple]:
    return {"n_channels": tuple(range(1, min(MAX_CHANNELS, max_channels) + 1)),
            "n_threads": THREADS if proto != "LL128" else (640,),
            "chunk_size": SIMPLE_CHUNKS if proto == "Simple" else (None,)}


def _cost(calls: list[float]) -> float:
    xs = sorted(calls)
    k = max(1, int(round(len(xs) * TOP_PERCENT)))
    return sum(xs[:k]) / k


class _Workload:
    def __init__(self, subspaces: list[tuple[str | None, str | None]], max_channels: int, rng: random.Random) -> None:
        self.subs = subspaces
        self.grid = {s: _grid(s[1] or "Simple", max_channels) for s in subspaces}
        self.rng = rng
        self.best: dict[tuple, tuple[float, tuple]] = {}  # subspace -> (cost, point)
        self.alive = list(subspaces)
        self.state: dict[tuple, list] = {}  # subspace -> [dim index, direction, tried directions]
        self.step = -1  # the first call runs NCCL's native config (AutoCCL's ``native`` phase)
        self.pending: tuple | None = None
        self.native_cost = float("inf")

    def config(self, sub: tuple, point: tuple) -> CommConfig:
        nc, nt, chunk = point
        return CommConfig(algorithm=sub[0], protocol=sub[1], n_channels=nc, n_threads=nt, chunk_size=chunk)

    def propose(self) -> CommConfig:
        k = self.step
        self.step += 1
        if k < 0:
            self.pending = ("native", None)
            return CommConfig()
        if k < PRETRAIN_STEPS or not self.best:
            sub = self.subs[k % len(self.subs)]
            point = tuple(self.rng.choice(self.grid[sub][d]) for d in DIMS)
        else:
            if k == PRETRAIN_STEPS:
                self._prune(PRUNE_EXTREME)
            if k == PRETRAIN_STEPS + TRAIN_STEPS // 10:
                self._prune(PRUNE_SLOW)
            sub = self.alive[(k - PRETRAIN_STEPS) % len(self.alive)]
            point = self._neighbour(sub)
        self.pending = (sub, point)
        return self.config(sub, point)

    def _prune(self, factor: float) -> None:
        top = min(c for c, _ in self.best.values())
        keep = [s for s in self.alive if s in self.best and self.best[s][0] <= factor * top]
        self.alive = keep or self.alive

    def _neighbour(self, sub: tuple) -> tuple:
        if sub not in self.best:
            return tuple(self.rng.choice(self.grid[sub][d]) for d in DIMS)
        cur = list(self.best[sub][1])
        st = self.state.setdefault(sub, [0, 1, 0, 1])
        for _ in range(2 * len(DIMS)):
            d, direction, step = st[0], st[1], st[3]
            axis = self.grid[sub][DIMS[d]]
            i = min(len(axis) - 1, max(0, axis.index(cur[d]) + direction * step))
            if len(axis) > 1 and axis[i] != cur[d]:
                cur[d] = axis[i]
                return tuple(cur)
            self._turn(st)
        return tuple(cur)

    @staticmethod
    def _turn(st: list) -> None:
        """No gain along (dim, direction): flip, then next dim; step back to 1 (``lr = -1``)."""
        if st[2] == 0:
            st[1], st[2], st[3] = -st[1], 1, 1
        else:
            st[0], st[1], st[2], st[3] = (st[0] + 1) % len(DIMS), 1, 0, 1

    def record(self, cost: float) -> None:
        if self.pending is None:
            return
        sub, point = self.pending
        self.pending = None
        if sub == "native":
            self.native_cost = cost
            return
        old = self.best.get(sub)
        st = self.state.setdefault(sub, [0, 1, 0, 1])
        if old is None or cost < old[0]:
            if old is not None and self.step > PRETRAIN_STEPS:
                # a gain of g takes the next step 0.8 g of the axis further (``lr``, CoDesJob)
                axis = self.grid[sub][DIMS[st[0]]]
                st[3] = max(1, int(round(0.8 * (old[0] - cost) / old[0] * len(axis))))
            self.best[sub] = (cost, point)
        elif self.step > PRETRAIN_STEPS:
            self._turn(st)

    def final(self) -> CommConfig:
        if not self.best:
            return CommConfig()
        sub = min(self.best, key=lambda s: self.best[s][0])
        return self.config(sub, self.best[sub][1]) if self.best[sub][0] < self.native_cost else CommConfig()


def _subspaces(sim: Any, site: Any) -> list[tuple[str | None, str | None]]:
    if site.op in ("send", "recv", "all_to_all"):
        return [(None, None)]
    rules = NcclRules(sim.cluster, backend="sim")
    d = rules.domains(op=site.op, n_nodes=site.n_nodes, group_size=site.group_size)
    algs = [a for a in ("Ring", "Tree") if a in d["algorithm"]] or ["Ring"]
    protos = [p for p in ("LL", "LL128", "Simple") if p in d["protocol"]] or ["Simple"]
    return [(a, p) for a in algs for p in protos]


def autoccl(sim: Any, *, first_iteration: int, seed: int = 0,
            steps: int = 1 + PRETRAIN_STEPS + TRAIN_STEPS) -> tuple[dict[str, CommConfig], int]:
    """AutoCCL's online tuning on ``sim``: (site id -> CommConfig for ``fork=True``, iterations spent)."""
    from lagom_megatron.sim.bench_methods import tie_sets

    rules = NcclRules(sim.cluster, backend="sim")
    groups: dict[str, list[str]] = {}
    for sid, members in tie_sets(sim.sites, rules).items():
        groups.setdefault(members[0], members)
    sites = {s.site_id: s for s in sim.sites}
    rng = random.Random(seed)
    jobs = {lead: _Workload(_subspaces(sim, sites[lead]), sim.gpu.max_channels, random.Random(rng.random()))
            for lead in groups}
    for it in range(steps):
        assign = {}
        for lead, job in jobs.items():
            cfg = job.propose()
            for sid in groups[lead]:
                assign[sid] = cfg
        m = sim.run_iteration(iteration=first_iteration + it, assignment=assign, fork=True)
        per_site = {smp.site_id: [c[0] for c in smp.calls] or [smp.t_comm_us] for smp in m.samples}
        for lead, job in jobs.items():
            job.record(_cost([t for sid in groups[lead] for t in per_site[sid]]))
    out = {}
    for lead, job in jobs.items():
        for sid in groups[lead]:
            out[sid] = job.final()
    return out, steps


def microbench(cluster: Any, *, op: str, nbytes: int, group_size: int, n_nodes: int, seed: int = 0,
               steps: int = 1 + PRETRAIN_STEPS + TRAIN_STEPS) -> tuple[float, float, CommConfig]:
    """AutoCCL on one collective alone: (default GB/s, AutoCCL's GB/s, its choice); published 1.24-1.29x."""
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.sim.constants import get
    from lagom_megatron.sim.device import Collective, Gpu, comm_cost, resolve_config

    spec = ClusterSpec.load(cluster)
    gpu = Gpu.from_cluster(spec)
    c = Collective(op=op, nbytes=int(nbytes), group_size=group_size, n_nodes=n_nodes)

    def time_us(cfg: CommConfig) -> float:
        return comm_cost(gpu, c, resolve_config(gpu, c, cfg)).t_alone_us

    class _Site:  # what _subspaces reads of a site
        pass

    site = _Site()
    site.op, site.n_nodes, site.group_size = op, n_nodes, group_size

    class _Sim:
        pass

    sim = _Sim()
    sim.cluster = spec
    rng = random.Random(seed)
    job = _Workload(_subspaces(sim, site), gpu.max_channels, random.Random(seed))
    for _ in range(steps):
        cfg = job.propose()
        job.record(time_us(cfg) * max(0.2, 1.0 + rng.gauss(0.0, get("sigma_comm"))))
    best = job.final()
    wire = comm_cost(gpu, c, resolve_config(gpu, c, CommConfig())).wire_bytes
    return wire / (time_us(CommConfig()) * 1e3), wire / (time_us(best) * 1e3), best
