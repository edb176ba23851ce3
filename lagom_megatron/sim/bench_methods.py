"""``lagom bench simulated``'s references on the simulator: ``autoccl_online`` and the ``oracle``.

``autoccl_online``: AutoCCL-style descent (``coordinate_descent_job.h``, ``get_candidates.py``), channels up to
``MAXCHANNELS`` (64 from NCCL 2.25, 32 before). ``oracle``: noise-free descent through the plan's mechanism;
sites with one ``NcclRules.call_key`` move together (NCCL v2.30.7 ``src/include/tuner.h`` ``getCollInfo``).
"""

from __future__ import annotations

from typing import Any

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.nccl.rules import NcclRules
from lagom_megatron.sim.device import resolve_config

AUTOCCL_ROUNDS = 2
ORACLE_ROUNDS = 2
ORACLE_SITES = 24
KNOBS = ("n_channels", "protocol", "algorithm")


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


def autoccl_online(sim: Any, *, first_iteration: int, rounds: int = AUTOCCL_ROUNDS) -> tuple[dict[str, CommConfig], int]:
    """AutoCCL's online tuning on ``sim``; returns (site id -> CommConfig, simulated iterations spent)."""
    doms = _domains(sim)
    state = {sid: {k: None for k in KNOBS} for sid in doms}
    it = first_iteration
    m = sim.run_iteration(iteration=it)
    it += 1
    best = {smp.site_id: smp.t_comm_us for smp in m.samples}
    for _ in range(rounds):
        for knob in KNOBS:
            width = max(len(d[knob]) for d in doms.values())
            for j in range(width):
                trial = {}
                for sid, d in doms.items():
                    if j < len(d[knob]) and len(d[knob]) > 1 and d[knob][j] != state[sid][knob]:
                        trial[sid] = {**state[sid], knob: d[knob][j]}
                if not trial:
                    continue
                assign = {sid: _config(trial.get(sid, state[sid])) for sid in doms}
                m = sim.run_iteration(iteration=it, assignment=assign)
                it += 1
                for smp in m.samples:
                    if smp.site_id in trial and smp.t_comm_us < best[smp.site_id]:
                        best[smp.site_id] = smp.t_comm_us
                        state[smp.site_id] = trial[smp.site_id]
    return {sid: _config(k) for sid, k in state.items()}, it - first_iteration


def _time(sim: Any, state: dict[str, dict]) -> float:
    return sim.run_iteration(iteration=0, assignment={sid: _config(k) for sid, k in state.items()}, noise=False).iteration_us


def oracle(sim: Any, *, caps: tuple[int, ...] = (2, 4, 8), rounds: int = ORACLE_ROUNDS,
           per_site: int = ORACLE_SITES, group_caps: dict[str, int] | None = None) -> tuple[dict[str, CommConfig], float, int]:
    """The oracle plan: (site id -> CommConfig, noise-free iteration us, iterations spent)."""
    doms = _domains(sim)
    rules = NcclRules(sim.cluster, backend="sim")
    per_comm = rules.scope("n_channels") != "call"
    hp_ok = rules.scope("high_priority_stream") is not None
    for d in doms.values():
        d["high_priority_stream"] = (None, True)
    own_nc = {}
    if per_comm:  # a communicator's channel value caps NCCL's own count (ncclConfig_t.maxCTAs)
        for i, c in enumerate(sim._prog.calls):
            if c.site_id is not None and c.site_id not in own_nc:
                own_nc[c.site_id] = resolve_config(sim.gpu, c.coll, CommConfig()).n_channels
        for sid, d in doms.items():
            if sid in own_nc:
                d["n_channels"] = tuple(sorted({min(v, own_nc[sid]) for v in d["n_channels"]}))
    default = {sid: {k: None for k in KNOBS} for sid in doms}
    starts = [default]
    for cap in caps:
        starts.append({sid: {**default[sid], "n_channels": min(cap, max(d["n_channels"]))} if len(d["n_channels"]) > 1
                       else dict(default[sid]) for sid, d in doms.items()})
    if group_caps:
        site_of = {s.site_id: s for s in sim.sites}
        nccl_nc = {}
        for c in sim._prog.calls:
            if c.site_id is not None and c.site_id not in nccl_nc:
                nccl_nc[c.site_id] = resolve_config(sim.gpu, c.coll, CommConfig()).n_channels
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
            v = min(value, own_nc[sid]) if (per_comm and knob == "n_channels" and sid in own_nc) else value
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
        if per_comm:  # one channel cap per communicator
            for members in comms.values():
                for v in sorted({v for sid in members for v in rules.domains(op=sites[members[0]].op, n_nodes=sites[members[0]].n_nodes,
                                                                             group_size=sites[members[0]].group_size)["n_channels"] if v}):
                    try_move(members, "n_channels", v)
        if best >= before * (1.0 - 1e-6):
            break
    # per site: neighbouring channel counts of the longest regions
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
        near = [dom[p] for p in ((pos - 1, pos + 1) if pos is not None else ()) if 0 <= p < len(dom)] if pos is not None else list(dom[:3])
        for v in near:
            try_move(tied[sid], "n_channels", v)
    return {sid: _config(k) for sid, k in state.items()}, best, runs
