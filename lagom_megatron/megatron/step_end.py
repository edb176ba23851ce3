"""The controller's end of a tuning iteration; branches depend only on the tuner's state, the same on every rank."""

from __future__ import annotations

from typing import Any

from lagom_megatron.megatron.run_files import say


def after_step(ctl: Any, step: Any, iteration: int, m: Any, merged: dict, before: Any, phase: Any, dt_ms: float) -> None:
    """The controller's work after one profiled or verified iteration; ``merged``: site id -> (t_comm, t_comp, t_region)
    in us, ``dt_ms``: the tuner's step time."""
    from lagom_megatron.engine.steps import Phase

    tuner = ctl.tuner
    total = tuner.profiling_iters
    if step.kind == "default":
        ctl._t_default = dict(merged)
        ctl._last_sites = {s.site_id: s for s in m.sites}
    if step.kind in ("warmup", "default", "serialized", "probe"):
        sites = f"sites {len(m.sites)}" if m.sites else "counting calls per stream"
        # warmup i/n counts --lagom-warmup-iters; step k/total counts every profiling iteration
        of_kind = {"warmup": tuner.config.warmup_iters, "probe": len(tuner.probes), "default": 1, "serialized": 1}
        ctl._kind_steps[step.kind] = ctl._kind_steps.get(step.kind, 0) + 1
        say(f"lagom: phase profiling (iteration {iteration}, {step.kind} {ctl._kind_steps[step.kind]}/"
            f"{of_kind[step.kind]}; profiling step {ctl._n_steps}/{total}) | {sites} | "
            f"iteration {m.iteration_us / 1e3:.1f} ms")
    if step.kind == "default" and phase in (Phase.PROFILING, Phase.PROBING):
        # the configs the router will route in the probe iterations (probes as each site's op allows)
        if not ctl.applier.apply_probes(tuner.probe_assignments(), m.sites):
            ctl.mode = "aborted"
            ctl.write_report()
            return
    if step.kind in ("verify-plan", "verify-default"):
        if not ctl._t_default and m.sites:  # verifying a reused plan: no default profile gave the sites
            ctl._last_sites = {s.site_id: s for s in m.sites}
        into = ctl._t_plan if step.kind == "verify-plan" else ctl._t_verify_default
        for sid, t in merged.items():
            into.setdefault(sid, []).append(t[2])
    if step.kind in ("verify-plan", "verify-default"):
        say(f"lagom: phase verifying (iteration {iteration}, {step.kind.split('-')[1]}) | "
             f"iteration {m.iteration_us / 1e3:.1f} ms")
    if before is Phase.PROBING and phase is not Phase.PROBING:
        on_searched(ctl, iteration, phase, dt_ms)
    if phase in (Phase.APPLIED, Phase.FELL_BACK) and before not in (Phase.APPLIED, Phase.FELL_BACK):
        on_done(ctl, phase)


def on_searched(ctl: Any, iteration: int, phase: Any, dt_ms: float) -> None:
    """After the search: profile and plan saved on rank 0, the search line, the plan's pool entries on every rank."""
    from lagom_megatron.engine.steps import Phase

    tuner = ctl.tuner
    if tuner.profile is not None and ctl.rank == 0:
        ctl.files.save_profile(tuner.profile)
    stats = tuner.search_stats
    n = len(tuner.profile.sites) if tuner.profile is not None else 0
    wall_ms = float(stats.get("wall_time_s", dt_ms / 1e3)) * 1e3
    ctl.search_ms = wall_ms
    pred, base = stats.get("predicted_iteration_us"), stats.get("default_iteration_us")
    pred_txt = f" | predicted iteration {base / 1e3:.1f} -> {pred / 1e3:.1f} ms" if isinstance(pred, (int, float)) and isinstance(base, (int, float)) else ""
    mape = f" | model MAPE {tuner.model_mape:.1f}%" if tuner.model_mape is not None else ""
    say(f"lagom: phase searching | searched {n} sites in {wall_ms:.1f} ms ({tuner.config.method}, "
         f"{stats.get('model_evaluations', '?')} evaluations){pred_txt}{mape}")
    if tuner.plan is not None and phase is not Phase.FELL_BACK:
        ctl.plan = tuner.plan
        if ctl.rank == 0:
            ctl.files.save_plan(tuner.plan)
        if not ctl._prepare_pool_for_plan(tuner.plan):
            if ctl.rank == 0:  # a later run keeps the defaults instead of failing the same way
                ctl.files.save_plan(tuner.plan.with_stats(verification="fell_back", verification_reason=ctl.applier.error))
            ctl.write_report()
            return
        say(f"lagom: plan {ctl.files.plan_path} (digest {tuner.plan.digest()[:12]}) | profile {ctl.files.profile_path}")


def on_done(ctl: Any, phase: Any) -> None:
    """Verification over (APPLIED or FELL_BACK): final assignment, phase line, plan saved with its verdict, report."""
    from lagom_megatron.engine.steps import Phase

    ctl.router.set_assignment(ctl.tuner.assignment())  # the plan (APPLIED) or {} (FELL_BACK), for good
    s = ctl.tuner.summary()
    if phase is Phase.APPLIED:
        say(f"lagom: phase applied | measured {s['measured_default_us'] / 1e3:.1f} -> {s['measured_plan_us'] / 1e3:.1f} ms | {ctl.tuner.reason}")
    else:
        live = ctl.pool.live
        say(f"lagom: phase fell_back | {ctl.tuner.reason} | {ctl.pool.destroy()}/{live} pool entries destroyed")
    if ctl.plan is not None and ctl.rank == 0:
        ctl.files.save_plan(ctl.plan.with_stats(verification=phase.value, verification_reason=ctl.tuner.reason))
    ctl.write_report()
