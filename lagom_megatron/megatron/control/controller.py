"""``--lagom`` in a training run: the callback that tags, profiles, searches, agrees, applies, verifies."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from lagom_megatron.config.presets import load_preset
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import DEFAULT
from lagom_megatron.engine.plan import Plan
from lagom_megatron.engine.profile import CollectiveSite, Sample
from lagom_megatron.engine.steps import IterationMeasurement, Phase
from lagom_megatron.engine.tuner import DEFAULT_CONFIG, Tuner
from lagom_megatron.megatron import consensus
from lagom_megatron.megatron.control.apply import Applier
from lagom_megatron.megatron.control.observed import log_plan_hits
from lagom_megatron.megatron.hooks import patches
from lagom_megatron.megatron.hooks.profiler import Profiler
from lagom_megatron.megatron.hooks.sites import GroupNames, SiteRegistry, registered_pools
from lagom_megatron.megatron.outputs.report import is_tuned, report_path_for, run_rows, run_summary, write_report
from lagom_megatron.megatron.outputs.run_files import RunFiles, num_microbatches, run_fingerprint, say
from lagom_megatron.megatron.pool.comm_pool import DEFAULT_BUDGET_MIB, CommPool, make_pool_backend, rules_for
from lagom_megatron.nccl.pool import NcclPoolBackend


class LagomController:
    """The ``--lagom`` training callback of one rank (a ``report.RunView``); arguments: ``--lagom-*`` options."""

    def __init__(
        self,
        *,
        warmup_iters: int = DEFAULT_CONFIG.warmup_iters,
        verify_iters: int = DEFAULT_CONFIG.verify_iters,
        verify_max_iters: int | None = DEFAULT_CONFIG.verify_max_iters,
        method: str = DEFAULT_CONFIG.method,
        plan_path: str | None = None,
        report_path: str | None = None,
        cluster: str | None = None,
        preset_name: str | None = None,
        pool_budget_mib: float | None = None,
    ) -> None:
        self.warmup_iters = warmup_iters
        self.verify_iters = verify_iters
        self.verify_max_iters = verify_max_iters
        self.method = method
        self.cluster_name = cluster
        self.preset_name = preset_name
        self.tuner: Any = None
        self.plan: Any = None
        self.registered_now: frozenset[str] = frozenset()
        """Groups whose buffers Megatron registered at this launch (``--use-nccl-ub``)."""
        self.mode = "off"
        """off (not set up), tune (tuner running), reuse (saved plan applied), aborted (error)."""
        self.handle: Any = None
        self.router: Any = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.files = RunFiles(plan_path=plan_path, report_path=report_path, preset_name=preset_name, rank=self.rank)
        self._step: Any = None
        self._t_default: dict[str, tuple[float, float, float]] = {}
        self.t_plan: dict[str, list[float]] = {}
        self.t_verify_default: dict[str, list[float]] = {}
        """Site id -> region times (us) in the verification's plan / default iterations."""
        self.train_iters: int | None = None
        self.last_iteration = 0
        self.applied_us: list[float] = []
        """Iteration times (us) of a reused plan's 2nd-4th iterations."""
        self.last_sites: dict[str, CollectiveSite] = {}
        self._reported = False
        self._n_steps = 0
        self._kind_steps: dict[str, int] = {}
        self.search_ms: float | None = None
        self.pool_budget_mib = pool_budget_mib
        self.backend: str | None = None
        self.cluster: ClusterSpec | None = None
        self.pool: Any = None
        self.applier: Any = None

    @classmethod
    def from_args(cls, args: Any) -> LagomController:
        """Builds the controller from ``pretrain_gpt.py``'s parsed arguments."""
        return cls(
            warmup_iters=args.lagom_warmup_iters,
            verify_iters=args.lagom_verify_iters,
            verify_max_iters=getattr(args, "lagom_verify_max_iters", DEFAULT_CONFIG.verify_max_iters),
            method=args.lagom_method,
            plan_path=args.lagom_plan,
            report_path=args.lagom_report,
            cluster=getattr(args, "lagom_cluster", None),
            preset_name=getattr(args, "preset_name", None),
            pool_budget_mib=getattr(args, "lagom_pool_budget_mib", None),
        )

    def resolve_cluster(self, on_gpu: bool) -> str:
        if self.cluster_name:
            return self.cluster_name
        if not on_gpu:
            return "cpu-gloo"
        if os.environ.get("LAGOM_CLUSTER"):
            return os.environ["LAGOM_CLUSTER"]
        if self.preset_name:
            try:
                return load_preset(self.preset_name).cluster
            except (ValueError, FileNotFoundError):
                pass
        return "h100-sxm-ib400"

    def on_setup(self, ctx: Any) -> None:
        """Installs the hooks and loads a saved plan or starts the tuner (collective on all ranks)."""
        import torch
        from megatron.core import parallel_state

        from lagom_megatron.megatron.hooks.router import SiteRouter

        args = ctx.args
        self.train_iters = getattr(args, "train_iters", None)
        if self.rank != 0:
            logging.getLogger("lagom").setLevel(logging.ERROR)
        on_gpu = torch.cuda.is_available()
        self.backend = "nccl" if on_gpu else "gloo"
        cluster_name = self.resolve_cluster(on_gpu)
        self.cluster = ClusterSpec.load(cluster_name)
        self.fingerprint = run_fingerprint(args, backend=self.backend, cluster=self.cluster.name)
        groups = GroupNames.from_parallel_state()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        pools = registered_pools(ctx.model, lambda g: groups.lookup(g).name)
        self.registered_now = frozenset(g for g, p in pools.items() if p)
        self.registry = SiteRegistry(
            groups,
            num_microbatches=num_microbatches(args),
            registered_pools=pools,
            pp_stage=parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else None,
        )
        n_buckets = self.registry.bind_model(ctx.model)
        self.profiler = Profiler(use_cuda_events=on_gpu)
        budget = DEFAULT_BUDGET_MIB if self.pool_budget_mib is None else self.pool_budget_mib
        self.pool = CommPool(
            make_pool_backend(self.backend), groups, budget_bytes=int(budget * 2**20), registered=pools
        )
        self.router = SiteRouter(self.registry, self.profiler, self.pool, split_chunks=self.backend == "gloo")
        self.applier = Applier(pool=self.pool, router=self.router, files=self.files, cluster=self.cluster)
        configs = []
        for chunk in ctx.model:
            cfg = getattr(chunk, "config", None)
            if cfg is not None and all(cfg is not c for c in configs):
                configs.append(cfg)
        self.handle = patches.install(self.router, model_configs=configs)
        say(
            f"lagom: hooks installed | {len(self.handle.patched)} entry points | {n_buckets} DDP bucket groups | "
            f"backend {self.backend} | cluster {self.cluster.name} | run dir {self.files.run_dir}"
        )
        if self.applier.agree_capabilities(on_gpu=on_gpu) is None:
            self.mode = "aborted"
            return
        self.fingerprint.update(self.applier.fingerprint_part())
        if not self._try_reuse_plan():
            self._start_tuner()
        if self.mode == "tune":
            self._warn_if_too_short(args.train_iters)

    def _try_reuse_plan(self) -> bool:
        """True when a saved plan matching ``fingerprint`` decides the run (reused, rejected, aborted); False: tune."""
        try:
            plan = self.files.saved_plan(self.fingerprint, self.cluster)
        except consensus.PlanDisagreement as exc:
            say(f"lagom: ERROR: {exc}")
            self.mode = "aborted"
            return True
        if plan is None:
            return False
        self.plan = plan
        self.mode = "reuse"
        if plan.method != self.method:
            say(
                f"lagom: WARNING: --lagom-method {self.method} not used: plan {self.files.plan_path} was searched "
                f"with {plan.method}; delete it or pass another --lagom-plan to search with {self.method}"
            )
        if plan.rejected:
            # applying it unverified would undo its verdict; the router keeps its empty assignment
            reason = plan.stats.get("verification_reason") or "no reason saved"
            say(
                f"lagom: phase fell_back | plan {self.files.plan_path} reused (digest {plan.digest()[:12]}) but its "
                f"verification kept the defaults ({reason}) | profiling and search skipped; delete the plan or pass "
                "another --lagom-plan to search again"
            )
            return True
        if self.applier is not None:
            # a ``lagom search`` plan was never trimmed to this run's pool budget (else the pool preflight fails it)
            try:
                plan = self.plan = self.applier.fit_plan_to_budget(plan)
            except ValueError as exc:  # the same on every rank: the plan and the capabilities are agreed
                say(
                    f"lagom: ERROR: plan {self.files.plan_path} cannot be fitted to the pool budget: {exc}; "
                    "NCCL defaults kept"
                )
                self.mode = "aborted"
                return True
        pending = plan.pending_groups(self.registered_now)
        if pending:  # the pre-launch step turns --use-nccl-ub on; here it did not take (e.g. buffers it cannot see)
            say(
                f"lagom: WARNING: plan {self.files.plan_path} registers the buffers of {', '.join(pending)} "
                "(--use-nccl-ub), which this launch did not register: their sites keep NCCL's defaults"
            )
            if all(e.config.is_default() for e in plan.for_launch(self.registered_now).entries.values()):
                say("lagom: phase fell_back | nothing else in the plan to apply | NCCL defaults kept")
                return True
        if plan.stats.get("verification") is None:
            self._start_tuner(plan)
            if self.tuner.done:  # only registered buffers, on NCCL's own kernels: nothing this launch can compare
                if self.rank == 0:
                    self.files.save_plan(
                        plan.verdict(self.tuner.phase.value, self.tuner.reason, registered_now=self.registered_now)
                    )
                say(
                    f"lagom: phase applied | plan {self.files.plan_path} reused (digest {plan.digest()[:12]}) | "
                    f"{self.tuner.reason} | profiling and search skipped"
                )
                return True
            if not self._prepare_pool_for_plan(plan):
                return True
            up_to = "up to " if len(self.tuner.verify_looks) > 1 else ""
            say(
                f"lagom: phase verifying | plan {self.files.plan_path} reused (digest {plan.digest()[:12]}) but never "
                f"verified | profiling and search skipped; {up_to}{self.tuner.total_iters} iterations to verify it"
            )
            return True
        if not self._prepare_pool_for_plan(plan):
            return True
        launch = plan.for_launch(self.registered_now)
        assignment = {sid: e.config for sid, e in launch.entries.items() if not e.config.is_default()}
        self.router.set_assignment(assignment)
        tuned = sum(is_tuned(c.to_dict(), self.backend) for c in assignment.values())
        say(
            f"lagom: phase applied | plan {self.files.plan_path} reused (digest {plan.digest()[:12]}) | "
            f"{tuned}/{len(plan.entries)} sites tuned | profiling and search skipped"
        )
        return True

    def _start_tuner(self, plan: Any = None) -> None:
        caps = self.applier.capabilities if self.backend == "nccl" else None
        rules = rules_for(
            self.backend,
            self.cluster,
            capabilities=caps,
            pool_budget_bytes=self.pool.budget_bytes if self.backend == "nccl" else None,
        )
        for line in getattr(rules, "warnings", lambda: [])():
            say(f"lagom: WARNING: {line}")
        self.tuner = Tuner(
            Tuner.Config(
                warmup_iters=max(1, self.warmup_iters),
                verify_iters=max(1, self.verify_iters),
                verify_max_iters=self.verify_max_iters,
                method=self.method,
            ),
            rules=rules,
            fingerprint=self.fingerprint,
            agree=self._agree,
            registered_now=self.registered_now,
        )
        if plan is not None:
            self.tuner.start_from_plan(plan)
        elif isinstance(getattr(self.pool, "backend", None), NcclPoolBackend) and self.pool.backend.start_probes():
            self.pool.invalidate_keys()  # the probes run on per-communicator entries: no table exists yet
        self.mode = "tune"

    def _warn_if_too_short(self, train_iters: int) -> None:
        # a run that ends before the first verdict is named before it starts (preflight rule_tuning_iterations)
        needed = self.tuner.total_iters
        points = self.tuner.verify_looks
        soonest = needed - 2 * (points[-1] - points[0])
        if soonest <= train_iters < needed:
            say(
                f"lagom: WARNING: --train-iters {train_iters} may end before tuning does: the verdict comes "
                f"after {soonest} iterations, or up to {needed} when it is undecided (--lagom-verify-max-iters "
                f"{points[-1]}); an undecided plan is then saved unverified"
            )

    def _prepare_pool_for_plan(self, plan: Any) -> bool:
        if not self.applier.apply_plan(plan):
            self.mode = "aborted"
            return False
        return True

    def _agree(self, plan: Any) -> Any:
        try:
            if plan is not None:
                try:
                    plan = self.applier.fit_plan_to_budget(plan)
                except ValueError as exc:  # every rank must still reach agree_plan: None tells them all
                    say(f"lagom: ERROR: fitting the plan to the pool budget failed: {exc}")
                    plan = None
            return consensus.agree_plan(plan, from_dict=Plan.from_dict)
        except consensus.PlanDisagreement as exc:
            say(f"lagom: ERROR: {exc}")
            raise

    def on_iteration_start(self, iteration: int) -> None:
        """Applies this iteration's assignment and arms the profiler."""
        # a reused plan times iterations 2-4 for the report; the first is the slowest, with no call period yet
        reuse_timed = self.mode == "reuse" and self.last_iteration >= 1 and len(self.applied_us) < 3
        self.registry.start_iteration(record=(self.mode == "tune" and not self.tuner.done) or reuse_timed)
        if self.mode == "tune" and self.tuner.done:  # the final assignment was set once, in _on_done
            self.profiler.start_iteration(timed=False)
        elif self.mode == "tune":
            step = self._step = self.tuner.start_iteration(iteration)
            self.router.set_assignment(step.assignment)
            # no NCCL kernel timers here (KernelCh): every step that feeds the fit is timed
            self.profiler.start_iteration(timed=step.timed, serialize=step.serialize)
        elif self.mode == "reuse":
            self.profiler.start_iteration(timed=reuse_timed)
        else:
            self.router.set_assignment({})
            self.profiler.start_iteration(timed=False)

    def on_iteration_end(self, iteration: int, elapsed_s: float, loss: float) -> None:
        """Feeds the (all-gathered) measurement to the tuner and acts on its phase changes."""
        self.registry.finish_iteration()
        self.last_iteration = iteration
        timed = self.profiler.timed  # the same on every rank: decides the collective calls below
        timings = self.profiler.finish_iteration()
        if self.applier is not None and not self.applier.check_first_use():
            self.mode = "aborted"
            if self.plan is not None and self.rank == 0:
                self.files.save_plan(
                    self.plan.with_stats(verification="fell_back", verification_reason=self.applier.error)
                )
            self.write_report()
            return
        if self.applier is not None and self.plan is not None and self.mode in ("tune", "reuse"):
            self._check_observed()  # collective once the plan's calls ran: the condition is the same on every rank
        if self.mode == "reuse":
            if timed:
                self.last_sites = {sid: r.to_site() for sid, r in self.registry.records.items()}
                _, merged, it_us, _ = consensus.merge_measurements({}, timings, elapsed_s * 1e6)
                self.applied_us.append(it_us)
                # a rejected plan runs under defaults: its regions are default times, not the plan's
                into = self.t_verify_default if self.plan.rejected else self.t_plan
                for sid, t in merged.items():
                    into.setdefault(sid, []).append(t[2])
            return
        if self.mode != "tune" or self.tuner.done:
            return
        step = self._step
        sites_local = {
            r.site_id: {k: getattr(s, k) for k in CollectiveSite.__slots__}
            for r, s in ((r, r.to_site()) for r in self.registry.records.values())
        }
        if step.timed:
            sites, merged, it_us, calls = consensus.merge_measurements(
                sites_local, timings, elapsed_s * 1e6, self.profiler.call_times
            )
        else:
            sites, merged, it_us, calls = {}, {}, elapsed_s * 1e6, {}
        samples = [
            Sample(
                site_id=sid,
                config=step.assignment.get(sid, DEFAULT),
                t_comm_us=t[0],
                t_comp_us=t[1],
                t_region_us=t[2],
                iteration=iteration,
                calls=calls.get(sid, ()),
            )
            for sid, t in sorted(merged.items())
            if sid in sites
        ]
        measurement = IterationMeasurement(
            iteration=iteration,
            iteration_us=max(it_us, 1e-3),
            sites=[CollectiveSite(**sites[k]) for k in sorted(sites)],
            samples=samples,
        )
        before = self.tuner.phase
        t0 = time.perf_counter()
        try:
            phase = self.tuner.finish_iteration(measurement)
        except (ValueError, RuntimeError) as exc:
            self.mode = "aborted"
            self.router.set_assignment({})
            say(f"lagom: ERROR: tuning aborted at iteration {iteration}: {exc}; NCCL defaults kept, training continues")
            return
        self._n_steps += 1
        self._after_step(step, iteration, measurement, merged, before, phase, (time.perf_counter() - t0) * 1e3)

    def _after_step(
        self,
        step: Any,
        iteration: int,
        m: IterationMeasurement,
        merged: dict,
        before: Phase,
        phase: Phase,
        dt_ms: float,
    ) -> None:
        tuner = self.tuner
        total = tuner.profiling_iters
        if step.kind == "default":
            self._t_default = dict(merged)
            self.last_sites = {s.site_id: s for s in m.sites}
        if step.kind in ("warmup", "default", "serialized", "probe"):
            sites = f"sites {len(m.sites)}" if m.sites else "counting calls per stream"
            of_kind = {"warmup": tuner.config.warmup_iters, "probe": len(tuner.probes), "default": 1, "serialized": 1}
            self._kind_steps[step.kind] = self._kind_steps.get(step.kind, 0) + 1
            say(
                f"lagom: phase profiling (iteration {iteration}, {step.kind} {self._kind_steps[step.kind]}/"
                f"{of_kind[step.kind]}; profiling step {self._n_steps}/{total}) | {sites} | "
                f"iteration {m.iteration_us / 1e3:.1f} ms"
            )
        if step.kind == "default" and phase in (Phase.PROFILING, Phase.PROBING):
            if not self.applier.apply_probes(tuner.probe_assignments(), m.sites):
                self.mode = "aborted"
                self.write_report()
                return
        if step.kind in ("verify-plan", "verify-default"):
            if not self._t_default and m.sites:  # verifying a reused plan: no default profile gave the sites
                self.last_sites = {s.site_id: s for s in m.sites}
            into = self.t_plan if step.kind == "verify-plan" else self.t_verify_default
            for sid, t in merged.items():
                into.setdefault(sid, []).append(t[2])
        if step.kind in ("verify-plan", "verify-default"):
            say(
                f"lagom: phase verifying (iteration {iteration}, {step.kind.split('-')[1]}) | "
                f"iteration {m.iteration_us / 1e3:.1f} ms"
            )
        if before is Phase.PROBING and phase is not Phase.PROBING:
            self._on_searched(phase, dt_ms)
        if phase in (Phase.APPLIED, Phase.FELL_BACK) and before not in (Phase.APPLIED, Phase.FELL_BACK):
            self._on_done(phase)

    def _on_searched(self, phase: Phase, dt_ms: float) -> None:
        tuner = self.tuner
        if tuner.profile is not None and self.rank == 0:
            self.files.save_profile(tuner.profile)
        stats = tuner.search_stats
        n = len(tuner.profile.sites) if tuner.profile is not None else 0
        wall_ms = float(stats.get("wall_time_s", dt_ms / 1e3)) * 1e3
        self.search_ms = wall_ms
        pred, base = stats.get("predicted_iteration_us"), stats.get("default_iteration_us")
        pred_txt = (
            f" | predicted iteration {base / 1e3:.1f} -> {pred / 1e3:.1f} ms"
            if isinstance(pred, (int, float)) and isinstance(base, (int, float))
            else ""
        )
        mape = f" | model MAPE {tuner.model_mape:.1f}%" if tuner.model_mape is not None else ""
        say(
            f"lagom: phase searching | searched {n} sites in {wall_ms:.1f} ms ({tuner.config.method}, "
            f"{stats.get('model_evaluations', '?')} evaluations){pred_txt}{mape}"
        )
        if tuner.plan is not None and phase is Phase.FELL_BACK and tuner.plan.pending_groups(self.registered_now):
            self.plan = tuner.plan  # nothing for this launch; _on_done saves it unverified for the registering one
        if tuner.plan is not None and phase is not Phase.FELL_BACK:
            self.plan = tuner.plan
            if self.rank == 0:
                self.files.save_plan(tuner.plan)
            if not self._prepare_pool_for_plan(tuner.plan):
                if self.rank == 0:  # a later run keeps the defaults instead of failing the same way
                    self.files.save_plan(
                        tuner.plan.with_stats(verification="fell_back", verification_reason=self.applier.error)
                    )
                self.write_report()
                return
            say(
                f"lagom: plan {self.files.plan_path} (digest {tuner.plan.digest()[:12]}) | "
                f"profile {self.files.profile_path}"
            )

    def _on_done(self, phase: Phase) -> None:
        self.router.set_assignment(self.tuner.assignment())
        s = self.tuner.summary()
        if phase is Phase.APPLIED:
            say(
                f"lagom: phase applied | measured {s['measured_default_us'] / 1e3:.1f} -> "
                f"{s['measured_plan_us'] / 1e3:.1f} ms | {self.tuner.reason}"
            )
        else:
            live = self.pool.live
            say(f"lagom: phase fell_back | {self.tuner.reason} | {self.pool.destroy()}/{live} pool entries destroyed")
        if self.plan is not None and self.rank == 0:
            self.files.save_plan(self.plan.verdict(phase.value, self.tuner.reason, registered_now=self.registered_now))
        self.write_report()

    def _check_observed(self) -> None:
        bad = self.applier.check_observed(self.plan)
        if not bad:
            return
        reason = "what ran differed from the plan (observed check)"
        if self.mode == "tune" and self.tuner is not None and not self.tuner.done:
            self.tuner.revert_sites(bad, reason)
            self.plan = self.tuner.plan
            if self.tuner.phase is Phase.FELL_BACK:
                self._on_done(Phase.FELL_BACK)
        else:
            self.plan = self.plan.with_defaults(bad, note=reason)
            if self.rank == 0:
                self.files.save_plan(self.plan)

    def on_train_end(self) -> None:
        """Logs the tuner plugin's row hits, writes the report (if not yet written), removes every hook."""
        try:
            # only a plan applied through the plugin (the agreed mechanism) and never reverted
            applied = self.applier is not None and self.applier.error is None and self.mode in ("tune", "reuse")
            if (
                applied
                and isinstance(self.pool.backend, NcclPoolBackend)
                and self.pool.backend.uses_table
                and self.plan is not None
            ):
                table_plan = getattr(self.applier, "table_plan", None) or self.plan
                # collective: the condition is the same on every rank
                log_plan_hits(table_plan, getattr(self.pool, "groups", None))
            if not self._reported:
                self.write_report()
        finally:
            self.close()

    def close(self) -> None:
        """Removes the hooks (idempotent)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def summary(self) -> dict[str, Any]:
        """JSON-ready state of the run (``report.run_summary``)."""
        return run_summary(self)

    def write_report(self) -> None:
        """Rank 0 writes the report (table + PNG); other ranks return."""
        self._reported = True
        if self.rank != 0 or self.mode == "off":
            return
        summary = self.summary()
        path = report_path_for(self.files.report_path, summary["run_kind"])
        if not (self.files.may_write(path) and self.files.may_write(path.with_suffix(".png"))):
            say(
                f"lagom: WARNING: report not written: {path} belongs to plan {self.files.plan_path}, which could "
                "not be reused nor moved aside"
            )
            return
        try:
            paths = write_report(path, run_rows(self), summary)
        except OSError as exc:
            say(f"lagom: WARNING: report not written to {path}: {exc}")
            return
        say(f"lagom: report {', '.join(str(p) for p in paths)}")
