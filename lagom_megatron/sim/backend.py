"""The simulated backend: the tuner's interface (assignment in, ``IterationMeasurement`` out) on the simulator."""

from __future__ import annotations

import contextlib
import math
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from lagom_megatron.engine.knobs import DEFAULT, CommConfig
from lagom_megatron.engine.profile import CollectiveSite, Sample
from lagom_megatron.engine.steps import IterationMeasurement, Phase, Step
from lagom_megatron.engine.tuner import DEFAULT_CONFIG, MIN_ITERS, Tuner
from lagom_megatron.nccl.env_vars import launch_nthreads
from lagom_megatron.nccl.rules import NcclRules
from lagom_megatron.sim import timeline
from lagom_megatron.sim.constants import get
from lagom_megatron.sim.device import CommCost, Gpu, comm_cost, resolve_config
from lagom_megatron.sim.workload import Workload, steady_copies


class SimulatedCluster:
    """One preset on a simulated GPU cluster (``nthreads`` None: the preset's); ValueError for gloo or a bad layout."""

    def __init__(self, preset: Any, cluster: Any = None, *, seed: int = 0, nthreads: int | None = None) -> None:
        from lagom_megatron.engine.cluster import ClusterSpec

        spec = ClusterSpec.load(cluster or preset.cluster)
        if getattr(spec, "backend", "nccl") != "nccl":
            raise ValueError(
                f"cluster {spec.name!r} is a {spec.backend} cluster; the simulator models GPU clusters "
                f"(nccl): one of {gpu_clusters()} or a GPU cluster YAML"
            )
        self.preset = preset
        self.cluster = spec
        self.gpu = Gpu.from_cluster(spec)
        self.workload = Workload.from_preset(preset, self.gpu)
        self.seed = seed
        self.nthreads = nthreads if nthreads is not None else launch_nthreads(preset.env)
        self._prog = self.workload.program()
        self._win = timeline.windows(self._prog)
        self._sites = self.workload.sites()
        self._site_calls: dict[str, list[int]] = {}
        for i, c in enumerate(self._prog.calls):
            if c.site_id is not None:
                self._site_calls.setdefault(c.site_id, []).append(i)
        self._cost_cache: dict[tuple, CommCost] = {}
        self.high_priority: frozenset[str] = frozenset()
        """Groups on high-priority streams by default (``--high-priority-stream-groups``)."""
        self.registered: frozenset[str] = frozenset()
        """Groups whose buffers this launch registers by default (``--use-nccl-ub``)."""

    @contextlib.contextmanager
    def registering(self, groups: Any) -> Iterator[None]:
        """A launch that registers ``groups``' buffers (``--use-nccl-ub``), such as the next one that reuses a plan
        of ``registered_groups``: iterations and lifecycles inside run with them registered."""
        before, self.registered = self.registered, frozenset(groups)
        try:
            yield
        finally:
            self.registered = before

    @property
    def sites(self) -> list[CollectiveSite]:
        """The sites the real hooks would report for this preset."""
        return list(self._sites)

    def fingerprint(self) -> dict[str, Any]:
        """Preset, model layout, world size and cluster."""
        w = self.workload
        return {
            "preset": self.preset.name,
            "cluster": self.cluster.name,
            "world_size": self.preset.world_size,
            "tp": w.tp,
            "pp": w.pp,
            "cp": w.cp,
            "dp": w.dp,
            "ep": w.ep,
            "vpp": w.chunks,
            "microbatches": w.microbatches,
            "backend": "sim",
        }

    def _cost(
        self,
        i: int,
        cfg: CommConfig,
        channel_cap: int | None,
        *,
        registered: bool = False,
        fork: bool = False,
        channel_floor: int | None = None,
    ) -> CommCost:
        coll = self._prog.calls[i].coll
        if registered:
            coll = replace(coll, registered=True)
        # NCCL_NTHREADS is read once per process (docs/nccl.md): the launch's value applies, unless ``fork``
        if not (fork and cfg.n_threads is not None):
            cfg = replace(cfg, n_threads=self.nthreads)
        cfg = replace(cfg, high_priority_stream=None)  # the stream's priority is the timeline's, not the kernel's
        key = (coll, cfg, channel_cap, channel_floor)
        hit = self._cost_cache.get(key)
        if hit is None:
            r = resolve_config(self.gpu, coll, cfg)
            if channel_floor is not None and r.algorithm in ("Ring", "Tree") and r.n_channels < channel_floor:
                r = replace(r, n_channels=min(channel_floor, self.gpu.max_channels))
            if channel_cap is not None and r.n_channels > channel_cap:
                r = replace(r, n_channels=channel_cap)
            hit = self._cost_cache[key] = comm_cost(self.gpu, coll, r)
        return hit

    def run_iteration(
        self,
        step: Step | None = None,
        *,
        iteration: int = 0,
        assignment: dict[str, CommConfig] | None = None,
        serialize: bool = False,
        channel_cap: int | None = None,
        noise: bool = True,
        free_comm: bool = False,
        zero_comm: bool = False,
        group_caps: dict[str, int] | None = None,
        group_floors: dict[str, int] | None = None,
        high_priority: frozenset[str] | None = None,
        registered: frozenset[str] | None = None,
        fork: bool = False,
    ) -> IterationMeasurement:
        """One iteration (``step``, else ``iteration`` / ``assignment`` / ``serialize``), us. ``group_caps``: group ->
        ``ncclConfig_t.maxCTAs`` (NCCL v2.30.7 src/graph/connect.cc:503, src/graph/paths.cc:984); ``group_floors``:
        group -> ``minCTAs`` (Ring / Tree CTAs raised to it); ``free_comm``: collectives hold no SM and no HBM;
        ``zero_comm``: they also take no time; ``fork``: per-call threads."""
        if step is not None:
            iteration, assignment, serialize = step.iteration, step.assignment, step.serialize
        assignment = assignment or {}
        unknown = sorted(set(assignment) - set(self._site_calls))
        if unknown:
            raise ValueError(f"assignment names {len(unknown)} unknown site(s), e.g. {unknown[:3]}")
        calls = self._prog.calls
        caps, floors = group_caps or {}, group_floors or {}
        registered = self.registered if registered is None else registered
        configs = [assignment.get(c.site_id, DEFAULT) if c.site_id else DEFAULT for c in calls]
        costs = [
            self._cost(
                i,
                cfg,
                _min_cap(channel_cap, caps.get(c.stream)),
                registered=c.stream in registered,
                fork=fork,
                channel_floor=floors.get(c.stream),
            )
            for i, (c, cfg) in enumerate(zip(calls, configs))
        ]
        # a site routed to a pool entry made with is_high_priority_stream runs on that entry's stream
        hp_calls = frozenset(i for i, cfg in enumerate(configs) if cfg.high_priority_stream)
        if free_comm or zero_comm:
            costs = [replace(c, ctas=0, hbm_mult=0.0) for c in costs]
        if zero_comm:
            costs = [replace(c, latency_us=0.0, wire_bytes=0.0) for c in costs]
        seed = hash((self.seed, iteration)) & 0x7FFFFFFF
        sig = {} if noise else {"sigma_comp": 0.0, "sigma_comm": 0.0}
        res = timeline.run(
            self._prog,
            self.gpu,
            costs,
            serialize=serialize,
            cdmc1=self.workload.cdmc1,
            seed=seed,
            win=self._win,
            high_priority=frozenset(self.high_priority if high_priority is None else high_priority),
            high_priority_calls=hp_calls,
            **sig,
        )
        self.last_timeline = res
        w = self.workload
        steady = 0.0
        if steady_copies(w) > 0:
            steady = res.mb_start_us[2] - res.mb_start_us[1]
        total = res.total_us + steady_copies(w) * steady
        if noise:
            total *= 1.0 + random.Random(seed ^ 0x5EED).gauss(0.0, get("sigma_iteration"))
        samples = []
        for site in self._sites:
            idx = self._site_calls[site.site_id]
            scale = site.calls_per_iter / len(idx)
            t_comm = sum(res.calls[i].t_comm_us for i in idx) * scale
            busy = sum(res.calls[i].window_busy_us for i in idx) * scale
            t_region = sum(max(res.calls[i].t_comm_us, res.calls[i].window_busy_us) for i in idx) * scale
            calls = tuple(
                (
                    res.calls[i].t_comm_us,
                    res.calls[i].window_busy_us if serialize else math.nan,
                    max(res.calls[i].t_comm_us, res.calls[i].window_busy_us),
                )
                for i in idx
            )
            samples.append(
                Sample(
                    site_id=site.site_id,
                    config=assignment.get(site.site_id, DEFAULT),
                    t_comm_us=t_comm,
                    t_comp_us=busy if serialize else math.nan,
                    t_region_us=t_region,
                    iteration=iteration,
                    calls=calls,
                )
            )
        return IterationMeasurement(iteration=iteration, iteration_us=total, sites=list(self._sites), samples=samples)


