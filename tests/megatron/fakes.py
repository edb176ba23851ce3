"""Fakes shared by the profiler and posted-request tests: a settable clock and a work handle
that completes at a given time of that clock."""


class Clock:
    """A clock the test sets by hand (``t``, seconds); calling it reads ``t``."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeWork:
    """Completes at ``done_at`` seconds of the fake clock; wait() advances the clock there and
    counts the waits (what ``torch.distributed.Work`` offers the profiler: is_completed, wait)."""

    def __init__(self, clock, done_at):
        self.clock, self.done_at, self.waits = clock, done_at, 0

    def is_completed(self):
        return self.clock.t >= self.done_at

    def wait(self):
        self.waits += 1
        self.clock.t = max(self.clock.t, self.done_at)
        return True
