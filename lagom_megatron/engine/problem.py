"""The search problem every searcher takes: sites, fitted cost model, knob rules, knob domains as numpy arrays.
Config codes: algorithm and protocol index (``ALG_NONE`` / ``PROTO_NONE``: P2P, gloo), n_channels, n_threads, chunk
level (0 = NCCL's chunk, 1..4 = ``knobs.chunk_domain``). Suffixes: ``_S`` per site, ``_SK`` per site and value."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from lagom_megatron import __version__
from lagom_megatron.engine import p2p_knobs, stream_priority
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import ALG_NONE, PROTO_NONE, CostModel
from lagom_megatron.engine.fit import fit_cost_model
from lagom_megatron.engine.knobs import (
    ALGORITHMS,
    KNOB_ORDER,
    PROTOCOLS,
    PROTOCOLS_FOR_ALGORITHM,
    CommConfig,
    KnobRules,
    chunk_domain,
)
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.engine.profile import CollectiveSite, Profile

SEARCH_KNOBS: tuple[str, ...] = ("n_channels", "chunk_size", "n_threads", "protocol", "algorithm")
"""Knobs the cost model distinguishes, in priority order (CTA policy, CGA size: not modelled, never searched)."""

_CHUNK_LEVELS = np.zeros((len(PROTOCOLS) + 1, 5))
for _p, _name in enumerate(PROTOCOLS):
    _CHUNK_LEVELS[_p, 1:] = chunk_domain(_name)
_CHUNK_LEVELS[PROTO_NONE, 1:] = chunk_domain(None, "gloo") + (chunk_domain(None, "gloo")[-1],)
_COMPAT = np.zeros((len(ALGORITHMS) + 1, len(PROTOCOLS) + 1), dtype=bool)
for _a, _name in enumerate(ALGORITHMS):
    for _pn in PROTOCOLS_FOR_ALGORITHM[_name]:
        _COMPAT[_a, PROTOCOLS.index(_pn)] = True
_COMPAT[ALG_NONE, PROTO_NONE] = True
_SIMPLE = PROTOCOLS.index("Simple")


@dataclass
class State:
    """Per-site config codes; a searcher's working copy (arrays of shape (S,))."""

    alg: np.ndarray
    proto: np.ndarray
    nc: np.ndarray
    nt: np.ndarray
    lvl: np.ndarray

    def copy(self) -> State:
        return State(*(x.copy() for x in (self.alg, self.proto, self.nc, self.nt, self.lvl)))

    def get(self, knob: str) -> np.ndarray:
        return getattr(self, _FIELD[knob])


_FIELD = {"algorithm": "alg", "protocol": "proto", "n_channels": "nc", "n_threads": "nt", "chunk_size": "lvl"}


@dataclass
class SearchResult:
    """A plan and the statistics of the search that produced it."""

    plan: Plan
    stats: dict[str, Any]


