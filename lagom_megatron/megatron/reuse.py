"""Reusing a saved ``--lagom-plan`` whose fingerprint matches this run.

A plan rejected by its own verification keeps the defaults (applying it unverified would undo that
verdict on every later run); a plan never verified (``lagom search``, or a run too short to verify)
is applied and verified against the defaults; a verified plan is applied from the first iteration.
Profiling and search are skipped in all three cases.
"""

from __future__ import annotations

from typing import Any

from lagom_megatron.megatron.report import is_tuned
from lagom_megatron.megatron.run_files import say


def try_reuse_plan(ctl: Any) -> bool:
    """Applies ``ctl.files``' saved plan if it matches ``ctl.fingerprint``.

    Args:
        ctl: the ``controller.LagomController`` of this rank (its files, router, applier, tuner).

    Returns:
        True when the run's course is decided here (a plan reused, skipped as rejected, or tuning
        aborted because ranks disagree on the plan); False when there is no plan to reuse and the
        controller should profile and search.
    """
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
        # measured no better than the defaults when it was searched: applying it unverified
        # would undo that verdict on every later run; the router keeps its empty assignment
        say(f"lagom: phase fell_back | plan {ctl.files.plan_path} reused (digest {plan.digest()[:12]}) "
             f"but its verification kept the defaults ({plan.stats.get('verification_reason') or 'no reason saved'}) | "
             f"profiling and search skipped; delete the plan or pass another --lagom-plan to search again")
        return True
    if getattr(ctl, "applier", None) is not None:
        # a plan searched elsewhere (``lagom search``) was never trimmed to this run's pool budget:
        # without this its entries would pass it and the whole plan fall back at the pool preflight
        try:
            plan = ctl.plan = ctl.applier.fit_plan_to_budget(plan)
        except ValueError as exc:  # the same on every rank: the plan and the capabilities are agreed
            say(f"lagom: ERROR: plan {ctl.files.plan_path} cannot be fitted to the pool budget: {exc}; NCCL defaults kept")
            ctl.mode = "aborted"
            return True
    if plan.stats.get("verification") is None:
        # saved before any verification (`lagom search`, or a run too short to verify): measure
        # it against the defaults now instead of trusting its prediction
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
