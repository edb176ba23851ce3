"""AutoCCL (Xu et al., NSDI'25; public code ``gbxu/autoccl``) as its code behaves, on the
simulated cluster: the ``autoccl`` column of ``lagom bench simulated``.

What is followed (the project's research notes on AutoCCL, section 2, read in its code):

* **Workloads**: one tuning per (communicator, collective, bytes) (``isNewWorkload``), so sites
  that NCCL's tuner cannot tell apart share one (``bench_methods.tie_sets``).
* **Space**: AutoCCL's fork sets every field of a call: algorithm (Ring, Tree for all-reduce),
  protocol (LL, LL128, Simple; LL128 only where NCCL enables it), channels 1..``MAX_CHANNELS``
  (``TUNER_MAXCHANNELS`` of its example ``run.sh``), threads 96..640 in steps of 32 (3-20 warps),
  chunk size (multiples of the minimum up to 2 MiB for Simple). Threads and chunk are per call
  here, which stock NCCL cannot do: its runs use ``SimulatedCluster.run_iteration(fork=True)``.
  The transport (P2P / SHM, copy engine) is not modelled.
* **Search** (``TUNER_MODE`` 5, its default): the space is divided into (algorithm, protocol)
  subspaces; ``PRETRAIN_STEPS`` random samples spread over them round robin, then
  ``TRAIN_STEPS`` steps of coordinate descent over (channels, threads, chunk) from each
  subspace's best sample, visiting subspaces round robin; a subspace is dropped when its best is
  over 3x the global best after pretraining, or 1.5x after a tenth of the training
  (``NcclCombinedJob``). A neighbour replaces the current point when it measured faster, by any
  margin. NCCL's native config is timed first and kept if nothing measured faster. The cost of a candidate is the mean of the fastest 75% of its calls' durations
  (``meanOfTopPercent(75)``): the collective's own time, blind to the compute it slows. The best
  candidate measured is kept for the rest of training.
* **Online**: every workload tries one candidate per iteration, all at once, each measured beside
  the others' current candidates. The budgets are AutoCCL's defaults (``optimizer.h``: 20 + 50
  candidates per workload); its ``run.sh`` uses 360 + 240 for microbenchmarks.
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
    """``meanOfTopPercent(75)``: the mean of the fastest 75% of the call durations."""
    xs = sorted(calls)
    k = max(1, int(round(len(xs) * TOP_PERCENT)))
    return sum(xs[:k]) / k


class _Workload:
    """AutoCCL's job for one (communicator, collective, bytes): subspaces, samples, descent."""

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
        """The next candidate (pretraining samples, then coordinate descent)."""
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
        """No improvement along (dim, direction): try the other direction, then the next dim; the
        step goes back to one grid point (``lr = -1``)."""
        if st[2] == 0:
            st[1], st[2], st[3] = -st[1], 1, 1
        else:
            st[0], st[1], st[2], st[3] = (st[0] + 1) % len(DIMS), 1, 0, 1

    def record(self, cost: float) -> None:
        """The measured cost of the pending candidate: kept when faster than its subspace's best."""
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
        """The fastest candidate measured, NCCL's native config included."""
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
    """AutoCCL's online tuning on ``sim`` (module docstring).

    Returns:
        (site id -> the CommConfig it settled on, simulated iterations spent). Apply it with
        ``run_iteration(..., fork=True)``: its threads and chunks are per call.
    """
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
    """AutoCCL's search on one collective alone (nccl-tests style, no compute beside it): the bus
    bandwidth (GB/s) of NCCL's default and of AutoCCL's choice, and that choice. Each candidate is
    timed once with the simulator's collective noise (``sigma_comm``); the bandwidths returned
    are noise-free. Its published microbenchmarks: 1.24-1.29x NCCL's bandwidth."""
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