@dataclass
class SearchProblem:
    """Everything a searcher needs; ``domains_S[i][knob]``: site i's values, ``(None,)`` = not tunable."""

    model: CostModel
    rules: KnobRules
    iteration_us: float
    domains_S: list[dict[str, tuple]]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    scope: dict[str, str | None] = field(default_factory=dict)
    notes_S: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cluster: ClusterSpec = self.model.cluster
        self.backend: str = self.model.backend
        self.mechanism: str = self.rules.mechanism
        self.sites: list[CollectiveSite] = self.model.sites
        self.comm_S = [s.group for s in self.sites]
        self.scope = {k: self.rules.scope(k) for k in KNOB_ORDER}
        self._encode_domains()

    @classmethod
    def from_model(
        cls,
        model: CostModel,
        *,
        rules: KnobRules,
        iteration_us: float | None = None,
        fingerprint: dict | None = None,
        domain_override: dict[str, tuple] | None = None,
    ) -> SearchProblem:
        """A problem over ``model``'s sites (ValueError: another cluster); ``domain_override`` narrows domains."""
        if rules.cluster.name != model.cluster.name:
            raise ValueError(
                f"knob rules are for cluster {rules.cluster.name!r} but the cost model is for {model.cluster.name!r}"
            )
        backend = model.backend
        rules = rules.for_sites(model.sites)
        doms, notes = [], []
        for s in model.sites:
            d, note = rules.site_domains(s)
            notes.append(note)
            if domain_override:
                for k, values in domain_override.items():
                    if len(d[k]) > 1:
                        kept = tuple(x for x in d[k] if x in values)
                        d[k] = kept or d[k][:1]
            doms.append(d)
        fp = dict(fingerprint or {})
        fp.setdefault("cluster", model.cluster.name)
        fp.setdefault("nccl_version", model.cluster.nccl_version)
        fp.setdefault("lagom_version", __version__)
        fp.setdefault("backend", backend)
        problem = cls(model=model, rules=rules, iteration_us=0.0, domains_S=doms, fingerprint=fp, notes_S=notes)
        if iteration_us is None:
            iteration_us = float(problem.evaluate(problem.default_state())[2].sum())
        problem.iteration_us = float(iteration_us)
        return problem

    @classmethod
    def from_profile(
        cls,
        profile: Profile,
        *,
        rules: KnobRules,
        model: CostModel | None = None,
        domain_override: dict[str, tuple] | None = None,
    ) -> SearchProblem:
        """A problem from a profile on ``rules.cluster``: fits the cost model unless one is given."""
        model = model or fit_cost_model(profile, rules.cluster)
        fp = dict(profile.fingerprint)
        fp.setdefault("backend", profile.backend)
        problem = cls.from_model(
            model, rules=rules, iteration_us=profile.iteration_us, fingerprint=fp, domain_override=domain_override
        )
        problem.keep_measured_algorithms(profile)
        return problem

    def keep_measured_algorithms(self, profile: Profile) -> None:
        """Narrows algorithm and protocol domains to those each site's samples ran (warm-up probes included).
        Others are extrapolation (NCCL caps an LL128 CTA at 18.35 GB/s on Hopper, tuning.cc:185-190)."""
        if self.backend == "gloo":
            return
        seen: dict[int, set[int]] = {}
        seen_proto: dict[int, set[int]] = {}
        for smp in profile.samples:
            i = self.model.index.get(smp.site_id)
            if i is not None:
                codes = self.model.encode(i, smp.config)
                seen.setdefault(i, set()).add(int(codes[0]))
                seen_proto.setdefault(i, set()).add(int(codes[1]))
        changed = False
        for i, d in enumerate(self.domains_S):
            for knob, names, got in (("algorithm", ALGORITHMS, seen), ("protocol", PROTOCOLS, seen_proto)):
                values = d[knob]
                if len(values) > 1 and i in got:
                    kept = tuple(v for v in values if names.index(v) in got[i])
                    if kept and kept != values:
                        d[knob] = kept
                        changed = True
        if changed:
            self._encode_domains()

    def _encode_domains(self) -> None:
        """vals[knob]: (S, K) float codes padded with NaN; tunable[knob]: (S,) bool."""
        S = len(self.sites)
        self.vals: dict[str, np.ndarray] = {}
        self.tunable: dict[str, np.ndarray] = {}
        for knob in SEARCH_KNOBS:
            rows = [self._codes(knob, d[knob]) for d in self.domains_S]
            K = max((len(r) for r in rows), default=1)
            arr = np.full((S, K), np.nan)
            for i, r in enumerate(rows):
                arr[i, : len(r)] = r
            self.vals[knob] = arr
            self.tunable[knob] = np.array([len(d[knob]) > 1 for d in self.domains_S], dtype=bool)

    @staticmethod
    def _codes(knob: str, values: tuple) -> list[float]:
        if values == (None,):
            return []
        if knob == "algorithm":
            return [float(ALGORITHMS.index(v)) for v in values]
        if knob == "protocol":
            return [float(PROTOCOLS.index(v)) for v in values]
        if knob == "chunk_size":
            return [float(i) for i in range(len(values))]  # levels: index in (None,) + chunk_domain
        return [float(v) for v in values]

    def default_state(self) -> State:
        """NCCL's own choice for every site (the model's approximation of it)."""
        alg, proto, nc, nt, _ = self.model.default_codes_cached()
        return State(
            alg.astype(np.int64).copy(),
            proto.astype(np.int64).copy(),
            nc.astype(float).copy(),
            nt.astype(float).copy(),
            np.zeros(len(self.sites), dtype=np.int64),
        )

    def chunk_bytes(self, proto: np.ndarray, lvl: np.ndarray) -> np.ndarray:
        return _CHUNK_LEVELS[proto, lvl]

    def evaluate(self, st: State, idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(t_comm, s, t_region) of the sites ``idx`` (all when None) under state ``st``."""
        if idx is None:
            idx = np.arange(len(self.sites))
        return self.model.evaluate(
            idx, st.alg[idx], st.proto[idx], st.nc[idx], st.nt[idx], self.chunk_bytes(st.proto[idx], st.lvl[idx])
        )

    def evaluate_codes(self, idx, alg, proto, nc, nt, lvl):
        """``evaluate`` on explicit broadcastable code arrays; incompatible algorithm / protocol pairs take inf."""
        alg = np.asarray(alg, dtype=np.int64)
        proto = np.asarray(proto, dtype=np.int64)
        lvl = np.asarray(lvl, dtype=np.int64)
        t_comm, s, t_region = self.model.evaluate(idx, alg, proto, nc, nt, self.chunk_bytes(proto, lvl))
        bad = ~_COMPAT[alg, proto]
        if np.any(bad):
            t_comm = np.where(bad, np.inf, t_comm)
            t_region = np.where(bad, np.inf, t_region)
        return t_comm, s, t_region

    def shared_units(self) -> list[tuple[str, str, np.ndarray]]:
        """(knob, unit key, site indices) per tunable knob of process (one unit) or communicator scope (one each)."""
        units = []
        for knob in SEARCH_KNOBS:
            scope = self.scope.get(knob)
            if scope not in ("communicator", "process"):
                continue
            governed = np.flatnonzero(self.tunable[knob])
            if governed.size == 0:
                continue
            if scope == "process":
                units.append((knob, "process", governed))
            else:
                # NCCL_ALGO / NCCL_PROTO take per-function lists (2.24+): one value per op there.
                per_op = knob in ("algorithm", "protocol")
                keys = [f"comm:{self.comm_S[i]}" + (f":{self.sites[i].op}" if per_op else "") for i in governed]
                for key in dict.fromkeys(keys):
                    units.append((knob, key, np.array([i for i, k in zip(governed, keys) if k == key])))
        return units

    def tie_sets(self) -> list[np.ndarray]:
        """Site index sets sharing a ``rules.call_keys`` key (NCCL's tuner sees only communicator, op and bytes)."""
        key_fn = getattr(self.rules, "call_keys", None)
        parent = list(range(len(self.sites)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        first: dict[Any, int] = {}
        for i, s in enumerate(self.sites):
            for k in key_fn(s) if key_fn is not None else ():
                j = first.setdefault(k, i)
                parent[root(i)] = root(j)
        sets: dict[int, list[int]] = {}
        for i in range(len(self.sites)):
            sets.setdefault(root(i), []).append(i)
        return [np.array(members) for members in sets.values()]

    def tie_indistinguishable(self, st: State) -> tuple[State, int]:
        """``st`` with one config per ``tie_sets`` set (the member config of least summed region), and sites changed."""
        if getattr(self.rules, "call_keys", None) is None:
            return st, 0
        out, changed = st.copy(), 0
        for idx in self.tie_sets():
            if idx.size < 2:
                continue
            codes = np.stack([out.alg[idx], out.proto[idx], out.nc[idx], out.nt[idx], out.lvl[idx]], axis=1)
            if np.array_equal(codes, np.broadcast_to(codes[0], codes.shape)):
                continue
            cands = np.unique(codes, axis=0)
            totals = [float(np.sum(self.evaluate_codes(idx, c[0], c[1], c[2], c[3], c[4])[2])) for c in cands]
            best = cands[int(np.argmin(totals))]
            changed += int(np.sum(np.any(codes != best, axis=1)))
            out.alg[idx], out.proto[idx], out.nc[idx], out.nt[idx], out.lvl[idx] = best
        return out, changed

    def make_plan(
        self,
        st: State | None,
        *,
        method: str,
        stats: dict[str, Any],
        peer: dict[int, int] | None = None,
        fast: set[int] | None = None,
    ) -> Plan:
        """A Plan from a final state (None: NCCL's everywhere); ``peer`` and ``fast`` are decided on it unless given."""
        if st is not None:
            st, tied = self.tie_indistinguishable(st)
            if tied:
                stats = {**stats, "tied_sites": tied}
            st, over = self.within_channel_cap(st)
            if over:
                stats = {**stats, "sites_reset_over_channel_cap": over}
        default = self.default_state()
        d_comm, _, d_region = self.evaluate(default)
        use = st if st is not None else default
        if peer is None:
            peer = p2p_knobs.decide(self, st) if st is not None else {}
        with p2p_knobs.applied(self, peer):
            if fast is None:
                fast = stream_priority.decide(self, st) if st is not None else set()
            with stream_priority.applied(self, fast):
                t_comm, _, t_region = self.evaluate(use)
        configs = self._configs(st) if st is not None else [CommConfig()] * len(self.sites)
        if peer and self.rules.scope(p2p_knobs.KNOB) == "communicator":
            configs = [replace(c, net_peer_channels=peer[i]) if i in peer else c for i, c in enumerate(configs)]
        configs = [replace(c, high_priority_stream=True) if i in fast else c for i, c in enumerate(configs)]
        t_comm_l, t_region_l, d_region_l = (np.round(x, 3).tolist() for x in (t_comm, t_region, d_region))
        tunable = self.tunable_knobs()
        notes = self.notes_S or [""] * len(self.sites)
        entries = {
            site.site_id: PlanEntry(
                config=configs[i],
                predicted_t_comm_us=t_comm_l[i],
                predicted_t_region_us=t_region_l[i],
                predicted_default_t_region_us=d_region_l[i],
                group=site.group,
                op=site.op,
                nbytes=site.nbytes,
                group_size=site.group_size,
                n_nodes=site.n_nodes,
                tunable=tunable[i],
                note=notes[i],
                reduce_op=site.reduce_op,
                parts=site.parts,
            )
            for i, site in enumerate(self.sites)
        }
        chosen: dict[str, list[int]] = {}
        for knob in SEARCH_KNOBS:
            if st is not None and self.scope.get(knob) == "process" and self.tunable[knob].any():
                chosen[knob] = sorted({int(st.get(knob)[i]) for i in np.flatnonzero(self.tunable[knob])})
        if peer and self.rules.scope(p2p_knobs.KNOB) == "process":
            chosen[p2p_knobs.KNOB] = sorted(set(peer.values()))
        env = self.rules.process_env(chosen) if chosen else {}
        default_iter = self.iteration_us
        predicted = self.iteration_us - float(d_region.sum()) + float(t_region.sum())
        stats = {
            **stats,
            "n_sites": len(self.sites),
            "default_iteration_us": round(default_iter, 3),
            "predicted_default_iteration_us": round(default_iter, 3),
            "predicted_iteration_us": round(predicted, 3),
            "predicted_speedup": round(default_iter / predicted, 4) if predicted > 0 else None,
            "model_mape_pct": None if np.isnan(self.model.mape) else round(self.model.mape, 3),
            "model_mape_floor_pct": None if np.isnan(self.model.mape_floor) else round(self.model.mape_floor, 3),
            "model_wape_pct": None if np.isnan(self.model.wape) else round(self.model.wape, 3),
        }
        return Plan(
            entries=entries,
            fingerprint=dict(self.fingerprint),
            method=method,
            env=env,
            stats=stats,
            backend=self.backend,
            mechanism=self.mechanism,
        )

    def within_channel_cap(self, st: State) -> tuple[State, int]:
        """``st`` with no site that moved other knobs while keeping NCCL's own channel count above the rules'
        ``channel_cap`` (the pool budget): its pool entry would hold NCCL's own channels, which the budget never
        allowed. Each such site takes the largest channel count its domain allows, or NCCL's defaults where that
        predicts a longer region; (state, sites changed)."""
        cap = getattr(self.rules, "channel_cap", lambda: None)()
        if cap is None:
            return st, 0
        d = self.default_state()
        moved = np.zeros(len(self.sites), dtype=bool)
        for knob in SEARCH_KNOBS:
            moved |= st.get(knob) != d.get(knob)
        over = np.flatnonzero(moved & (st.nc == d.nc) & (d.nc > cap) & self.tunable["n_channels"])
        if over.size == 0:
            return st, 0
        capped = st.copy()
        capped.nc[over] = [max(n for n in self.domains_S[i]["n_channels"] if n is not None) for i in over]
        worse = over[self.evaluate(capped)[2][over] > self.evaluate(d)[2][over]]
        for knob in SEARCH_KNOBS:
            capped.get(knob)[worse] = d.get(knob)[worse]
        return capped, int(over.size)

    def tunable_knobs(self) -> list[tuple[str, ...]]:
        """Per site, the knobs whose domain holds more than NCCL's own value, in ``KNOB_ORDER``."""
        return [tuple(k for k in KNOB_ORDER if len(d.get(k, (None,))) > 1) for d in self.domains_S]

    def _configs(self, st: State) -> list[CommConfig]:
        """Untunable knobs None; ``CommConfig()`` for a site left at the default (P2P: at NCCL's own CTA count)."""
        tun = {k: self.tunable[k].tolist() for k in SEARCH_KNOBS}
        chunk = self.chunk_bytes(st.proto, st.lvl).astype(np.int64).tolist()
        alg, proto, nc, nt = (x.astype(np.int64).tolist() for x in (st.alg, st.proto, st.nc, st.nt))
        d = self.default_state()
        same_nc = st.nc == d.nc
        p2p = getattr(self.model, "p2p", None)
        if p2p is not None and p2p.any:
            # a P2P bound that gives the kernel NCCL's own CTAs changes nothing: no entry for it
            idx = np.arange(len(self.sites))
            same_nc |= p2p.mask_S & (p2p.ctas(idx, st.nc) == p2p.ctas(idx, d.nc))
        # NCCL's own channels under NCCL's own algorithm and protocol: left to NCCL (a site that moved only its chunk
        # or threads must not pin a channel count its group's pool budget never allowed)
        own_nc = (same_nc & (st.alg == d.alg) & (st.proto == d.proto)).tolist()
        unchanged = ((st.alg == d.alg) & (st.proto == d.proto) & same_nc & (st.nt == d.nt) & (st.lvl == d.lvl)).tolist()
        out = []
        for i in range(len(self.sites)):
            if unchanged[i]:
                out.append(CommConfig())
                continue
            out.append(
                CommConfig(
                    algorithm=ALGORITHMS[alg[i]] if tun["algorithm"][i] and alg[i] != ALG_NONE else None,
                    protocol=PROTOCOLS[proto[i]] if tun["protocol"][i] and proto[i] != PROTO_NONE else None,
                    n_channels=nc[i] if tun["n_channels"][i] and not own_nc[i] else None,
                    n_threads=nt[i] if tun["n_threads"][i] else None,
                    chunk_size=chunk[i] if tun["chunk_size"][i] and chunk[i] > 0 else None,
                )
            )
        return out


Searcher = Callable[[SearchProblem], SearchResult]
SEARCHERS: dict[str, Searcher] = {}


def register(name: str) -> Callable[[Searcher], Searcher]:
    """Registry decorator, ``@register("priority")``; ValueError if the name is taken."""

    def wrap(fn: Searcher) -> Searcher:
        if name in SEARCHERS:
            raise ValueError(f"searcher {name!r} is already registered")
        SEARCHERS[name] = fn
        return fn

    return wrap


class Timer:
    """Wall-clock seconds since construction (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


def compat(alg: np.ndarray, proto: np.ndarray) -> np.ndarray:
    """True where NCCL runs algorithm code ``alg`` with protocol code ``proto``."""
    return _COMPAT[alg, proto]


SIMPLE = _SIMPLE