def _min_cap(a: int | None, b: int | None) -> int | None:
    return b if a is None else (a if b is None else min(a, b))


@dataclass(kw_only=True)
class LifecycleResult:
    tuner: Tuner
    steps: list[tuple[Step, float]] = field(default_factory=list)
    final_us: list[float] = field(default_factory=list)

    @property
    def final_median_us(self) -> float:
        return statistics.median(self.final_us)


def gpu_clusters() -> list[str]:
    """Names of the loadable NCCL (GPU) clusters under ``configs/clusters``."""
    from lagom_megatron.engine.cluster import ClusterSpec, available_clusters

    names = []
    for name in available_clusters():
        try:
            if ClusterSpec.load(name).backend == "nccl":
                names.append(name)
        except (ValueError, OSError):
            continue
    return names


def algorithm_probes(rules: NcclRules) -> list[CommConfig]:
    """``rules``' probes plus channels 4 and 12, NVLS at 16 and 24 (sm90 NVSwitch) and Tree at 16."""
    c = rules.cluster
    extra = [CommConfig(n_channels=4), CommConfig(n_channels=12)]  # points of the curve between 2, 8 and 16
    if c.nvswitch and c.sm_arch >= 90:  # NVLS 24: past the GEMM-wave step (Llama-3 8B, 8 H100: 24 gains, not 16 or 32)
        extra += [CommConfig(algorithm="NVLS", n_channels=16), CommConfig(algorithm="NVLS", n_channels=24)]
    extra.append(CommConfig(algorithm="Tree", n_channels=16))
    return list(rules.probe_configs()) + extra


