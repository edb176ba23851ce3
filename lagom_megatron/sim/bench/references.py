"""References of ``lagom bench simulated``: ``autoccl``, AutoCCL's search per (communicator, collective, bytes)
(``coordinate_descent_job.h``, ``get_candidates.py``); ``oracle``, noise-free descent through the plan's mechanism,
sites of one ``NcclRules.call_key`` moving together (NCCL v2.30.7 ``src/include/tuner.h`` ``getCollInfo``)."""

from __future__ import annotations

import random
from typing import Any

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.nccl.rules import NcclRules
from lagom_megatron.sim.constants import get
from lagom_megatron.sim.device import Collective, Gpu, comm_cost, resolve_config

ORACLE_ROUNDS = 2
ORACLE_SITES = 24
KNOBS = ("n_channels", "protocol", "algorithm")
PRETRAIN_STEPS = 20
TRAIN_STEPS = 50
MAX_CHANNELS = 32
THREADS = tuple(range(96, 641, 32))
SIMPLE_CHUNKS = (65536, 131072, 262144, 524288, 1048576, 2097152)
TOP_PERCENT = 0.75
PRUNE_EXTREME, PRUNE_SLOW = 3.0, 1.5
DIMS = ("n_channels", "n_threads", "chunk_size")


def _domains(sim: Any) -> dict[str, dict[str, tuple]]:
    rules = NcclRules(sim.cluster, backend="sim")
    out = {}
    for s in sim.sites:
        d = rules.domains(op=s.op, n_nodes=s.n_nodes, group_size=s.group_size)
        out[s.site_id] = {k: tuple(v for v in d[k] if v is not None) for k in KNOBS}
    return out


def tie_sets(sites: list, rules: NcclRules) -> dict[str, list[str]]:
    """Site id -> ids of every site with the same ``rules.call_key`` (itself alone where None), in order."""
    by_key: dict[Any, list[str]] = {}
    out: dict[str, list[str]] = {}
    for s in sites:
        key = rules.call_key(group=s.group, op=s.op, nbytes=s.nbytes)
        out[s.site_id] = by_key.setdefault(key, []) if key is not None else [s.site_id]
        if key is not None:
            by_key[key].append(s.site_id)
    return out


def _config(knobs: dict[str, Any]) -> CommConfig:
    return CommConfig(**{k: v for k, v in knobs.items() if v is not None})


def _time(sim: Any, state: dict[str, dict]) -> float:
    return sim.run_iteration(
        iteration=0, assignment={sid: _config(k) for sid, k in state.items()}, noise=False
    ).iteration_us


def oracle(
    sim: Any,
    *,
    caps: tuple[int, ...] = (2, 4, 8),
    rounds: int = ORACLE_ROUNDS,
    per_site: int = ORACLE_SITES,
    group_caps: dict[str, int] | None = None,
) -> tuple[dict[str, CommConfig], float, int]:
    """The oracle plan: (site id -> CommConfig, noise-free iteration us, iterations spent)."""
    doms = _domains(sim)
    rules = NcclRules(sim.cluster, backend="sim")
    per_comm = rules.scope("n_channels") != "call"
    hp_ok = rules.scope("high_priority_stream") is not None
    for d in doms.values():
        d["high_priority_stream"] = (None, True)
    nccl_nc = {}  # site id -> NCCL's own channel count
    for c in sim._prog.calls:
        if c.site_id is not None and c.site_id not in nccl_nc:
            nccl_nc[c.site_id] = resolve_config(sim.gpu, c.coll, CommConfig()).n_channels
    if per_comm:  # a communicator's channel value caps NCCL's own count (ncclConfig_t.maxCTAs)
        for sid, d in doms.items():
            if sid in nccl_nc:
                d["n_channels"] = tuple(sorted({min(v, nccl_nc[sid]) for v in d["n_channels"]}))
    default = {sid: {k: None for k in KNOBS} for sid in doms}
    starts = [default]
    for cap in caps:
        starts.append(
            {
                sid: {**default[sid], "n_channels": min(cap, max(d["n_channels"]))}
                if len(d["n_channels"]) > 1
                else dict(default[sid])
                for sid, d in doms.items()
            }
        )
    if group_caps:
        site_of = {s.site_id: s for s in sim.sites}
        st = {}
        for sid, d in doms.items():
            cap = group_caps.get(site_of[sid].group)
            ok = cap is not None and len(d["n_channels"]) > 1 and sid in nccl_nc
            v = max((x for x in d["n_channels"] if x <= min(cap, nccl_nc[sid])), default=None) if ok else None
            st[sid] = {**default[sid], "n_channels": v} if v is not None and v < nccl_nc[sid] else dict(default[sid])
        starts.append(st)
    if hp_ok:  # each start also with every group on a high-priority stream (it pays with fewer channels)
        starts += [{sid: {**k, "high_priority_stream": True} for sid, k in st.items()} for st in list(starts)]
    runs = 0
    times = []
    for st in starts:
        times.append(_time(sim, st))
        runs += 1
    k = min(range(len(starts)), key=lambda i: times[i])
    state, best = {sid: dict(v) for sid, v in starts[k].items()}, times[k]
    sites = {s.site_id: s for s in sim.sites}
    groups: dict[tuple, list[str]] = {}
    comms: dict[str, list[str]] = {}
    tied = tie_sets(sim.sites, rules)
    for sid, s in sites.items():
        groups.setdefault((s.group, s.op), []).append(sid)
        comms.setdefault(s.group, []).append(sid)

    def try_move(members: list[str], knob: str, value: Any) -> None:
        nonlocal best, runs
        trial = {sid: dict(v) for sid, v in state.items()}
        moved = False
        for sid in members:
            v = min(value, nccl_nc[sid]) if (per_comm and knob == "n_channels" and sid in nccl_nc) else value
            if v in doms[sid][knob] and len(doms[sid][knob]) > 1 and trial[sid].get(knob) != v:
                trial[sid][knob] = v
                moved = True
        if not moved:
            return
        t = _time(sim, trial)
        runs += 1
        if t < best * (1.0 - 1e-6):
            best = t
            state.update(trial)

    for _ in range(rounds):
        before = best
        for members in groups.values():
            for knob in KNOBS:
                if knob == "n_channels" and per_comm:
                    continue
                for v in sorted({v for sid in members for v in doms[sid][knob]}):
                    try_move(members, knob, v)
        if hp_ok:  # a high-priority stream per communicator (pool entries of the group)
            for members in comms.values():
                try_move(members, "high_priority_stream", True)
        if per_comm:
            for members in comms.values():
                for v in sorted(
                    {
                        v
                        for sid in members
                        for v in rules.domains(
                            op=sites[members[0]].op,
                            n_nodes=sites[members[0]].n_nodes,
                            group_size=sites[members[0]].group_size,
                        )["n_channels"]
                        if v
                    }
                ):
                    try_move(members, "n_channels", v)
        if best >= before * (1.0 - 1e-6):
            break
    # neighbouring channel counts of the longest regions' sites
    m = sim.run_iteration(iteration=0, assignment={sid: _config(k) for sid, k in state.items()}, noise=False)
    runs += 1
    longest = [] if per_comm else sorted(m.samples, key=lambda smp: -smp.t_region_us)[:per_site]
    for smp in longest:
        sid = smp.site_id
        dom = doms[sid]["n_channels"]
        if len(dom) < 2:
            continue
        cur = state[sid]["n_channels"]
        pos = dom.index(cur) if cur in dom else None
        near = (
            [dom[p] for p in ((pos - 1, pos + 1) if pos is not None else ()) if 0 <= p < len(dom)]
            if pos is not None
            else list(dom[:3])
        )
        for v in near:
            try_move(tied[sid], "n_channels", v)
    return {sid: _config(k) for sid, k in state.items()}, best, runs


