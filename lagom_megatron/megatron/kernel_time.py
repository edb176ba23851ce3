"""NCCL's own kernel time per site (``Sample.t_comm_nccl_us``), from its kernelCh timers via lagom's
profiler plugin, ABI v4+ (NCCL 2.27+; NVIDIA/nccl v2.30.7 ``src/plugin/profiler.cc:679-705``)."""

from __future__ import annotations

import math
from typing import Any, Callable

from lagom_megatron.megatron import consensus
from lagom_megatron.nccl.observed import site_kernel_us


class KernelTimes:
    """Per-iteration NCCL kernel times of one rank; every method is called on every rank alike."""

    def __init__(self, *, reader: Callable[[], Any] | None = None, recorder: Callable[..., bool] | None = None) -> None:
        self.reader = reader
        self.recorder = recorder
        self.on = False

    def start(self) -> None:
        """Before a timed iteration: records reset, NCCL's events on."""
        from lagom_megatron.nccl import profiler_status

        self.on = bool((self.recorder or profiler_status.set_recording)(True, reset=True))

    def finish(self, records: dict[str, Any], assignment: dict[str, Any], pool: Any) -> dict[str, float]:
        """Events off; site id -> NCCL kernel time (us, slowest rank) for the sites every rank timed.
        Collective (one all-gather) whether or not this rank has records."""
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
    """The commName a site ran on: its pool entry's ``comm_key``, else its group's ``group_desc``."""
    group = pool.group_for(info, config) if config is not None and pool is not None else None
    if group is not None:
        return pool.comm_key(group)
    own = pool.own_group(info.name) if pool is not None else None
    return getattr(own, "group_desc", None) or None
