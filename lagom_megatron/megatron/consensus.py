"""Rank consistency (docs/engine.md) on the world group; faults: ``LAGOM_INJECT_DIGEST_FAULT=<rank>``,
``LAGOM_INJECT_CAPABILITY_FAULT=<rank>[:<field>]``, ``LAGOM_INJECT_APPLY_FAULT=<step>:<rank>[,...]``."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable
from typing import Any

FAULT_ENV = "LAGOM_INJECT_DIGEST_FAULT"
APPLY_FAULT_ENV = "LAGOM_INJECT_APPLY_FAULT"
APPLY_STEPS = ("env", "pool-preflight", "pool-create", "table", "first-use", "first-call", "observed")


def fault_injected(step: str) -> bool:
    """Whether ``APPLY_FAULT_ENV`` names ``step`` for this rank."""
    return _injected(step, _world()[0])


class PlanDisagreement(RuntimeError):
    """Ranks hold different plans (digest mismatch); tuning must be aborted."""


class CapabilityDisagreement(RuntimeError):
    """Ranks can apply different things (``nccl.capabilities``); tuning must stay off."""


class ApplyFailed(RuntimeError):
    """A step of applying failed on some rank; every rank falls back to NCCL's defaults."""


def _injected(step: str, rank: int) -> bool:
    spec = os.environ.get(APPLY_FAULT_ENV, "")
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, r = item.rpartition(":")
        if name not in APPLY_STEPS:
            raise ValueError(f"{APPLY_FAULT_ENV} step must be one of {list(APPLY_STEPS)}; got {name!r}")
        if name == step and r.strip() == str(rank):
            return True
    return False


def collective_step(name: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on this rank; ``ApplyFailed`` on every rank (naming each rank's error, host) when it raised on any."""
    rank, _ = _world()
    try:
        fault = _injected(name, rank)
        if fault and name == "env":
            from lagom_megatron.nccl.capabilities import ENV_FAULT

            os.environ[ENV_FAULT[0]] = ENV_FAULT[1]  # then the real check in fn finds it
        result, err = fn(), None
        if fault and name not in ("env", "first-call"):  # after fn: this rank made the same collective calls
            raise RuntimeError(f"fault injected by {APPLY_FAULT_ENV}")
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        result, err = None, f"{type(exc).__name__}: {exc}"
    outcomes = all_gather((err, socket.gethostname()))
    bad = [(r, h, e) for r, (e, h) in enumerate(outcomes) if e]
    if bad:
        detail = "; ".join(f"rank {r} ({h}): {e}" for r, h, e in bad)
        raise ApplyFailed(f"{name} failed on {detail}")
    return result


def agree_capabilities(
    local: Any,
    *,
    from_dict: Callable[[dict[str, Any]], Any],
    differences: Callable[[list[Any]], list[tuple[int, str, Any, Any]]],
    perturb: Callable[[Any, str], Any] | None = None,
) -> tuple[Any, list[str]]:
    """(Rank 0's capabilities with the job's topology, hosts); ``CapabilityDisagreement`` when any field differs."""
    from lagom_megatron.nccl.capabilities import FAULT_ENV as CAP_FAULT_ENV

    rank, _ = _world()
    fault = os.environ.get(CAP_FAULT_ENV, "").strip()
    if fault and perturb is not None:
        who, _, what = fault.partition(":")
        if who.strip() == str(rank):
            local = perturb(local, what.strip() or "plugin_loaded")
    records = [from_dict(d) for d in all_gather(local.to_dict())]
    diffs = differences(records)
    if diffs:
        r, field, want, got = diffs[0]
        more = f" (and {len(diffs) - 1} more difference(s))" if len(diffs) > 1 else ""
        raise CapabilityDisagreement(
            f"ranks disagree on what they can apply: rank {r} on host {records[r].host} has {field}={got!r} but "
            f"rank 0 on host {records[0].host} has {field}={want!r}{more}; tuning off, defaults kept"
        )
    hosts = [x.host for x in records]
    return records[0].with_topology(hosts), hosts


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` when not distributed)."""
    import torch.distributed as dist

    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


Times3 = tuple[float, float, float]
"""(t_comm_us, t_comp_us, t_region_us) of one site or one call; t_comp_us may be NaN."""


def _slowest(acc: list[float], comm: float, comp: float, region: float) -> None:
    acc[0] = max(acc[0], comm)
    acc[2] = max(acc[2], region)
    if math.isfinite(comp):
        acc[1] = comp if not math.isfinite(acc[1]) else max(acc[1], comp)


def merge_measurements(
    sites: dict[str, dict[str, Any]],
    timings: dict[str, Times3],
    iteration_us: float,
    calls: dict[str, list[Times3]] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, Times3], float, dict[str, tuple[Times3, ...]]]:
    """Slowest rank's (sites, timings, iteration_us, calls) of one iteration (us); per call the longest region where all
    ranks timed as many calls, the site's timings then their sums (t_comp_us NaN unless all finite)."""
    gathered = all_gather((sites, timings, float(iteration_us), calls or {}))
    all_sites: dict[str, dict[str, Any]] = {}
    merged: dict[str, list[float]] = {}
    per_call: dict[str, list[Times3] | None] = {}
    it_us = 0.0
    for r_sites, r_timings, r_it, r_calls in gathered:
        for sid, lst in r_calls.items():
            cur_calls = per_call.get(sid, [])
            if cur_calls is None or (sid in per_call and len(cur_calls) != len(lst)):
                per_call[sid] = None
            elif sid not in per_call:
                per_call[sid] = [tuple(c) for c in lst]
            else:
                per_call[sid] = [c if c[2] > cur[2] else cur for cur, c in zip(cur_calls, lst)]
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
            _slowest(acc, comm, comp, region)
    timed_calls = {
        sid: tuple((float(c[0]), float(c[1]), float(c[2])) for c in v)
        for sid, v in per_call.items()
        if v and all(sid in r[3] for r in gathered if sid in r[1])
    }
    for sid, cs in timed_calls.items():
        comp = [c[1] for c in cs]
        merged[sid] = [
            sum(c[0] for c in cs),
            sum(comp) if all(map(math.isfinite, comp)) else math.nan,
            sum(c[2] for c in cs),
        ]
    return all_sites, {k: (v[0], v[1], v[2]) for k, v in merged.items()}, it_us, timed_calls


def agree_plan(
    plan: Any,
    *,
    from_dict: Callable[[dict[str, Any]], Any],
    perturb: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Any:
    """Rank 0's plan once every digest matches; ``PlanDisagreement`` when one differs or ``plan`` is None on a rank."""
    import torch.distributed as dist

    rank, world = _world()
    failed = [r for r, f in enumerate(all_gather(plan is None)) if f]
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
    digests = all_gather(agreed.digest())
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        detail = ", ".join(f"rank {r} {digests[r][:12]}" for r in bad)
        raise PlanDisagreement(
            f"plan digest mismatch: rank 0 has {digests[0][:12]}, {detail}; tuning aborted, defaults kept"
        )
    return agreed


def _perturb(data: dict[str, Any]) -> dict[str, Any]:
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