def _grid(proto: str, max_channels: int) -> dict[str, tuple]:
    return {
        "n_channels": tuple(range(1, min(MAX_CHANNELS, max_channels) + 1)),
        "n_threads": THREADS if proto != "LL128" else (640,),
        "chunk_size": SIMPLE_CHUNKS if proto == "Simple" else (None,),
    }


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


def _subspaces(cluster: ClusterSpec, site: Any) -> list[tuple[str | None, str | None]]:
    """(algorithm, protocol) pairs AutoCCL searches for ``site`` (a ``CollectiveSite`` or ``Collective``)."""
    if site.op in ("send", "recv", "all_to_all"):
        return [(None, None)]
    rules = NcclRules(cluster, backend="sim")
    d = rules.domains(op=site.op, n_nodes=site.n_nodes, group_size=site.group_size)
    algs = [a for a in ("Ring", "Tree") if a in d["algorithm"]] or ["Ring"]
    protos = [p for p in ("LL", "LL128", "Simple") if p in d["protocol"]] or ["Simple"]
    return [(a, p) for a in algs for p in protos]


def autoccl(
    sim: Any, *, first_iteration: int, seed: int = 0, steps: int = 1 + PRETRAIN_STEPS + TRAIN_STEPS
) -> tuple[dict[str, CommConfig], int]:
    """AutoCCL's online tuning on ``sim``: (site id -> CommConfig for ``fork=True``, iterations spent)."""
    rules = NcclRules(sim.cluster, backend="sim")
    groups: dict[str, list[str]] = {}
    for members in tie_sets(sim.sites, rules).values():
        groups.setdefault(members[0], members)
    sites = {s.site_id: s for s in sim.sites}
    rng = random.Random(seed)
    jobs = {
        lead: _Workload(_subspaces(sim.cluster, sites[lead]), sim.gpu.max_channels, random.Random(rng.random()))
        for lead in groups
    }
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


def microbench(
    cluster: Any,
    *,
    op: str,
    nbytes: int,
    group_size: int,
    n_nodes: int,
    seed: int = 0,
    steps: int = 1 + PRETRAIN_STEPS + TRAIN_STEPS,
) -> tuple[float, float, CommConfig]:
    """AutoCCL on one collective alone: (default GB/s, AutoCCL's GB/s, its choice); published 1.24-1.29x."""
    spec = ClusterSpec.load(cluster)
    gpu = Gpu.from_cluster(spec)
    c = Collective(op=op, nbytes=int(nbytes), group_size=group_size, n_nodes=n_nodes)

    def time_us(cfg: CommConfig) -> float:
        return comm_cost(gpu, c, resolve_config(gpu, c, cfg)).t_alone_us

    rng = random.Random(seed)
    job = _Workload(_subspaces(spec, c), gpu.max_channels, random.Random(seed))
    for _ in range(steps):
        cfg = job.propose()
        job.record(time_us(cfg) * max(0.2, 1.0 + rng.gauss(0.0, get("sigma_comm"))))
    best = job.final()
    wire = comm_cost(gpu, c, resolve_config(gpu, c, CommConfig())).wire_bytes
    return wire / (time_us(CommConfig()) * 1e3), wire / (time_us(best) * 1e3), best
