"""First call of each site on a pool entry, guarded: NCCL refuses some algorithms only at enqueue. NVLS without a kernel
for the reduction (NVIDIA/nccl v2.30.7 ``src/include/device.h:587-601``) or PAT under an offloading net plugin
(``src/graph/tuning.cc:215-221``) leave no algorithm: ``ncclInvalidUsage`` / ``ncclInternalError``
(``src/enqueue.cc:2052-2066``); a blocking communicator stays usable (``src/group.cc:395-453``). Only that refusal,
alike on every rank, is re-issued on the own group; other errors propagate."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lagom_megatron.megatron import consensus

REFUSALS: tuple[str, ...] = ("invalid usage", "internal error")
"""``ncclGetErrorString`` of ``ncclInvalidUsage`` and ``ncclInternalError`` (NVIDIA/nccl v2.30.7
``src/init.cc:3415-3438``, ``:3423-3428``)."""


def refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is NCCL's refusal as torch raises it (``C10D_NCCL_CHECK*``, ``AutoNcclGroup``'s destructor)."""
    text = str(exc).lower()
    return any(r in text for r in REFUSALS)


class _BucketCall:
    __slots__ = ("site_id", "entry", "own", "calls")

    def __init__(self, site_id: str, entry: Any, own: Any) -> None:
        self.site_id, self.entry, self.own = site_id, entry, own
        self.calls: list[tuple[Callable[..., Any], tuple, dict, int]] = []


class FirstUse:
    """The first-use guard of one rank (``armed`` alike on every rank); ``queued``: torch's open coalescing managers."""

    def __init__(self, queued: dict | None = None) -> None:
        self.armed = False
        self.seen: set[str] = set()
        self.refused: set[str] = set()
        """Sites whose first call NCCL refused: their calls go to their own group until the check."""
        self.failures: list[tuple[str, str]] = []
        self.pending: _BucketCall | None = None
        self.queued = {} if queued is None else queued

    def arm(self) -> None:
        """New entries exist: guard the next first call of every site."""
        self.armed, self.seen, self.failures, self.refused = True, set(), [], set()

    def guard(self, site_id: str, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any]:
        """``orig`` for a routed call, the first time wrapped to re-issue a refusal with the own-group ``args``."""

        def on_own(*a: Any, **k: Any) -> Any:
            return orig(*args, **kwargs)

        if site_id in self.refused:
            return on_own
        if site_id in self.seen:
            return orig
        self.seen.add(site_id)

        def first(*a: Any, **k: Any) -> Any:
            try:
                _inject()
                return orig(*a, **k)
            except Exception as exc:
                if not refusal(exc):
                    raise
                self._refuse(site_id, exc)
                return on_own(*a, **k)

        return first

    def guard_bucket(
        self, site_id: str, orig: Callable[..., Any], owner: Any, attr: str, own: Any
    ) -> Callable[..., Any]:
        """``start_*_sync`` of a bucket group routed by swapping ``owner.<attr>``; re-calling doubles the gradient
        scaling (core_v0.16.1 ``param_and_grad_buffer.py:382-392``), so its manager is guarded."""
        if site_id in self.refused:

            def on_own(*a: Any, **k: Any) -> Any:
                entry = getattr(owner, attr)
                setattr(owner, attr, own)
                try:
                    return orig(*a, **k)
                finally:
                    setattr(owner, attr, entry)

            return on_own
        if site_id in self.seen:
            return orig
        self.seen.add(site_id)

        def first(*a: Any, **k: Any) -> Any:
            prev, self.pending = self.pending, _BucketCall(site_id, getattr(owner, attr), own)
            try:
                return orig(*a, **k)
            finally:
                self.pending = prev

        return first

    def record(self, fn: Callable[..., Any], args: tuple, kwargs: dict, group_index: int) -> None:
        """Keeps a collective queued in a guarded bucket group's manager; ``group_index``: its ``group`` position."""
        pending = self.pending
        if pending is None:
            return
        group = kwargs["group"] if "group" in kwargs else (args[group_index] if len(args) > group_index else None)
        if group is pending.entry:  # not a later manager's (the inter-instance all-reduce's) calls
            pending.calls.append((fn, args, dict(kwargs), group_index))

    def coalescing(self, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """megatron-core's ``_coalescing_manager(group, device=None, async_ops=False)``, guarded on the
        pending bucket group's entry: a refusal at its exit re-issues the queued calls on the own group."""
        pending = self.pending
        group = kwargs["group"] if "group" in kwargs else (args[0] if args else None)
        if pending is None or group is not pending.entry:
            return orig(*args, **kwargs)
        return self._guarded(orig, args, kwargs, pending)

    @contextlib.contextmanager
    def _guarded(self, orig: Callable[..., Any], args: tuple, kwargs: dict, call: _BucketCall) -> Iterator[Any]:
        body_done = False
        try:
            with orig(*args, **kwargs) as cm:
                yield cm
                body_done = True
                if consensus.fault_injected("first-call"):
                    self.queued.pop(call.entry, None)  # refused before NCCL ran anything: nothing is issued
                    _inject()
        except Exception as exc:
            if not body_done or not refusal(exc):
                raise  # Megatron's own error, or not NCCL's refusal: never issued again on one rank
            self._refuse(call.site_id, exc)
            device = kwargs["device"] if "device" in kwargs else (args[1] if len(args) > 1 else None)
            async_ops = kwargs["async_ops"] if "async_ops" in kwargs else (len(args) > 2 and args[2])
            with orig(call.own, device, async_ops) as again:
                for fn, a, k, gi in call.calls:
                    if "group" in k or len(a) <= gi:
                        k = {**k, "group": call.own}
                    else:
                        a = a[:gi] + (call.own,) + a[gi + 1 :]
                    fn(*a, **k)
            for work in getattr(again, "works", ()):  # torch's _CoalescingManager: Megatron waits cm
                cm.append(work)

    def _refuse(self, site_id: str, exc: BaseException) -> None:
        self.refused.add(site_id)
        self.failures.append((site_id, f"{type(exc).__name__}: {exc}"))

    def check(self, *, disarm: bool = True) -> None:
        """RuntimeError (naming each site and NCCL's error) when a first call failed here; ``disarm`` ends the round."""
        failures = self.failures
        if disarm or failures:
            self.armed, self.seen, self.failures, self.refused = False, set(), [], set()
        if failures:
            detail = "; ".join(f"{sid}: {err}" for sid, err in failures[:3])
            more = f" (+{len(failures) - 3} more)" if len(failures) > 3 else ""
            raise RuntimeError(f"NCCL refused {len(failures)} call(s) on their pool entries: {detail}{more}")


def _inject() -> None:
    """The ``first-call`` fault: a refusal before the call is issued (set it on every rank, as NCCL's is)."""
    if consensus.fault_injected("first-call"):
        raise RuntimeError(
            "NCCL error: invalid usage (No algorithm/protocol available; fault injected by "
            f"{consensus.APPLY_FAULT_ENV})"
        )
