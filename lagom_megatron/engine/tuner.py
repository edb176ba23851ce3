"""The tuning lifecycle: profile -> probe -> fit + search -> agree -> verify -> applied | fell back.

A backend-agnostic state machine that the real Megatron integration (NCCL or gloo) and the
simulated cluster (``lagom_megatron.sim``) both drive the same way, one training iteration at a
time::

    tuner = Tuner(Tuner.Config(), rules=NcclRules(spec), fingerprint=fp, agree=broadcast_plan)
    for it in range(train_iters):
        step = tuner.start_iteration(it)        # what to apply: step.assignment, step.serialize
        ... run the iteration with step.assignment (site id -> CommConfig; missing = NCCL defaults),
            waiting on every collective at launch when step.serialize is true ...
        tuner.finish_iteration(IterationMeasurement(iteration=it, iteration_us=..., sites=..., samples=...))

The tuner sees only what the backend measured (``IterationMeasurement``: sites and per-region
samples) and hands the search only a ``Profile``; it never sees how the timings came about.

Schedule (a fixed number of iterations, independent of the number of sites; docs/engine.md):

    PROFILING  ``warmup_iters`` untimed iterations under defaults (allocator, communicator warm-up)
               1 iteration under defaults, overlapped: every site's T_comm and T_region, and the
                 default iteration time
               1 "serialized" iteration under defaults: every collective is waited on at launch, so
                 the compute of each region runs alone; its per-site ``t_comp_us`` is T_comp
    PROBING    1 iteration per probe config (``rules.probe_configs()``), applied to all sites at once:
                 each gives every region one more (config, T_comm, T_region) point
    SEARCHED   the cost model is fitted (``fit.fit_cost_model``) and searched (``search.search``) at the
               end of the last probe iteration; ``agree(plan)`` makes the ranks consistent
    VERIFYING  plan and defaults alternate, ``verify_iters`` timed iterations each (the first
               iteration under the plan is not timed: communicator pool creation); an undecided
               verdict doubles the pairs up to ``verify_max_iters`` (``verify_looks``)
    APPLIED    the plan's gain over the defaults beat the noise rule's bound and the minimum gain
    FELL_BACK  it did not, or fit / search / agreement failed: defaults from then on, with the reason

What was measured is kept by a ``recorder.ProfileRecorder`` (which also fills every sample's T_comp
from the serialized iteration); the verdict is ``verify.sequential_verdict``; the types a backend sees are in
``steps.py``.

The priority search, the cost model and the verification rule follow docs/engine.md; the
lifecycle and the serialized-iteration measurement of T_comp are our design (the Lagom paper's
text on profiling is not available).
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable

from lagom_megatron.engine.knobs import CommConfig, KnobRules
from lagom_megatron.engine.profile import BACKENDS, Profile
from lagom_megatron.engine.recorder import ProfileRecorder
from lagom_megatron.engine.steps import IterationMeasurement, Phase, Step
from lagom_megatron.engine.tuner_config import TunerConfig
from lagom_megatron.engine.verify import sequential_verdict

log = logging.getLogger("lagom.tuner")


class Tuner:
    """The lifecycle state machine (module docstring). One instance per training run and rank.

    Args:
        config: ``Tuner.Config``.
        rules: the knob rules of the mechanism that applies plans (``knobs.KnobRules``): the
            probe configs, the search domain, and the cluster (``rules.cluster``, passed to
            ``fit.fit_cost_model`` and recorded in the profile) and backend label (``rules.backend``:
            ``nccl``, ``gloo`` or ``sim``) of the profile.
        fingerprint: what is being tuned (model, layout, world size, cluster, versions); copied into
            the profile and hence the plan.
        agree: ``agree(plan) -> plan`` called once on the searched plan, e.g. broadcast rank 0's plan
            and check digests. Raising any exception makes the tuner fall back to defaults. When
            the fit or search fails on this rank, it is called with ``None`` (it is collective, so
            the other ranks must hear of the failure) and its outcome is ignored.

    Every rank must feed the same (all-gathered) measurements: fit and search are deterministic,
    so all ranks then reach ``agree`` in the same iteration, or fall back in the same iteration.

    Raises:
        ValueError: rules with an unknown backend label.
    """

    Config = TunerConfig
    """The tuner's settings (``tuner_config.TunerConfig``)."""

    def __init__(
        self,
        config: "Tuner.Config",
        *,
        rules: KnobRules,
        fingerprint: dict[str, Any] | None = None,
        agree: Callable[[Any], Any] | None = None,
    ) -> None:
        if rules.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}; got {rules.backend!r}")
        self.config = config
        self.rules = rules
        self.cluster = rules.cluster
        self.backend = rules.backend
        self.fingerprint = dict(fingerprint or {})
        self.agree = agree
        self.phase = Phase.PROFILING
        self.reason = ""
        """Why the tuner ended where it did (APPLIED or FELL_BACK), one line."""
        self.plan: Any = None
        """The searched (and agreed) Plan, once SEARCHED; kept for inspection after a fall-back."""
        self.profile: Profile | None = None
        self.search_stats: dict[str, Any] = {}
        self.model_mape: float | None = None
        self.events: list[tuple[int, str, str]] = []
        """(iteration, phase, message) for each transition, for reports and ``lagom simulate``."""
        self._probes: list[CommConfig] | None = None
        self._rec = ProfileRecorder(backend=self.backend, cluster_name=self.cluster.name, fingerprint=self.fingerprint)
        """The measurements of the profiling iterations (sites, T_comp, samples, excluded sites)."""
        self._verify_plan_us: list[float] = []
        self._verify_default_us: list[float] = []
        self._started: Step | None = None
        self._last_finished = -1
        self._n_finished = 0
        self._from_plan = False

    # ------------------------------------------------------------------ schedule

    @property
    def probes(self) -> list[CommConfig]:
        """The probe configs, resolved once (``Config.probe_configs`` or ``rules.probe_configs()``)."""
        if self._probes is None:
            if self.config.probe_configs is not None:
                self._probes = list(self.config.probe_configs)
            else:
                self._probes = list(self.rules.probe_configs())
            if any(p.is_default() for p in self._probes):
                raise ValueError("probe configs must differ from NCCL defaults (the default iteration is already measured)")
        return self._probes

    @property
    def profiling_iters(self) -> int:
        """Iterations from start to the search: warm-up + default + serialized + one per probe."""
        return self.config.warmup_iters + 2 + len(self.probes)

    @property
    def verify_looks(self) -> tuple[int, ...]:
        """Pairs (plan, defaults) after which verification takes its verdict (``TunerConfig.looks``)."""
        return self.config.looks()

    @property
    def total_iters(self) -> int:
        """Iterations to the latest verdict: profiling (none after ``start_from_plan``), one settle iteration with
        the plan (where the observed check runs), then up to the last look's pairs (``verify_looks``), two
        iterations each. The earliest verdict comes ``2 x (last - first look)`` iterations sooner."""
        return (0 if self._from_plan else self.profiling_iters) + 1 + 2 * self.verify_looks[-1]

    def start_from_plan(self, plan: Any) -> None:
        """Skips profiling and search: verifies ``plan`` (e.g. a saved plan that was never
        verified, such as one from ``lagom search``) against the defaults, then APPLIED or FELL_BACK.

        Raises:
            RuntimeError: called after the first iteration started, or with a plan that tunes no site.
        """
        if self._n_finished or self._started is not None or self.phase is not Phase.PROFILING:
            raise RuntimeError(f"start_from_plan: the tuner already ran {self._n_finished} iteration(s), "
                               f"phase {self.phase.name}; call it before the first iteration")
        if not any(not e.config.is_default() for e in plan.entries.values()):
            raise RuntimeError("start_from_plan: the plan keeps NCCL defaults for every site; nothing to verify")
        self.plan = plan
        self.phase = Phase.SEARCHED
        self._from_plan = True
        self._log(self._last_finished, "plan given: profiling and search skipped")

    def next_step(self) -> Step:
        """What the next iteration (``self._n_finished``-th since start) must do; no state change."""
        n = self._n_finished
        it = self._last_finished + 1
        warm = self.config.warmup_iters
        if self.phase in (Phase.PROFILING, Phase.PROBING):
            if n < warm:
                return Step(iteration=it, kind="warmup", assignment={}, timed=False)
            if n == warm:
                return Step(iteration=it, kind="default", assignment={})
            if n == warm + 1:
                return Step(iteration=it, kind="serialized", assignment={}, serialize=True)
            k = n - warm - 2
            return Step(iteration=it, kind="probe", assignment=self._probe_assignment(k), probe_index=k)
        if self.phase in (Phase.SEARCHED, Phase.VERIFYING):
            if self.phase is Phase.SEARCHED:
                return Step(iteration=it, kind="settle", assignment=self._plan_assignment(), timed=False)
            done = len(self._verify_plan_us) + len(self._verify_default_us)
            if done % 2 == 0:
                return Step(iteration=it, kind="verify-default", assignment={})
            return Step(iteration=it, kind="verify-plan", assignment=self._plan_assignment())
        if self.phase is Phase.APPLIED:
            return Step(iteration=it, kind="applied", assignment=self._plan_assignment(), timed=False)
        return Step(iteration=it, kind="fell-back", assignment={}, timed=False)

    def revert_sites(self, site_ids: Any, reason: str) -> None:
        """Drops ``site_ids`` from the searched plan for good (FELL_BACK when none stays tuned)."""
        self.plan = self.plan.with_defaults(site_ids, note=reason)
        self._log(self._last_finished, f"{len(site_ids)} site(s) back to NCCL's defaults: {reason}")
        if all(e.config.is_default() for e in self.plan.entries.values()):
            self._fall_back(self._last_finished, f"every tuned site was reverted: {reason}")

    def assignment(self) -> dict[str, CommConfig]:
        """Site id -> CommConfig to apply in the next iteration (empty = NCCL defaults everywhere)."""
        return self.next_step().assignment

    @property
    def iterations_finished(self) -> int:
        """Iterations finished since the tuner started (warm-up included)."""
        return self._n_finished

    @property
    def done(self) -> bool:
        """True once APPLIED or FELL_BACK: nothing left to measure."""
        return self.phase in (Phase.APPLIED, Phase.FELL_BACK)

    def probe_assignments(self) -> list[dict[str, CommConfig]]:
        """Site id -> config of every probe iteration, in order (known once the default
        iteration has named the sites): what a backend must be ready to apply, e.g. the
        communicator-pool entries to create before the first probe."""
        return [self._probe_assignment(k) for k in range(len(self.probes))]

    def _probe_assignment(self, k: int) -> dict[str, CommConfig]:
        """Probe ``k`` for every site, minus the knobs that do not apply to the site's op
        (``rules.applicable``: a send/recv site keeps only what NCCL's P2P path honours)."""
        cfg = self.probes[k]
        return {sid: self.rules.applicable(cfg, op=site.op) for sid, site in self._rec.sites.items()}

    def _plan_assignment(self) -> dict[str, CommConfig]:
        if self.plan is None:
            return {}
        return {sid: e.config for sid, e in self.plan.entries.items() if not e.config.is_default()}

    # ------------------------------------------------------------------ iteration pairs

    def start_iteration(self, iteration: int) -> Step:
        """Marks ``iteration`` as running and returns its ``Step``.

        Optional: a backend may call only ``assignment()`` and ``finish_iteration``. When called,
        the matching ``finish_iteration`` must carry the same iteration number.

        Raises:
            RuntimeError: an iteration was started and not finished, or ``iteration`` does not come
                after the last finished one.
        """
        if self._started is not None:
            raise RuntimeError(
                f"start_iteration({iteration}): iteration {self._started.iteration} was started and not finished"
            )
        if iteration <= self._last_finished:
            raise RuntimeError(f"start_iteration({iteration}): iteration {self._last_finished} already finished")
        step = self.next_step()
        self._started = Step(
            iteration=iteration, kind=step.kind, assignment=step.assignment, serialize=step.serialize,
            timed=step.timed, probe_index=step.probe_index,
        )
        return self._started

    def finish_iteration(self, measurement: IterationMeasurement) -> Phase:
        """Records one iteration's measurement and advances the lifecycle.

        Returns:
            The phase after this iteration.

        Raises:
            RuntimeError: ``measurement.iteration`` differs from the started iteration, or is not
                after the last finished one.

        Bad measurements never raise: the default iteration reporting no sites makes the tuner
        fall back; a site whose sample is missing from a probe iteration, or that reports another
        config than the one assigned, is excluded (it keeps NCCL defaults) with a warning naming
        the site, what was expected and what was found.
        """
        it = measurement.iteration
        if self._started is not None and it != self._started.iteration:
            raise RuntimeError(
                f"finish_iteration({it}): iteration {self._started.iteration} was started; measurements must match"
            )
        if it <= self._last_finished:
            raise RuntimeError(f"finish_iteration({it}): iteration {self._last_finished} already finished")
        step = self.next_step()
        self._started = None
        self._last_finished = it
        self._n_finished += 1
        if step.kind == "default":
            self._record_default(measurement)
        elif step.kind == "serialized":
            self._record_serialized(measurement)
        elif step.kind == "probe":
            self._record_probe(measurement, step.probe_index)
        elif step.kind == "verify-plan":
            self._verify_plan_us.append(measurement.iteration_us)
        elif step.kind == "verify-default":
            self._verify_default_us.append(measurement.iteration_us)
        self._advance(it)
        return self.phase

    # ------------------------------------------------------------------ recording

    def _record_default(self, m: IterationMeasurement) -> None:
        if not self._rec.record_default(m):
            self._fall_back(m.iteration, f"iteration {m.iteration}: no collective sites were reported under defaults; "
                                         "nothing overlapped to tune (are the lagom hooks installed?)")
            return
        self._log(m.iteration, f"profiled {len(self._rec.sites)} sites under defaults: iteration {m.iteration_us / 1e3:.1f} ms")

    def _record_serialized(self, m: IterationMeasurement) -> None:
        self._rec.record_serialized(m)
        self._log(m.iteration, f"serialized iteration: T_comp of {len(self._rec.t_comp_us)} regions, iteration {m.iteration_us / 1e3:.1f} ms")

    def _record_probe(self, m: IterationMeasurement, k: int | None) -> None:
        k = k if k is not None else 0
        cfg = self.probes[k]
        self._rec.record_probe(m, self._probe_assignment(k), what=f"probe iteration {m.iteration} ({cfg.to_dict()})")
        self._log(m.iteration, f"probe {k + 1}/{len(self.probes)} {cfg.to_dict()}: iteration {m.iteration_us / 1e3:.1f} ms")

    # ------------------------------------------------------------------ transitions

    def _advance(self, it: int) -> None:
        if self.phase is Phase.PROFILING and self._n_finished >= self.config.warmup_iters + 2:
            self.phase = Phase.PROBING
        if self.phase is Phase.PROBING and self._n_finished >= self.profiling_iters:
            self._start_search(it)
            return
        if self.phase is Phase.SEARCHED:
            self.phase = Phase.VERIFYING
            points = self.verify_looks
            more = f" (up to {points[-1]} while undecided)" if len(points) > 1 else ""
            self._log(it, f"verifying: plan vs defaults, {points[0]} iterations each{more}, alternating")
            return
        if self.phase is Phase.VERIFYING:
            self._finish_verify(it)

    def build_profile(self) -> Profile:
        """The profile of everything measured so far (``recorder.ProfileRecorder.build_profile``).

        Raises:
            RuntimeError: called before the default and serialized iterations were measured.
        """
        return self._rec.build_profile()

    def _start_search(self, it: int) -> None:
        """PROBING -> SEARCHED (or FELL_BACK): fit the cost model, search, agree on the plan."""
        assert self.phase is Phase.PROBING, f"search started in phase {self.phase.name}"
        from lagom_megatron.engine import fit, search

        self.profile = self.build_profile()
        if not self.profile.sites:
            excluded = self._rec.excluded
            self._fall_back(it, f"no site left to tune ({len(excluded)} of {len(self._rec.sites)} excluded, e.g. "
                                f"{next(iter(excluded.items()), ('-', '-'))})")
            return
        try:
            model = fit.fit_cost_model(self.profile, self.cluster)
            self.model_mape = float(model.mape)
            result = search.search(self.profile, rules=self.rules, method=self.config.method, model=model)
        except Exception as exc:  # noqa: BLE001 - tuning must never stop training: keep defaults, say why
            log.debug("fit/search failure", exc_info=True)
            if self.agree is not None:
                try:  # agree is collective: tell the other ranks, which are waiting in it, that this one failed
                    self.agree(None)
                except Exception:  # noqa: BLE001 - the expected outcome: every rank falls back
                    pass
            self._fall_back(it, f"fit/search failed: {type(exc).__name__}: {exc}")
            return
        self.search_stats = dict(getattr(result, "stats", {}) or {})
        plan = result.plan
        if self.agree is not None:
            try:
                plan = self.agree(plan)
            except Exception as exc:  # noqa: BLE001 - any failure of the hook means "keep defaults"
                self._fall_back(it, f"rank agreement failed: {exc}")
                return
        self.plan = plan
        n_tuned = sum(1 for e in plan.entries.values() if not e.config.is_default())
        if n_tuned == 0:
            self._fall_back(it, f"search ({self.config.method}) kept the defaults for every site")
            return
        self.phase = Phase.SEARCHED
        pred = self.search_stats.get("predicted_iteration_us")
        pred_txt = f", predicted iteration {pred / 1e3:.1f} ms" if isinstance(pred, (int, float)) else ""
        self._log(it, f"searched ({self.config.method}): {n_tuned}/{len(plan.entries)} sites tuned, "
                      f"model MAPE {self.model_mape:.1f}%{pred_txt}")

    def _finish_verify(self, it: int) -> None:
        """VERIFYING -> APPLIED | FELL_BACK at a look of ``verify_looks`` by the noise rule
        (``verify.sequential_verdict``); between looks, or at an undecided one, verification goes on."""
        assert self.phase is Phase.VERIFYING, f"verify finished in phase {self.phase.name}"
        points = self.verify_looks
        v = sequential_verdict(self._verify_plan_us, self._verify_default_us, min_gain=self.config.min_gain,
                               noise_rule=self.config.noise_rule, first=points[0], cap=points[-1])
        if v is None:
            return
        if not v.decided:
            nxt = points[points.index(len(self._verify_plan_us)) + 1]
            self._log(it, f"{v.text}: verifying on to {nxt} iterations each")
            return
        if v.keep:
            self.phase = Phase.APPLIED
            self.reason = v.text
            self._log(it, f"applied: {v.text}")
        else:
            self._fall_back(it, v.text)

    def _fall_back(self, it: int, reason: str) -> None:
        self.phase = Phase.FELL_BACK
        self.reason = reason
        self._log(it, f"fell_back (defaults kept): {reason}")

    def _log(self, it: int, msg: str) -> None:
        self.events.append((it, self.phase.value, msg))
        log.info("lagom [%s] iteration %d: %s", self.phase.value, it, msg)

    # ------------------------------------------------------------------ report

    def summary(self) -> dict[str, Any]:
        """JSON-ready state: phase, reason, iteration medians, gain, model error and search stats."""
        out: dict[str, Any] = {
            "phase": self.phase.value,
            "reason": self.reason,
            "method": self.config.method,
            "iterations_finished": self._n_finished,
            "profiling_iters": self.profiling_iters if self._probes is not None or self.config.probe_configs is not None else None,
            "n_sites": len(self._rec.sites),
            "n_samples": len(self._rec.samples),
            "excluded_sites": dict(self._rec.excluded),
            "default_iteration_us": statistics.median(self._rec.default_us) if self._rec.default_us else None,
            "model_mape_pct": self.model_mape,
            "search": self.search_stats,
            "verify_plan_us": list(self._verify_plan_us),
            "verify_default_us": list(self._verify_default_us),
        }
        if self._verify_plan_us and self._verify_default_us:
            p, d = statistics.median(self._verify_plan_us), statistics.median(self._verify_default_us)
            out["measured_plan_us"], out["measured_default_us"], out["speedup"] = p, d, d / p
        if self.plan is not None and hasattr(self.plan, "digest"):
            out["plan_digest"] = self.plan.digest()
        out["events"] = [{"iteration": i, "phase": p, "message": m} for i, p, m in self.events]
        return out
