"""Reusing a saved ``--lagom-plan`` whose fingerprint matches this run: a rejected plan keeps the defaults, an
unverified one is verified, a verified one applied; profiling and search are skipped."""

from __future__ import annotations

from typing import Any

from lagom_megatron.megatron.report import is_tuned
from lagom_megatron.megatron.run_files import say


def try_reuse_plan(ctl: Any) -> bool:
    """Applies ``ctl.files``' saved plan if it matches ``ctl.fingerprint``; True when that decides the run's course
    (reused, kept rejected, or aborted on disagreement), False when the controller should profile and search."""
    from lagom_megatron.megatron import consensus

    try:
        plan = ctl.files.saved_plan(ctl.fingerprint, getattr(ctl, "cluster", None))
    except consensus.PlanDisagreement as exc:
        say(f"lagom: ERROR: {exc}")
        ctl.mode = "aborted"
        return True
    if plan is None:
        return False
    ctl.plan = plan
    ctl.mode = "reuse"
    if plan.method != ctl.method:  # whichever branch follows: applied, verified first, or kept rejected
        say(f"lagom: WARNING: --lagom-method {ctl.method} not used: plan {ctl.files.plan_path} was searched "
            f"with {plan.method}; delete it or pass another --lagom-plan to search with {ctl.method}")
    if plan.rejected:
        # applying it unverified would undo its verdict; the router keeps its empty assignment
        say(f"lagom: phase fell_back | plan {ctl.files.plan_path} reused (digest {plan.digest()[:12]}) "
             f"but its verification kept the defaults ({plan.stats.get('verification_reason') or 'no reason saved'}) | "
             f"profiling and search skipped; delete the plan or pass another --lagom-plan to search again")
        return True
    if getattr(ctl, "applier", None) is not None:
        # a ``lagom search`` plan was never trimmed to this run's pool budget (else the pool preflight fails it)
        try:
            plan = ctl.plan = ctl.applier.fit_plan_to_budget(plan)
        except ValueError as exc:  # the same on every rank: the plan and the capabilities are agreed
            say(f"lagom: ERROR: plan {ctl.files.plan_path} cannot be fitted to the pool budget: {exc}; NCCL defaults kept")
            ctl.mode = "aborted"
            return True
    if plan.stats.get("verification") is None:
        # never verified (``lagom search``, a short run): measure it against the defaults now
        ctl._start_tuner(plan)
        if not ctl._prepare_pool_for_plan(plan):
            return True
        say(f"lagom: phase verifying | plan {ctl.files.plan_path} reused (digest {plan.digest()[:12]}) but never "
             f"verified | profiling and search skipped; {'up to ' if len(ctl.tuner.verify_looks) > 1 else ''}{ctl.tuner.total_iters} iterations to verify it")
        return True
    if not ctl._prepare_pool_for_plan(plan):
        return True
    assignment = ctl._assignment_of(plan)
    ctl.router.set_assignment(assignment)
    tuned = sum(is_tuned(c.to_dict(), ctl.backend) for c in assignment.values())
    say(f"lagom: phase applied | plan {ctl.files.plan_path} reused (digest {plan.digest()[:12]}) | "
         f"{tuned}/{len(plan.entries)} sites tuned | profiling and search skipped")
    return True
