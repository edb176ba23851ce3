"""The first real use of the pool entries, checked on every rank together.

NCCL refuses some calls only when they are made. A communicator created with
``NCCL_ALGO=allreduce:NVLS`` fails an all-reduce NCCL has no NVLS kernel for (an AVG or FP8
reduction, ``ncclNvlsSupported``, NVIDIA/nccl v2.30.7 ``src/include/device.h:587-601``) with
``ncclInvalidUsage`` "No algorithm/protocol available" when the call is enqueued
(``src/enqueue.cc:2052-2066``), and PAT fails the same way under a network plugin that offloads
(``src/graph/tuning.cc:215-221``). That is after every apply step passed, and torch raises it
from the collective call itself (``ProcessGroupNCCL`` checks each ``ncclResult_t``).

So after each apply (``Applier.apply``) the router routes the first call of each site on a pool
entry through ``FirstUse.guard``: an exception from the call on its entry is recorded, and the call
is issued again on the site's own group, so the training step completes under NCCL's defaults for
that call. NCCL's choice of algorithm depends only on what every rank of the communicator holds
alike (the call, the entry's options and table), so such an error comes on every rank of the
entry and they re-issue together. At the end of the iteration ``Applier.check_first_use`` runs
``consensus.collective_step("first-call", FirstUse.check)``: a failure recorded on any rank
reverts every rank to NCCL's defaults (``Applier.revert``). Point-to-point entries differ only in
their CTA bounds, which NCCL applies when the entry is created (its warm-up call,
``nccl.pool.create_nccl_pool_entry``); their calls are not guarded.
"""

from __future__ import annotations

from typing import Any, Callable

from lagom_megatron.megatron import consensus


class FirstUse:
    """The guard of one rank (module docstring). ``armed`` is the same on every rank: set by every
    rank's ``arm`` after the same apply, cleared by every rank's ``check``."""

    def __init__(self) -> None:
        self.armed = False
        self.seen: set[str] = set()
        self.refused: set[str] = set()
        """Sites whose first call NCCL refused: their calls go to their own group until the check."""
        self.failures: list[tuple[str, str]] = []
        """(site id, error) of each first call that failed on its pool entry this round."""

    def arm(self) -> None:
        """New entries exist: guard the next first call of every site."""
        self.armed, self.seen, self.failures, self.refused = True, set(), [], set()

    def guard(self, site_id: str, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any]:
        """``orig`` for a routed call of ``site_id`` whose own-group arguments are ``args`` /
        ``kwargs``: the first time, a wrapper that calls ``orig`` with the entry's arguments and, if
        that raises, records the error and calls ``orig(*args, **kwargs)`` instead; after such a
        refusal, every later call of the site goes to its own group (NCCL refuses them all)."""
        def on_own(*a: Any, **k: Any) -> Any:
            return orig(*args, **kwargs)
        return self._first(site_id, orig, on_own)

    def guard_bucket(self, site_id: str, orig: Callable[..., Any], owner: Any, attr: str, own: Any) -> Callable[..., Any]:
        """``guard`` for a DDP bucket group routed by swapping ``owner.<attr>`` to its entry: on an
        error the attribute gets its own group ``own`` back before the call is issued again
        (megatron-core opens its coalescing manager on the attribute at call time)."""
        def on_own(*a: Any, **k: Any) -> Any:
            entry = getattr(owner, attr)
            setattr(owner, attr, own)
            try:
                return orig(*a, **k)
            finally:
                setattr(owner, attr, entry)
        return self._first(site_id, orig, on_own)

    def _first(self, site_id: str, orig: Callable[..., Any], on_own: Callable[..., Any]) -> Callable[..., Any]:
        """``orig`` once seen, ``on_own`` once refused, else the guarded first call."""
        if site_id in self.refused:
            return on_own
        if site_id in self.seen:
            return orig
        self.seen.add(site_id)

        def first(*a: Any, **k: Any) -> Any:
            try:
                _inject()
                return orig(*a, **k)
            except Exception as exc:  # noqa: BLE001 - NCCL's refusal: kept, the call goes to its own group
                self.refused.add(site_id)
                self.failures.append((site_id, f"{type(exc).__name__}: {exc}"))
                return on_own(*a, **k)
        return first

    def check(self, *, disarm: bool = True) -> None:
        """Raises when a first call failed on this rank; ``disarm`` ends the guarded round (after an
        iteration that routed calls: the same on every rank).

        Raises:
            RuntimeError: names each failed site and NCCL's error.
        """
        failures = self.failures
        if disarm or failures:
            self.armed, self.seen, self.failures, self.refused = False, set(), [], set()
        if failures:
            detail = "; ".join(f"{sid}: {err}" for sid, err in failures[:3])
            more = f" (+{len(failures) - 3} more)" if len(failures) > 3 else ""
            raise RuntimeError(f"NCCL refused {len(failures)} call(s) on their pool entries: {detail}{more}")


def _inject() -> None:
    """The ``first-call`` fault (``consensus.APPLY_FAULT_ENV``): this rank's entry refuses the call
    before it is issued, as NCCL refuses an unavailable algorithm at enqueue (set it on every rank:
    NCCL's refusal is the same on every rank of the communicator)."""
    if consensus.fault_injected("first-call"):
        raise RuntimeError("NCCL error: invalid usage (No algorithm/protocol available; fault injected by "
                           f"{consensus.APPLY_FAULT_ENV})")
