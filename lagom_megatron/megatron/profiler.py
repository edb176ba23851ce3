"""Warm-up profiler: start and end of every collective site and the compute it overlaps.

For each call of a site the profiler keeps four instants (seconds of ``time.perf_counter``):

    t_issue   just before the collective is launched
    t_end     first instant the collective was seen complete (``Work.is_completed()``)
    t_wait    when the code that overlapped it asks for the result (``wait()`` is called), i.e.
              the end of the overlapped compute
    t_serial  in a serialized iteration, when the collective, waited on right after launch, ended

and turns them into one ``Sample`` per site and iteration (sums over the site's calls; the same
three times per call are kept in ``Profiler.call_times``, because the sums hide which call is
exposed, ``engine.profile``):

    t_comm_us   = t_end - t_issue
    t_region_us = max(t_end, t_wait) - t_issue
    t_comp_us   = t_wait - t_serial      serialized iterations only (compute alone); NaN otherwise

Completion polling on CPU: the profiler checks ``is_completed()`` of the outstanding handles at
every hook point (each collective issue, each ``wait()``) and finally inside ``wait()`` before
blocking, so ``t_end`` is exact when a hook point falls near the completion and otherwise an
upper bound whose error is the gap between two hook points (in Megatron's backward pass: one
layer's gradient computation). No background thread is used: on a small CPU it would take a
core from the compute being measured.

Synchronous collectives (forward tensor-parallel reductions, ``finalize_model_grads``, pipeline
P2P of the non-interleaved schedule) overlap nothing: ``t_comm = t_region = duration`` and
``t_comp = 0``.

GPU path (``CudaEventTiming``): CUDA events recorded on the current (compute) stream before the
launch (``Profiler.mark``), after the serialized wait and after the consumer's ``wait()`` (which
makes the compute stream wait for NCCL's stream), resolved once per iteration after a device
synchronisation. Synchronous calls get an event before and after (a synchronous NCCL call makes
the current stream wait for the collective). It is selected when CUDA is available.

The collective's own time under overlap comes from NCCL's stream: ``Work._get_duration()``
(milliseconds; torch's ``WorkNCCL::getDuration``, the elapsed time between the start and end CUDA
events ``ProcessGroupNCCL`` records on its NCCL stream around the collective, available once the
group's timing is on: ``ProcessGroup._enable_collectives_timing()``, which ``enable_comm_timing``
calls on every group, or ``TORCH_NCCL_ENABLE_TIMING=1``; both in torch 2.13). A coalesced
handle's duration is the sum over its works (they run one after another on one stream). Where no
duration is available (gloo, timing off) ``t_comm`` falls back to the completion seen from the
host (CPU) or the region (GPU, an upper bound). So on GPU ``t_comm`` < ``t_region`` when the
compute is the longer branch, and the fit sees the slowdown.

Serialized iteration: ``t_comm`` is the collective alone (issue to its immediate wait) and
``t_comp`` the compute alone. A handle waited late (the gradient reduce-scatter of a bucket is
waited at the end of the backward pass) has, between its serialized end and its consumer's wait,
the serialized communication of every later asynchronous call; that time is subtracted, so
``t_comp`` is the compute alone and not inflated by other sites' communication.

The measurement scheme (serialized iteration for compute alone, polling resolution) is our
design; the Lagom paper's profiler text is not available.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(slots=True)
class CallTiming:
    """The instants of one collective call (seconds; None = not observed)."""

    site_id: str
    t_issue: float
    t_end: float | None = None
    t_wait: float | None = None
    t_serial: float | None = None
    work: Any = None
    cuda: Any = None


def _inner_work(work: Any) -> Any:
    """The torch handle inside Transformer Engine's wrappers of one (``_AsyncHandle``,
    ``_NVFP4AllGatherAsyncHandle``: ``async_handle``, TE v2.18 ``pytorch/distributed.py:955-979,
    1300-1321``; v2.5-v2.11's ``_FP8BlockwiseAllGatherAsyncHandle``, v2.11 ``:1049-1063``), else
    ``work`` itself."""
    inner = getattr(work, "async_handle", None)
    return work if inner is None else inner


def _is_completed(work: Any) -> bool:
    work = _inner_work(work)
    works = getattr(work, "works", None)  # torch's _CoalescingManager holds a list of Work
    if works is not None:
        return all(w is None or w.is_completed() for w in works)
    fn = getattr(work, "is_completed", None)
    return bool(fn()) if fn is not None else False


def work_duration_us(work: Any) -> float | None:
    """The collective's own GPU time, microseconds, from ``Work._get_duration()`` (milliseconds, on
    NCCL's stream; module docstring); summed over a coalescing manager's works. None when the
    handle has no duration (gloo, or the group's timing is off: torch raises then)."""
    work = _inner_work(work)
    works = getattr(work, "works", None)
    items = [w for w in works if w is not None] if works is not None else [work]
    total = 0.0
    for w in items:
        fn = getattr(w, "_get_duration", None)
        if fn is None:
            return None
        try:
            total += float(fn()) * 1000.0
        except (RuntimeError, ValueError, NotImplementedError):
            return None
    return total if items else None


def enable_comm_timing(groups: Any) -> int:
    """Turns on torch's collective timing (``ProcessGroup._enable_collectives_timing``) for each
    process group in ``groups``, so their handles report ``_get_duration()``; returns how many
    accepted. The switch cannot be turned off again: every later collective of the group records
    one more CUDA event (small next to a collective)."""
    n = 0
    for g in groups:
        fn = getattr(g, "_enable_collectives_timing", None)
        if fn is None:
            continue
        try:
            fn()
            n += 1
        except RuntimeError:
            continue
    return n


class TimedWork:
    """Wraps an async ``Work`` (or a coalescing manager) so that ``wait()`` stamps the profiler.

    Behaves like the wrapped handle: ``wait()`` returns what it returns, other attributes pass
    through. Waiting twice is allowed (the second wait stamps nothing).
    """

    __slots__ = ("_work", "_timing", "_profiler")

    def __init__(self, work: Any, timing: CallTiming, profiler: "Profiler") -> None:
        self._work = work
        self._timing = timing
        self._profiler = profiler

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t = self._timing
        if t.t_wait is None:
            clock = self._profiler.clock
            t.t_wait = clock()
            self._profiler.poll()
            if t.cuda is not None:
                result = self._work.wait(*args, **kwargs)
                t.cuda.record("wait")
                return result
            result = self._work.wait(*args, **kwargs)
            if t.t_end is None:
                t.t_end = clock()
            return result
        return self._work.wait(*args, **kwargs)

    def wait_part(self, part: Any, *args: Any, **kwargs: Any) -> Any:
        """Waits one request ``part`` of a composite handle (``requests.RequestGroup``, through its
        ``wait_one``, which waits each request once).

        The first part waited stamps the consumer's wait, as ``wait()`` does; the call's end is
        stamped once every part has completed.
        """
        t = self._timing
        first = t.t_wait is None
        if first:
            t.t_wait = self._profiler.clock()
            self._profiler.poll()
        result = self._work.wait_one(part, *args, **kwargs)
        if first and t.cuda is not None:
            t.cuda.record("wait")
        if t.t_end is None and t.cuda is None and _is_completed(self._work):
            t.t_end = self._profiler.clock()
        return result

    def is_completed(self) -> bool:
        return _is_completed(self._work)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _cuda_event() -> Any:
    import torch

    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class CudaEventTiming:
    """CUDA events of one call on the current stream (GPU path; see module docstring).

    Args:
        issue: the event recorded before the launch (``Profiler.mark``); a new one if None.
    """

    __slots__ = ("events",)

    def __init__(self, issue: Any = None) -> None:
        self.events: dict[str, Any] = {"issue": issue if issue is not None else _cuda_event()}

    def record(self, name: str) -> None:
        self.events[name] = _cuda_event()

    def elapsed_us(self, a: str, b: str) -> float:
        """Microseconds between events ``a`` and ``b`` (NaN if either is missing)."""
        if a not in self.events or b not in self.events:
            return math.nan
        return float(self.events[a].elapsed_time(self.events[b])) * 1000.0


class Profiler:
    """Per-iteration timing of collective sites (module docstring gives the formulas).

    Usage, once per iteration::

        profiler.start_iteration(timed=True, serialize=False)
        handle = profiler.issue(site_id, work, t_issue)      # async call, in the hooks
        profiler.sync(site_id, t0, t1)                       # synchronous call
        timings = profiler.finish_iteration()                # site_id -> (t_comm, t_comp, t_region) us

    Args:
        clock: seconds; ``time.perf_counter`` by default.
        use_cuda_events: time with CUDA events (GPU path); default: ``torch.cuda.is_available()``
            is checked by the caller and passed here.
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter, use_cuda_events: bool = False) -> None:
        self.clock = clock
        self.use_cuda_events = use_cuda_events
        self.timed = False
        self.serialize = False
        self._calls: list[CallTiming] = []
        self._outstanding: list[CallTiming] = []
        self._sync: dict[str, float] = {}
        self._sync_cuda: list[tuple[str, Any, Any]] = []
        self.call_times: dict[str, list[tuple[float, float, float]]] = {}
        """After ``finish_iteration``: site id -> (t_comm_us, t_comp_us, t_region_us) of each
        asynchronous call in issue order (synchronous sites have none: one region per site)."""

    def start_iteration(self, *, timed: bool, serialize: bool = False) -> None:
        """Begins an iteration; ``timed=False`` makes every hook a pass-through for the profiler."""
        self.timed = timed
        self.serialize = serialize and timed
        self._calls = []
        self._outstanding = []
        self._sync = {}
        self._sync_cuda = []
        self.call_times = {}

    def mark(self) -> Any:
        """The launch instant to hand to ``issue`` / ``sync``: seconds on CPU, a CUDA event on GPU
        (recorded on the current stream before the launch)."""
        if self.use_cuda_events and self.timed:
            return _cuda_event()
        return self.clock()

    def issue(self, site_id: str, work: Any, t_issue: Any) -> Any:
        """Registers an async call launched at ``t_issue`` (``mark()``); returns the handle the caller keeps.

        In a serialized iteration the call is waited on here, before the caller's compute runs.
        """
        if not self.timed or work is None:
            return work
        cuda = None
        if self.use_cuda_events:
            cuda = CudaEventTiming(t_issue if not isinstance(t_issue, float) else None)
            t_issue = self.clock()
        timing = CallTiming(site_id=site_id, t_issue=t_issue, work=work, cuda=cuda)
        if self.serialize:
            work.wait()
            timing.t_end = timing.t_serial = self.clock()
            if timing.cuda is not None:
                timing.cuda.record("serial")
        else:
            self._outstanding.append(timing)
        self._calls.append(timing)
        return TimedWork(work, timing, self)

    def sync(self, site_id: str, t0: Any, t1: float | None = None) -> None:
        """Registers a synchronous call that started at ``t0`` (``mark()``) and ends now (or at ``t1``,
        seconds). On GPU the end is a CUDA event on the current stream, which a synchronous NCCL
        call makes wait for the collective."""
        if not self.timed:
            return
        if not isinstance(t0, float):  # CUDA event: resolved in finish_iteration
            self._sync_cuda.append((site_id, t0, _cuda_event()))
            return
        end = self.clock() if t1 is None else t1
        self._sync[site_id] = self._sync.get(site_id, 0.0) + (end - t0)

    def poll(self) -> None:
        """Stamps ``t_end`` of every outstanding call that has completed since the last poll."""
        if not self._outstanding:
            return
        now = None
        still = []
        for t in self._outstanding:
            if t.t_end is not None:
                continue
            if _is_completed(t.work):
                now = now if now is not None else self.clock()
                t.t_end = now
            else:
                still.append(t)
        self._outstanding = still

    def _alone_us(self, t: CallTiming) -> float:
        """Communication-alone time of one call of a serialized iteration (us; 0 if unknown)."""
        dur = work_duration_us(t.work)
        if dur is not None:
            return dur
        if t.cuda is not None:
            v = t.cuda.elapsed_us("issue", "serial")
            return v if math.isfinite(v) else 0.0
        return (t.t_serial - t.t_issue) * 1e6 if t.t_serial is not None else 0.0

    def _later_comm_us(self, k: int, alone: list[float]) -> float:
        """Serialized communication of the async calls issued between call ``k``'s serialized end
        and its consumer's ``wait()`` (host instants order the calls on both paths)."""
        t = self._calls[k]
        if t.t_serial is None or t.t_wait is None:
            return 0.0
        return sum(alone[j] for j, u in enumerate(self._calls)
                   if j != k and u.t_serial is not None and u.t_issue >= t.t_serial and u.t_serial <= t.t_wait)

    def finish_iteration(self) -> dict[str, tuple[float, float, float]]:
        """Site id -> (t_comm_us, t_comp_us, t_region_us) summed over the site's calls.

        ``t_comp_us`` is NaN for async sites outside a serialized iteration, 0 for synchronous
        sites. Calls never waited on by their consumer count up to their completion. Each
        asynchronous call's own times are left in ``call_times``.
        """
        self.call_times = {}
        if not self.timed:
            return {}
        self.poll()
        if self.use_cuda_events and (self._calls or self._sync_cuda):
            import torch

            torch.cuda.synchronize()
            for sid, ev0, ev1 in self._sync_cuda:
                self._sync[sid] = self._sync.get(sid, 0.0) + ev0.elapsed_time(ev1) / 1000.0
        out: dict[str, list[float]] = {}
        alone = [self._alone_us(t) for t in self._calls] if self.serialize else []
        for k, t in enumerate(self._calls):
            dur = work_duration_us(t.work)
            if t.cuda is not None:
                region = t.cuda.elapsed_us("issue", "wait")
                if self.serialize:
                    comm = dur if dur is not None else t.cuda.elapsed_us("issue", "serial")
                    comp = t.cuda.elapsed_us("serial", "wait")
                else:
                    comm = dur if dur is not None else region
                    comp = math.nan
            else:
                end = t.t_end
                if end is None:  # never completed nor waited in this iteration: wait now
                    t.work.wait()
                    end = t.t_end = self.clock()
                wait = t.t_wait if t.t_wait is not None else end
                comm = dur if dur is not None else (end - t.t_issue) * 1e6
                region = (max(end, wait) - t.t_issue) * 1e6
                comp = (wait - t.t_serial) * 1e6 if (self.serialize and t.t_serial is not None and t.t_wait is not None) else math.nan
            if self.serialize and math.isfinite(comp):
                comp = max(0.0, comp - self._later_comm_us(k, alone))
            acc = out.setdefault(t.site_id, [0.0, 0.0, 0.0])
            acc[0] += comm
            acc[1] += comp
            acc[2] += region
            self.call_times.setdefault(t.site_id, []).append((comm, comp, region))
        for sid, dt in self._sync.items():
            acc = out.setdefault(sid, [0.0, 0.0, 0.0])
            acc[0] += dt * 1e6
            acc[2] += dt * 1e6
            self.call_times.pop(sid, None)  # some calls synchronous: the per-call list would be short
        for sid in [k for k, v in self.call_times.items() if not all(math.isfinite(c[0]) and math.isfinite(c[2]) for c in v)]:
            del self.call_times[sid]  # a call never waited on (no CUDA event): not timed call by call
        return {k: (v[0], v[1], v[2]) for k, v in out.items()}
