"""Rank consistency: all-gathered measurements and one agreed plan (docs/engine.md).

NCCL hangs or corrupts data when the ranks of one communicator choose differently for the same
call, and a gloo send paired with a receive on another communicator never completes. So:

* ``merge_measurements`` all-gathers every rank's per-site timings; a region's time is the
  slowest rank's (max of ``t_comm``, ``t_region``; ``t_comp`` the max of the finite values) and
  the iteration's time is the slowest rank's. Every rank gets the same merged result, so the
  tuner state machine advances identically everywhere.
* ``agree_plan`` broadcasts rank 0's plan, every rank rebuilds it and computes its digest, and
  the digests are all-gathered. Any mismatch raises ``PlanDisagreement`` on every rank (they all
  see the same digests), which the tuner turns into "keep defaults" while training continues.

All traffic goes over the default (world) group with ``*_object`` collectives: a few kilobytes
once per profiled iteration, never on the training path after the plan is applied.

``LAGOM_INJECT_DIGEST_FAULT=<rank>`` (environment) perturbs that rank's copy of the plan before
the digest check: a fault-injection switch used by the test of the mismatch path.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

FAULT_ENV = "LAGOM_INJECT_DIGEST_FAULT"


class PlanDisagreement(RuntimeError):
    """Ranks hold different plans (digest mismatch); tuning must be aborted."""


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def merge_measurements(sites: dict[str, dict[str, Any]], timings: dict[str, tuple[float, float, float]],
                       iteration_us: float) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[float, float, float]], float]:
    """All-gathers one iteration's measurements and keeps the slowest rank per region.

    Args:
        sites: site id -> CollectiveSite fields (as a dict) seen on this rank.
        timings: site id -> (t_comm_us, t_comp_us, t_region_us) measured on this rank.
        iteration_us: this rank's iteration wall time (us).

    Returns:
        (sites, timings, iteration_us) merged over all ranks, identical on every rank.
    """
    gathered = _all_gather((sites, timings, float(iteration_us)))
    all_sites: dict[str, dict[str, Any]] = {}
    merged: dict[str, list[float]] = {}
    it_us = 0.0
    for r_sites, r_timings, r_it in gathered:
        it_us = max(it_us, r_it)
        for sid, rec in r_sites.items():
            cur = all_sites.get(sid)
            if cur is None:
                all_sites[sid] = dict(rec)
            else:
                cur["nbytes"] = max(cur["nbytes"], rec["nbytes"])
                cur["calls_per_iter"] = max(cur["calls_per_iter"], rec["calls_per_iter"])
        for sid, (comm, comp, region) in r_timings.items():
            acc = merged.get(sid)
            if acc is None:
                merged[sid] = [comm, comp, region]
                continue
            acc[0] = max(acc[0], comm)
            acc[2] = max(acc[2], region)
            if math.isfinite(comp):
                acc[1] = comp if not math.isfinite(acc[1]) else max(acc[1], comp)
    return all_sites, {k: (v[0], v[1], v[2]) for k, v in merged.items()}, it_us


def agree_plan(plan: Any, *, from_dict: Callable[[dict[str, Any]], Any],
               perturb: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Any:
    """Broadcasts rank 0's plan, checks every rank's digest, returns the agreed plan.

    Args:
        plan: this rank's searched plan (only rank 0's is used); needs ``to_dict()``. None: the
            search failed on this rank; every rank then raises, so all keep the defaults together
            instead of some waiting in the broadcast below for a rank that gave up.
        from_dict: rebuilds a plan from ``to_dict`` output (``Plan.from_dict``); the result needs
            ``digest()``.
        perturb: applied to this rank's copy before the digest check (fault injection; see
            module docstring for the environment switch).

    Raises:
        PlanDisagreement: the search failed on some rank, or some rank's digest differs from
            rank 0's (the message lists the ranks).
    """
    import torch.distributed as dist

    rank, world = _world()
    failed = [r for r, f in enumerate(_all_gather(plan is None)) if f]
    if failed:
        raise PlanDisagreement(f"the search failed on rank(s) {failed}; tuning aborted on every rank, defaults kept")
    data = plan.to_dict()
    if world > 1:
        box = [data if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        data = box[0]
    fault = os.environ.get(FAULT_ENV)
    if perturb is None and fault is not None and fault.strip() == str(rank):
        perturb = _perturb
    if perturb is not None:
        data = perturb(dict(data))
    agreed = from_dict(data)
    digests = _all_gather(agreed.digest())
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        detail = ", ".join(f"rank {r} {digests[r][:12]}" for r in bad)
        raise PlanDisagreement(
            f"plan digest mismatch: rank 0 has {digests[0][:12]}, {detail}; tuning aborted, defaults kept"
        )
    return agreed


def _perturb(data: dict[str, Any]) -> dict[str, Any]:
    """Changes one entry's predicted time: a different digest, the same routing."""
    entries = data.get("entries")
    if isinstance(entries, dict) and entries:
        sid = sorted(entries)[0]
        entry = dict(entries[sid])
        entry["predicted_t_comm_us"] = float(entry.get("predicted_t_comm_us", 0.0)) + 1.0
        data["entries"] = dict(entries, **{sid: entry})
    else:
        data["method"] = f"{data.get('method', '')}-perturbed"
    return data


def broadcast_object(obj: Any, *, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (identity when not distributed)."""
    import torch.distributed as dist

    rank, world = _world()
    if world == 1:
        return obj
    box = [obj if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