def verify_counts(
    preset: Any, verify_iters: int | None = None, verify_max_iters: int | None = None
) -> tuple[int, int | None]:
    """(first look, cap) of verification: the options, else the preset's; ValueError for a cap below the first look."""
    first = verify_iters if verify_iters is not None else preset.lagom.lagom_verify_iters
    cap = (
        verify_max_iters
        if verify_max_iters is not None
        else (None if verify_iters is not None else preset.lagom.lagom_verify_max_iters)
    )
    if cap is not None and cap < first:
        raise ValueError(f"verify_max_iters {cap} is below verify_iters {first}; allowed: {first} or more")
    return first, cap


def run_lifecycle(
    sim: SimulatedCluster,
    *,
    method: str = DEFAULT_CONFIG.method,
    verify_iters: int = DEFAULT_CONFIG.verify_iters,
    warmup_iters: int = MIN_ITERS,  # nothing to warm in a simulation; more only shifts the seeded noise draws
    after_iters: int = 3,
    probe_configs: list[CommConfig] | None = None,
    first_iteration: int = 0,
    pool_budget_bytes: int | None = None,
    verify_max_iters: int | None = DEFAULT_CONFIG.verify_max_iters,
    plan: Any = None,
) -> LifecycleResult:
    """Runs the whole lifecycle on ``sim`` with the real ``Tuner``, then ``after_iters`` iterations more; with
    ``plan``, a later launch reusing it (``sim.registered``: the groups that launch registers), verified, unprofiled."""
    rules = NcclRules(sim.cluster, backend="sim", pool_budget_bytes=pool_budget_bytes)
    cfg = Tuner.Config(
        warmup_iters=warmup_iters,
        verify_iters=verify_iters,
        verify_max_iters=verify_max_iters,
        method=method,
        probe_configs=probe_configs if probe_configs is not None else algorithm_probes(rules),
    )
    tuner = Tuner(cfg, rules=rules, fingerprint=sim.fingerprint(), registered_now=sim.registered)
    if plan is not None:
        tuner.start_from_plan(plan)
    out = LifecycleResult(tuner=tuner)
    it = first_iteration
    while not tuner.done:
        step = tuner.start_iteration(it)
        m = sim.run_iteration(step)
        out.steps.append((step, m.iteration_us))
        tuner.finish_iteration(m)
        it += 1
    for _ in range(after_iters):
        step = tuner.start_iteration(it)
        m = sim.run_iteration(step)
        out.steps.append((step, m.iteration_us))
        out.final_us.append(m.iteration_us)
        tuner.finish_iteration(m)
        it += 1
    assert tuner.phase in (Phase.APPLIED, Phase.FELL_BACK), tuner.phase
    return out
