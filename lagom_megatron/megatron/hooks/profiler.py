"""Warm-up profiler: start and end of every collective site and the compute it overlaps. Per call (s): ``t_issue``
launch, ``t_end`` first seen complete, ``t_wait`` consumer's ``wait()``, ``t_serial`` end of the serialized wait. Per
site (us): t_comm = t_end - t_issue (GPU: ``Work._get_duration()``, torch 2.13 ``WorkNCCL::getDuration``, with
``enable_comm_timing`` or ``TORCH_NCCL_ENABLE_TIMING=1``), t_region = max(t_end, t_wait) - t_issue, t_comp = t_wait -
t_serial - later calls' serialized comm (NaN unless serialized)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
    """The torch handle in TE's ``_AsyncHandle`` / ``_NVFP4AllGatherAsyncHandle`` (v2.18 ``pytorch/distributed.py``
    ``:955-979,1300-1321``) or v2.5-v2.11's ``_FP8BlockwiseAllGatherAsyncHandle`` (``:1049-1063``)."""
    inner = getattr(work, "async_handle", None)
    return work if inner is None else inner


def _is_completed(work: Any) -> bool:
    work = _inner_work(work)
    works = getattr(work, "works", None)
    if works is not None:
        return all(w is None or w.is_completed() for w in works)
    fn = getattr(work, "is_completed", None)
    return bool(fn()) if fn is not None else False


def work_duration_us(work: Any) -> float | None:
    """GPU time (us) of ``Work._get_duration()`` (ms), summed over a coalescing manager's; None: gloo or timing off."""
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
    """Turns on ``ProcessGroup._enable_collectives_timing`` (irreversible) for each group; returns how many accepted."""
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
    """Wraps an async ``Work`` (or a coalescing manager) so that ``wait()`` stamps the profiler; else passes through."""

    __slots__ = ("_work", "_timing", "_profiler")

    def __init__(self, work: Any, timing: CallTiming, profiler: Profiler) -> None:
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
        """Waits one request ``part`` of a ``requests.RequestGroup`` (its ``wait_one``), stamping as ``wait()`` does."""
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
    """CUDA events of one call on the current stream (GPU path); ``issue``: the event ``Profiler.mark`` recorded."""

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
    """Per-iteration timing of collective sites; ``clock`` in seconds, ``use_cuda_events`` for the GPU path."""

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
        """After ``finish_iteration``: site id -> (t_comm_us, t_comp_us, t_region_us) per async call, in issue order."""

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
        """The launch instant for ``issue`` / ``sync``: seconds on CPU, a CUDA event on the current stream on GPU."""
        if self.use_cuda_events and self.timed:
            return _cuda_event()
        return self.clock()

    def issue(self, site_id: str, work: Any, t_issue: Any) -> Any:
        """Registers an async call from ``t_issue`` (``mark()``), waited here if serialized; returns its handle."""
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
        """Registers a synchronous call from ``t0`` (``mark()``) to now or ``t1`` (seconds)."""
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
        dur = work_duration_us(t.work)
        if dur is not None:
            return dur
        if t.cuda is not None:
            v = t.cuda.elapsed_us("issue", "serial")
            return v if math.isfinite(v) else 0.0
        return (t.t_serial - t.t_issue) * 1e6 if t.t_serial is not None else 0.0

    def _later_comm_us(self, k: int, alone: list[float]) -> float:
        t = self._calls[k]
        if t.t_serial is None or t.t_wait is None:
            return 0.0
        return sum(
            alone[j]
            for j, u in enumerate(self._calls)
            if j != k and u.t_serial is not None and u.t_issue >= t.t_serial and u.t_serial <= t.t_wait
        )

    def finish_iteration(self) -> dict[str, tuple[float, float, float]]:
        """Site id -> (t_comm_us, t_comp_us, t_region_us) summed; t_comp NaN if async unless serialized, 0 if sync."""
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
                comp = (
                    (wait - t.t_serial) * 1e6
                    if (self.serialize and t.t_serial is not None and t.t_wait is not None)
                    else math.nan
                )
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
        for sid in [
            k for k, v in self.call_times.items() if not all(math.isfinite(c[0]) and math.isfinite(c[2]) for c in v)
        ]:
            del self.call_times[sid]  # a call never waited on (no CUDA event): not timed call by call
        return {k: (v[0], v[1], v[2]) for k, v in out.items()}
