"""The first real use of the pool entries, checked on every rank together.

NCCL refuses some calls only when they are made. A communicator created with
``NCCL_ALGO=allreduce:NVLS`` fails an all-reduce NCCL has no NVLS kernel for (an AVG or FP8
reduction, ``ncclNvlsSupported``, NVIDIA/nccl v2.30.7 ``src/include/device.h:587-601``): every entry
of the cost table is disabled, ``topoGetAlgoInfo`` finds no algorithm and returns
``ncclInvalidUsage`` when ``NCCL_ALGO`` / ``NCCL_PROTO`` is set at call time, else
``ncclInternalError`` (``src/enqueue.cc:2052-2066``). PAT fails the same way under a network plugin
that offloads (``src/graph/tuning.cc:215-221``). That is after every apply step passed. The entries
are blocking communicators (``nccl.options.build_options``), so the error comes back from the enqueue
itself and the communicator stays usable: a blocking communicator's failed group resets its planner
and sets no asynchronous error (``src/group.cc:395-453``), so torch's watchdog never sees one. torch
raises it from the call that issued the NCCL group: ``ProcessGroupNCCL``'s ``C10D_NCCL_CHECK*``
(``DistBackendError``, "NCCL error in: ..., invalid usage ...") for a plain collective, and for a
coalesced one the exit of ``_coalescing_manager``, whose ``*_coalesced`` call ends the group
(``AutoNcclGroup``'s destructor: "NCCL Error 5: invalid usage"); both messages carry
``ncclGetErrorString`` (``src/init.cc:3415-3438``).

So after each apply (``Applier.apply``) the first call of each site on a pool entry is guarded:

* a plain collective (``FirstUse.guard``): a refusal is recorded and the same call is issued on
  the site's own group;
* a DDP bucket group (``guard_bucket``): megatron-core's ``start_grad_sync`` scales the gradients
  and copies ``main_grad`` before it opens the coalescing manager (core_v0.16.1
  ``param_and_grad_buffer.py:382-392``, core_v0.18.2 the same plus the copy), and the refusal comes
  at the manager's exit, so calling ``start_grad_sync`` again would scale twice. The manager itself
  is guarded instead (``coalescing``, through the patched ``param_and_grad_buffer._coalescing_manager``):
  on a refusal at its exit it issues the queued collectives again on the own group, in a manager of
  its own, and hands their work to Megatron's handle; Megatron's code after the manager runs once.

Only NCCL's refusal is handled so (``refusal``: the message names ``invalid usage`` or
``internal error``): NCCL's choice of algorithm depends only on what every rank of the
communicator holds alike (the call, the entry's options and table), so it comes on every rank and
they re-issue together. Any other error (a CUDA error of one rank, an exception of Megatron's own
code) propagates unchanged: re-issuing it on one rank only would pair collectives of different
communicators and hang. At the end of the iteration ``Applier.check_first_use`` runs
``consensus.collective_step("first-call", FirstUse.check)``: a refusal recorded on any rank reverts
every rank to NCCL's defaults (``Applier.revert``). Point-to-point entries differ only in their CTA
bounds, which NCCL applies when the entry is created (its warm-up call,
``nccl.pool.create_nccl_pool_entry``); their calls are not guarded, nor are Transformer Engine's
coalesced gathers and Megatron-FSDP's calls (their domains keep the algorithms NCCL refuses out:
``nccl.algorithms.call_algorithms``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from lagom_megatron.megatron import consensus

REFUSALS: tuple[str, ...] = ("invalid usage", "internal error")
"""``ncclGetErrorString`` of ``ncclInvalidUsage`` and ``ncclInternalError`` (NVIDIA/nccl v2.30.7
``src/init.cc:3423-3428``): what NCCL returns when no algorithm is left for a call."""


def refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is NCCL's refusal of a call's algorithm as torch raises it (module docstring)."""
    text = str(exc).lower()
    return any(r in text for r in REFUSALS)


class _BucketCall:
    """The guarded first call of a bucket group: its entry, its own group and the collectives it
    queued (``(fn, args, kwargs, group index)`` as the router saw them)."""

    __slots__ = ("site_id", "entry", "own", "calls")

    def __init__(self, site_id: str, entry: Any, own: Any) -> None:
        self.site_id, self.entry, self.own = site_id, entry, own
        self.calls: list[tuple[Callable[..., Any], tuple, dict, int]] = []


class FirstUse:
    """The guard of one rank (module docstring). ``armed`` is the same on every rank: set by every
    rank's ``arm`` after the same apply, cleared by every rank's ``check``.

    Args:
        queued: torch's open coalescing managers (``router.coalesce_state``: group -> queued calls),
            for the ``first-call`` fault of a bucket group; None = an empty dict.
    """

    def __init__(self, queued: dict | None = None) -> None:
        self.armed = False
        self.seen: set[str] = set()
        self.refused: set[str] = set()
        """Sites whose first call NCCL refused: their calls go to their own group until the check."""
        self.failures: list[tuple[str, str]] = []
        """(site id, error) of each first call that failed on its pool entry this round."""
        self.pending: _BucketCall | None = None
        """The bucket group whose guarded first call runs now (``guard_bucket``), or None."""
        self.queued = {} if queued is None else queued

    def arm(self) -> None:
        """New entries exist: guard the next first call of every site."""
        self.armed, self.seen, self.failures, self.refused = True, set(), [], set()

    def guard(self, site_id: str, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Callable[..., Any]:
        """``orig`` for a routed call of ``site_id`` whose own-group arguments are ``args`` /
        ``kwargs``: the first time, a wrapper that calls ``orig`` with the entry's arguments and, if
        NCCL refuses it (``refusal``), records the refusal and calls ``orig(*args, **kwargs)``
        instead; after such a refusal, every later call of the site goes to its own group."""
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

    def guard_bucket(self, site_id: str, orig: Callable[..., Any], owner: Any, attr: str, own: Any) -> Callable[..., Any]:
        """``orig`` (``start_grad_sync`` / ``start_param_sync``) for a DDP bucket group routed by
        swapping ``owner.<attr>`` to its entry. The first time, ``orig`` runs with ``pending`` set,
        so that ``coalescing`` guards the manager megatron-core opens on the entry; after a refusal,
        every later call runs with the attribute back on its own group ``own``."""
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
        """A collective queued inside a guarded bucket group's manager (the router's bucket scope),
        kept to be issued again on the own group; ``group_index`` is its ``group`` position."""
        pending = self.pending
        if pending is None:
            return
        group = kwargs["group"] if "group" in kwargs else (args[group_index] if len(args) > group_index else None)
        if group is pending.entry:  # not a later manager's (the inter-instance all-reduce's) calls
            pending.calls.append((fn, args, dict(kwargs), group_index))

    def coalescing(self, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """megatron-core's ``_coalescing_manager(group, device=None, async_ops=False)``: guarded when
        it opens on the entry of the bucket group whose first call runs now, else ``orig``'s."""
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
                        a = a[:gi] + (call.own,) + a[gi + 1:]
                    fn(*a, **k)
            for work in getattr(again, "works", ()):  # torch's _CoalescingManager: Megatron waits cm
                cm.append(work)

    def _refuse(self, site_id: str, exc: BaseException) -> None:
        self.refused.add(site_id)
        self.failures.append((site_id, f"{type(exc).__name__}: {exc}"))

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
