"""What a ``--lagom`` run's report says, read from its controller (``report.py`` renders it); microseconds."""

from __future__ import annotations

import statistics
from typing import Any

from lagom_megatron.megatron.report import SiteRow, site_rows, verdict_summary


def run_kind(ctl: Any) -> str:
    """``report.RUN_KINDS`` of this run."""
    tuner = ctl.tuner
    if ctl.mode == "reuse" and (tuner is None or tuner.done):
        return "reused"
    if tuner is not None and not tuner.done and ctl.mode != "aborted":
        if ctl._train_iters is not None and ctl._last_iteration < ctl._train_iters:
            return "interrupted"
        return "unfinished"
    return "tuned"


def run_summary(ctl: Any) -> dict[str, Any]:
    """JSON-ready state of the run for the report (us; paths only of existing files), verdict fields recomputed by
    ``report.verdict_summary`` with the tuner's own settings."""
    tuner = ctl.tuner
    out: dict[str, Any] = tuner.summary() if tuner is not None else {"phase": ctl.mode, "method": ctl.method}
    kind = run_kind(ctl)
    out.update(mode=ctl.mode, run_kind=kind, search_ms=ctl.search_ms, backend=getattr(ctl, "backend", None),
               cluster=getattr(getattr(ctl, "cluster", None), "name", None))
    if getattr(ctl, "applier", None) is not None:  # pool counts, capabilities; a failed apply means defaults everywhere
        out.update(ctl.applier.summary_part())
    search = out.get("search") or {}
    for key in ("predicted_iteration_us", "predicted_default_iteration_us"):
        if isinstance(search.get(key), (int, float)):
            out[key] = search[key]
    plan = ctl.plan
    if kind == "reused" and plan is not None:
        for key in ("predicted_iteration_us", "predicted_default_iteration_us"):
            if isinstance(plan.stats.get(key), (int, float)):
                out[key] = plan.stats[key]
    vp, vd = out.get("verify_plan_us") or [], out.get("verify_default_us") or []
    if vp and vd and tuner is not None:
        out.update(verdict_summary(vp, vd, min_gain=tuner.config.min_gain, noise_rule=tuner.config.noise_rule,
                                   n_looks=len(tuner.verify_looks)))
    if kind == "reused" and plan is not None:
        kept_defaults = plan.rejected
        saved = plan.stats.get("verification_reason") or "no reason saved"
        out["phase"] = "fell_back" if kept_defaults else "applied"
        out["reason"] = (f"reused plan {ctl.files.plan_path}, rejected by its own verification ({saved}); defaults kept"
                         if kept_defaults else
                         f"reused plan {ctl.files.plan_path}, verified when it was searched ({saved}); "
                         "not verified again in this run")
        out["method"] = plan.method
        if ctl._applied_us:  # under the defaults when the reused plan was a rejected one
            arm = "default" if kept_defaults else "plan"
            out[f"measured_{arm}_us"] = statistics.median(ctl._applied_us)
            out[f"verify_{arm}_us"] = list(ctl._applied_us)
    elif kind in ("unfinished", "interrupted"):
        phase = tuner.phase.value
        out["reason"] = (f"training stopped at iteration {ctl._last_iteration} of {ctl._train_iters} (an error or "
                         f"a signal) while lagom was {phase}; defaults kept" if kind == "interrupted" else
                         f"--train-iters {ctl._train_iters} ended while lagom was {phase}: tuning needs "
                         f"{'up to ' if len(tuner.verify_looks) > 1 else ''}{tuner.total_iters} iterations; "
                         "defaults kept")
    # only files that exist: a run that never saved a plan or a profile does not name one
    out["plan_path"] = str(ctl.files.plan_path) if ctl.files.plan_path.is_file() else None
    out["profile_path"] = str(ctl.files.profile_path) if ctl.files.profile_path.is_file() else None
    if plan is not None:
        out["plan_digest"] = plan.digest()
    return out


def run_rows(ctl: Any) -> list[SiteRow]:
    """One ``report.SiteRow`` per site of the plan (or of the profiled sites), from the verification's iterations."""
    entries = ctl.plan.entries if ctl.plan is not None else {}
    return site_rows(entries, ctl._last_sites, ctl._t_verify_default, ctl._t_plan,
                     backend=getattr(ctl, "backend", "nccl"))
