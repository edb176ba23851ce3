"""The tuning lifecycle: profile -> probe -> fit + search -> agree -> verify -> applied | fell back. Our design.
Iterations: ``warmup_iters`` untimed, default, serialized (T_comp), probes; then plan and defaults alternate."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lagom_megatron.engine.knobs import CommConfig, KnobRules
from lagom_megatron.engine.profile import BACKENDS, Profile
from lagom_megatron.engine.recorder import ProfileRecorder
from lagom_megatron.engine.search import METHODS
from lagom_megatron.engine.steps import IterationMeasurement, Phase, Step
from lagom_megatron.engine.verify import NOISE_RULES, NoiseRule, looks, sequential_verdict

MIN_ITERS = 1
"""Lower bound of each count of :class:`TunerConfig` (iteration 0 warms allocator and communicators: never timed)."""
MAX_WARMUP_ITERS = 1000
MAX_VERIFY_ITERS = 200
MAX_VERIFY_MAX_ITERS = 1000
"""Upper bound of ``--lagom-verify-max-iters`` (a 0.3% gain at 1% noise takes a few hundred pairs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TunerConfig:
    """The ``--lagom-*`` defaults and the verification rule; ValueError on a bad count, cap, method, rule, min_gain."""

    warmup_iters: int = 4
    verify_iters: int = 4
    """Timed iterations per arm (plan, defaults) at verification's first look."""
    verify_max_iters: int | None = None
    """Most timed iterations per arm while undecided (``paired``); None = ``verify_iters``."""
    method: str = "priority"
    min_gain: float = 0.002
    """Smallest relative gain (fraction of the default median) a plan must show to be kept."""
    noise_rule: NoiseRule = "paired"
    probe_configs: list[CommConfig] | None = None
    """Applied to all sites; None = ``rules.probe_configs()``."""

    def __post_init__(self) -> None:
        if self.warmup_iters < MIN_ITERS:
            raise ValueError(
                f"lagom.warmup_iters must be >= {MIN_ITERS} (iteration 0 is never timed); got {self.warmup_iters}"
            )
        if self.verify_iters < MIN_ITERS:
            raise ValueError(f"lagom.verify_iters must be >= {MIN_ITERS}; got {self.verify_iters}")
        if self.verify_max_iters is not None and self.verify_max_iters < self.verify_iters:
            raise ValueError(
                f"lagom.verify_max_iters must be >= verify_iters ({self.verify_iters}) or None; "
                f"got {self.verify_max_iters}"
            )
        if self.method not in METHODS:
            raise ValueError(f"lagom.method must be one of {list(METHODS)}; got {self.method!r}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"lagom.min_gain must be in [0, 1); got {self.min_gain}")
        if self.noise_rule not in NOISE_RULES:
            raise ValueError(f"lagom.noise_rule must be one of {list(NOISE_RULES)}; got {self.noise_rule!r}")

    def looks(self) -> tuple[int, ...]:
        """Pair counts of the verdicts (``verify.looks``); one unless ``paired`` with larger ``verify_max_iters``."""
        cap = self.verify_max_iters or self.verify_iters
        return looks(self.verify_iters, cap) if self.noise_rule == "paired" else (self.verify_iters,)


DEFAULT_CONFIG = TunerConfig()


log = logging.getLogger("lagom.tuner")


class Tuner:
    """One per run and rank, fed equal measurements on every rank. ``agree(plan) -> plan`` (collective) runs once on
    the searched plan, with None after a failed fit/search; raising makes the tuner fall back."""

    Config = TunerConfig

    def __init__(
        self,
        config: Tuner.Config,
        *,
        rules: KnobRules,
        fingerprint: dict[str, Any] | None = None,
        agree: Callable[[Any], Any] | None = None,
        registered_now: Any = (),
    ) -> None:
        if rules.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}; got {rules.backend!r}")
        self.config = config
        self.rules = rules
        self.cluster = rules.cluster
        self.backend = rules.backend
        self.fingerprint = dict(fingerprint or {})
        self.agree = agree
        self.registered_now = frozenset(registered_now)
        """Groups whose buffers this launch registered: a plan's other ``registered_groups`` wait for the next."""
        self.phase = Phase.PROFILING
        self.reason = ""
        self.plan: Any = None
        """The searched (and agreed) Plan; kept after a fall-back."""
        self.profile: Profile | None = None
        self.search_stats: dict[str, Any] = {}
        self.model_mape: float | None = None
        self.events: list[tuple[int, str, str]] = []
        self._probes: list[CommConfig] | None = None
        self._rec = ProfileRecorder(backend=self.backend, cluster_name=self.cluster.name, fingerprint=self.fingerprint)
        self._verify_plan_us: list[float] = []
        self._verify_default_us: list[float] = []
        self._started: Step | None = None
        self._last_finished = -1
        self._n_finished = 0
        self._from_plan = False

    @property
    def probes(self) -> list[CommConfig]:
        """The probe configs, resolved once (``Config.probe_configs`` or ``rules.probe_configs()``)."""
        if self._probes is None:
            if self.config.probe_configs is not None:
                self._probes = list(self.config.probe_configs)
            else:
                self._probes = list(self.rules.probe_configs())
            if any(p.is_default() for p in self._probes):
                raise ValueError(
                    "probe configs must differ from NCCL defaults (the default iteration is already measured)"
                )
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
        """Iterations to the latest verdict: profiling (0 after ``start_from_plan``), 1 settle, 2 per pair."""
        return (0 if self._from_plan else self.profiling_iters) + 1 + 2 * self.verify_looks[-1]

    def start_from_plan(self, plan: Any) -> None:
        """Verifies ``plan`` against the defaults, no profiling; RuntimeError once running or if it tunes no site."""
        if self._n_finished or self._started is not None or self.phase is not Phase.PROFILING:
            raise RuntimeError(
                f"start_from_plan: the tuner already ran {self._n_finished} iteration(s), "
                f"phase {self.phase.name}; call it before the first iteration"
            )
        if not any(not e.config.is_default() for e in plan.for_launch(self.registered_now).entries.values()):
            if plan.registered_groups and not plan.pending_groups(self.registered_now):
                self.plan, self.phase, self._from_plan = plan, Phase.APPLIED, True
                self.reason = f"registered buffers of {', '.join(plan.registered_groups)}: NCCL's own choice, no verify"
                self._log(self._last_finished, f"applied: {self.reason}")
                return
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
        """Site id -> config of every probe iteration, in order; known once the default iteration named the sites."""
        return [self._probe_assignment(k) for k in range(len(self.probes))]

    def _probe_assignment(self, k: int) -> dict[str, CommConfig]:
        cfg = self.probes[k]
        return {sid: self.rules.applicable(cfg, op=site.op) for sid, site in self._rec.sites.items()}

    def _plan_assignment(self) -> dict[str, CommConfig]:
        if self.plan is None:
            return {}
        plan = self.plan.for_launch(self.registered_now)
        return {sid: e.config for sid, e in plan.entries.items() if not e.config.is_default()}

    def start_iteration(self, iteration: int) -> Step:
        """Marks ``iteration`` running (optional); RuntimeError if one is unfinished or it is not after the last."""
        if self._started is not None:
            raise RuntimeError(
                f"start_iteration({iteration}): iteration {self._started.iteration} was started and not finished"
            )
        if iteration <= self._last_finished:
            raise RuntimeError(f"start_iteration({iteration}): iteration {self._last_finished} already finished")
        step = self.next_step()
        self._started = Step(
            iteration=iteration,
            kind=step.kind,
            assignment=step.assignment,
            serialize=step.serialize,
            timed=step.timed,
            probe_index=step.probe_index,
        )
        return self._started

    def finish_iteration(self, measurement: IterationMeasurement) -> Phase:
        """Records a measurement, returns the next phase; RuntimeError on a wrong iteration, never on bad values."""
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

    def _record_default(self, m: IterationMeasurement) -> None:
        if not self._rec.record_default(m):
            self._fall_back(
                m.iteration,
                f"iteration {m.iteration}: no collective sites were reported under defaults; "
                "nothing overlapped to tune (are the lagom hooks installed?)",
            )
            return
        self._log(
            m.iteration,
            f"profiled {len(self._rec.sites)} sites under defaults: iteration {m.iteration_us / 1e3:.1f} ms",
        )

    def _record_serialized(self, m: IterationMeasurement) -> None:
        self._rec.record_serialized(m)
        self._log(
            m.iteration,
            f"serialized iteration: T_comp of {len(self._rec.t_comp_us)} regions, iteration {m.iteration_us / 1e3:.1f} ms",
        )

    def _record_probe(self, m: IterationMeasurement, k: int | None) -> None:
        k = k if k is not None else 0
        cfg = self.probes[k]
        self._rec.record_probe(m, self._probe_assignment(k), what=f"probe iteration {m.iteration} ({cfg.to_dict()})")
        self._log(
            m.iteration, f"probe {k + 1}/{len(self.probes)} {cfg.to_dict()}: iteration {m.iteration_us / 1e3:.1f} ms"
        )

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
        """The profile measured so far; RuntimeError before the default and serialized iterations."""
        return self._rec.build_profile()

    def _start_search(self, it: int) -> None:
        assert self.phase is Phase.PROBING, f"search started in phase {self.phase.name}"
        from lagom_megatron.engine import fit, search

        self.profile = self.build_profile()
        if not self.profile.sites:
            excluded = self._rec.excluded
            self._fall_back(
                it,
                f"no site left to tune ({len(excluded)} of {len(self._rec.sites)} excluded, e.g. "
                f"{next(iter(excluded.items()), ('-', '-'))})",
            )
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
        n_tuned = sum(1 for e in plan.for_launch(self.registered_now).entries.values() if not e.config.is_default())
        if n_tuned == 0:
            pending = plan.pending_groups(self.registered_now)
            if pending:
                self._fall_back(
                    it,
                    f"nothing to apply at this launch: the plan registers the buffers of {', '.join(pending)} "
                    "(--use-nccl-ub) from the next launch that reuses it",
                )
                return
            self._fall_back(it, f"search ({self.config.method}) kept the defaults for every site")
            return
        self.phase = Phase.SEARCHED
        pred = self.search_stats.get("predicted_iteration_us")
        pred_txt = f", predicted iteration {pred / 1e3:.1f} ms" if isinstance(pred, (int, float)) else ""
        self._log(
            it,
            f"searched ({self.config.method}): {n_tuned}/{len(plan.entries)} sites tuned, "
            f"model MAPE {self.model_mape:.1f}%{pred_txt}",
        )

    def _finish_verify(self, it: int) -> None:
        assert self.phase is Phase.VERIFYING, f"verify finished in phase {self.phase.name}"
        points = self.verify_looks
        v = sequential_verdict(
            self._verify_plan_us,
            self._verify_default_us,
            min_gain=self.config.min_gain,
            noise_rule=self.config.noise_rule,
            first=points[0],
            cap=points[-1],
        )
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

    def summary(self) -> dict[str, Any]:
        """JSON-ready state: phase, reason, iteration medians, gain, model error and search stats."""
        out: dict[str, Any] = {
            "phase": self.phase.value,
            "reason": self.reason,
            "method": self.config.method,
            "iterations_finished": self._n_finished,
            "profiling_iters": self.profiling_iters
            if self._probes is not None or self.config.probe_configs is not None
            else None,
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
