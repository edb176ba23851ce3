"""The profiler's GPU branch (``Profiler(use_cuda_events=True)``) on a stand-in with ``torch.cuda.Event``'s API.

torch's ``Event(enable_timing=True)``: ``record()`` marks the current stream, ``a.elapsed_time(b)`` is the time from
``a`` to ``b`` in milliseconds once both completed (``torch/cuda/streams.py`` ``Event.record``, ``elapsed_time``),
and ``torch.cuda.synchronize()`` waits for them. The stand-in's stream is a clock the test advances, so each
quantity the profiler derives (communication, compute, region) has one right value.
"""

from __future__ import annotations

import math

import pytest
import torch

from lagom_megatron.megatron.hooks.profiler import Profiler


class _Stream:
    """The current CUDA stream's time, ms: what a recorded event captures."""

    now_ms = 0.0


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "the profiler times with these events"
        self.at_ms: float | None = None

    def record(self, stream=None) -> None:
        self.at_ms = _Stream.now_ms

    def elapsed_time(self, end: _Event) -> float:
        if self.at_ms is None or end.at_ms is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return end.at_ms - self.at_ms


class _Work:
    """An NCCL ``Work``: ``wait()`` makes the stream wait for the kernel (here: ``kernel_ms`` more on the clock);
    ``_get_duration()`` is torch's kernel time in ms when collective timing is on (None: off, the method absent)."""

    def __init__(self, kernel_ms: float, duration_ms: float | None) -> None:
        self.kernel_ms, self.waited = kernel_ms, False
        if duration_ms is not None:
            self._get_duration = lambda: duration_ms

    def wait(self, *args, **kwargs) -> bool:
        if not self.waited:
            _Stream.now_ms += self.kernel_ms
            self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited


@pytest.fixture
def gpu(monkeypatch):
    _Stream.now_ms = 0.0
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


@pytest.mark.parametrize("duration_ms", [None, 1.5], ids=["timing-off", "get-duration"])
def test_a_serialized_call_splits_into_its_kernel_and_the_compute_after_it(gpu, duration_ms):
    prof = Profiler(use_cuda_events=True)
    prof.start_iteration(timed=True, serialize=True)
    t0 = prof.mark()  # issue: stream at 0 ms
    handle = prof.issue("dp.rs[0]", _Work(kernel_ms=2.0, duration_ms=duration_ms), t0)  # serialized: waits, 2 ms
    _Stream.now_ms += 5.0  # the compute the call overlapped in production
    handle.wait()  # "wait" event at 7 ms
    comm, comp, region = prof.finish_iteration()["dp.rs[0]"]
    # communication: torch's duration when collective timing is on, else issue -> serial on the stream
    assert comm == pytest.approx(1500.0 if duration_ms else 2000.0)
    assert comp == pytest.approx(5000.0) and region == pytest.approx(7000.0)


def test_an_overlapped_call_is_timed_from_issue_to_wait(gpu):
    prof = Profiler(use_cuda_events=True)
    prof.start_iteration(timed=True)
    t0 = prof.mark()
    handle = prof.issue("tp.ag[0]", _Work(kernel_ms=3.0, duration_ms=None), t0)
    _Stream.now_ms += 4.0
    handle.wait()  # the stream reaches the wait at 4 ms, then waits out the kernel's 3 ms
    comm, comp, region = prof.finish_iteration()["tp.ag[0]"]
    assert comm == pytest.approx(7000.0) == region and math.isnan(comp)


def test_a_synchronous_call_is_the_time_between_its_two_events(gpu):
    prof = Profiler(use_cuda_events=True)
    prof.start_iteration(timed=True)
    t0 = prof.mark()
    _Stream.now_ms += 3.25
    prof.sync("pp.send[0]", t0)
    assert prof.finish_iteration()["pp.send[0]"] == pytest.approx((3250.0, 0.0, 3250.0))


def test_an_untimed_iteration_records_no_event(gpu, monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: made.append(1) or _Event(enable_timing))
    prof = Profiler(use_cuda_events=True)
    prof.start_iteration(timed=False)
    work = _Work(kernel_ms=1.0, duration_ms=None)
    assert prof.issue("dp.rs[0]", work, prof.mark()) is work and prof.finish_iteration() == {} and made == []
