"""Profiler formulas on a fake clock and fake work handles (no processes needed)."""

import math

import pytest

from lagom_megatron.megatron.profiler import Profiler


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeWork:
    """Completes at ``done_at`` seconds of the fake clock; wait() advances the clock there."""

    def __init__(self, clock, done_at):
        self.clock, self.done_at, self.waits = clock, done_at, 0

    def is_completed(self):
        return self.clock.t >= self.done_at

    def wait(self):
        self.waits += 1
        self.clock.t = max(self.clock.t, self.done_at)
        return True


def test_overlapped_call_completion_seen_by_polling():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True)
    work = FakeWork(clock, done_at=0.004)
    handle = prof.issue("s", work, t_issue=0.001)
    clock.t = 0.005
    prof.poll()  # a later hook point sees it complete: t_end = 5 ms
    clock.t = 0.009
    handle.wait()  # consumer's compute ended at 9 ms
    comm, comp, region = prof.finish_iteration()["s"]
    assert comm == pytest.approx(4000.0)  # 1 ms -> 5 ms
    assert region == pytest.approx(8000.0)  # 1 ms -> max(5, 9) ms
    assert math.isnan(comp)


def test_communication_bound_call_ends_at_wait():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True)
    handle = prof.issue("s", FakeWork(clock, done_at=0.010), t_issue=0.0)
    clock.t = 0.002
    handle.wait()  # compute done at 2 ms, the collective at 10 ms
    comm, _, region = prof.finish_iteration()["s"]
    assert comm == pytest.approx(10000.0) and region == pytest.approx(10000.0)


def test_serialized_iteration_gives_compute_alone_and_sums_calls():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True, serialize=True)
    w1 = FakeWork(clock, done_at=0.003)
    h1 = prof.issue("s", w1, t_issue=0.0)
    assert w1.waits == 1 and clock.t == pytest.approx(0.003)  # waited at launch
    clock.t = 0.010
    h1.wait()  # compute alone: 3 ms -> 10 ms
    clock.t = 0.020
    h2 = prof.issue("s", FakeWork(clock, done_at=0.021), t_issue=0.020)
    clock.t = 0.025
    h2.wait()
    h2.wait()  # a second wait stamps nothing
    comm, comp, region = prof.finish_iteration()["s"]
    assert comm == pytest.approx(3000.0 + 1000.0)
    assert comp == pytest.approx(7000.0 + 4000.0)
    assert region == pytest.approx(10000.0 + 5000.0)


def test_sync_calls_and_untimed_iterations():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=False)
    work = FakeWork(clock, done_at=1.0)
    assert prof.issue("s", work, t_issue=0.0) is work  # untimed: the handle passes through untouched
    prof.sync("p", 0.0, 1.0)
    assert prof.finish_iteration() == {}
    prof.start_iteration(timed=True)
    prof.sync("p", 0.0, 0.002)
    prof.sync("p", 0.005, 0.006)
    assert prof.finish_iteration() == {"p": pytest.approx((3000.0, 0.0, 3000.0))}


def test_never_waited_call_is_closed_at_iteration_end():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True)
    prof.issue("s", FakeWork(clock, done_at=0.007), t_issue=0.001)
    comm, _, region = prof.finish_iteration()["s"]
    assert comm == pytest.approx(6000.0) and region == pytest.approx(6000.0)
