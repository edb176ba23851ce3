"""NCCL's own GPU time per site, the second communication-time source of a profiled iteration.

``profiler.Profiler`` times a collective with ``Work._get_duration()`` (CUDA events torch records on
NCCL's stream). With profiler ABI v4+ (NCCL 2.27+) the profiler half of lagom's plugin also
records each collective's kernel time from NCCL's kernelCh timers (the GPU globaltimer at each
channel's start and stop, NVIDIA/nccl v2.30.7 ``src/plugin/profiler.cc:679-705``), per
communicator and call shape (``nccl.profiler_status``). ``KernelTimes`` switches those events on
for a timed profiling iteration (the activation mask is 0 otherwise), then gives each site the
kernel time of its calls where the records tell the site apart (``nccl.observed.site_kernel_us``:
no other site has the same function and bytes on its communicator). The ranks' values are
all-gathered and the slowest kept, as ``consensus.merge_measurements`` keeps the slowest rank's
times; a site that a rank could not time gets none. The profile records both sources
(``Sample.t_comm_us`` and ``Sample.t_comm_nccl_us``) and the fit uses NCCL's when present
(``engine.fit``).

The communicator of a site: its pool entry's name (``CommPool.comm_key``: the tuner tag the pool
set, its commName where torch binds ``comm_name``) or, on the site's own group, that group's
``group_desc``, which is the commName NCCL reports where the torch release passes it to NCCL.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from lagom_megatron.megatron import consensus
from lagom_megatron.nccl.observed import site_kernel_us


class KernelTimes:
    """Per-iteration NCCL kernel times of one rank (module docstring). Every method is called on
    every rank alike (the condition, a timed iteration on NCCL, is the same on every rank).

    Args:
        reader, recorder: ``profiler_status.read_observed`` and ``set_recording`` (tests pass stand-ins).
    """

    def __init__(self, *, reader: Callable[[], Any] | None = None, recorder: Callable[..., bool] | None = None) -> None:
        self.reader = reader
        self.recorder = recorder
        self.on = False

    def start(self) -> None:
        """Before a timed iteration: records reset, NCCL's events on."""
        from lagom_megatron.nccl import profiler_status

        self.on = bool((self.recorder or profiler_status.set_recording)(True, reset=True))

    def finish(self, records: dict[str, Any], assignment: dict[str, Any], pool: Any) -> dict[str, float]:
        """After the iteration (the profiler synchronized the device): events off, then site id ->
        NCCL kernel time of its calls this iteration (microseconds, the slowest rank's) for the sites
        every rank timed. Collective (one all-gather) whether or not this rank has records.

        Args:
            records: the registry's ``SiteRecord`` s of the iteration (op, bytes, group, calls).
            assignment: site id -> config routed this iteration (the pool entry it ran on).
            pool: the rank's ``CommPool``.
        """
        from lagom_megatron.nccl import profiler_status

        local: dict[str, float] = {}
        if self.on:
            (self.recorder or profiler_status.set_recording)(False)
            try:
                comms = (self.reader or profiler_status.read_observed)() or []
                for sid, rec in records.items():
                    key = comm_key(pool, rec.group, assignment.get(sid))
                    us = site_kernel_us(comms, key, rec.op, rec.nbytes, rec.group.size, rec.calls) if key else None
                    if us is not None and math.isfinite(us) and us > 0:
                        local[sid] = us
            except Exception:  # noqa: BLE001 - a second source is not worth a training run: none this iteration
                local = {}
        self.on = False
        gathered = consensus.all_gather(local)
        common = set(gathered[0]).intersection(*gathered[1:]) if gathered else set()
        return {sid: max(g[sid] for g in gathered) for sid in common}


def comm_key(pool: Any, info: Any, config: Any) -> str | None:
    """The name the communicator a site ran on is known by in NCCL's records (module docstring)."""
    group = pool.group_for(info, config) if config is not None and pool is not None else None
    if group is not None:
        return pool.comm_key(group)
    own = pool.own_group(info.name) if pool is not None else None
    return getattr(own, "group_desc", None) or None
