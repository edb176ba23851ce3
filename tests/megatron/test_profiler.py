"""Profiler formulas on a fake clock and fake work handles (no processes needed)."""

import math

import pytest

from lagom_megatron.megatron.hooks.profiler import Profiler
from tests.megatron.fakes import Clock, FakeWork


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
    # and each call's own times, in issue order: the sums hide that the second window is shorter
    assert prof.call_times["s"] == [pytest.approx((3000.0, 7000.0, 10000.0)), pytest.approx((1000.0, 4000.0, 5000.0))]


def test_call_times_keep_an_exposed_call_apart_from_a_hidden_one():
    # FSDP's unit gather: waited at once in the forward pass, prefetched under a layer in the backward
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True)
    h = prof.issue("g", FakeWork(clock, done_at=0.004), t_issue=0.0)
    clock.t = 0.0001
    h.wait()  # exposed: waited 0.1 ms after launch, done at 4 ms
    clock.t = 0.010
    h = prof.issue("g", FakeWork(clock, done_at=0.014), t_issue=0.010)
    clock.t = 0.014
    prof.poll()  # a hook point as it completes
    clock.t = 0.020
    h.wait()  # hidden: 10 ms of compute, done at 14 ms
    prof.sync("p", 0.021, 0.022)
    comm, _, region = prof.finish_iteration()["g"]
    assert (comm, region) == pytest.approx((8000.0, 14000.0))
    assert [(c[0], c[2]) for c in prof.call_times["g"]] == [
        pytest.approx((4000.0, 4000.0)),
        pytest.approx((4000.0, 10000.0)),
    ]
    assert "p" not in prof.call_times  # synchronous: one region per site
    prof.finish_iteration()
    assert len(prof.call_times["g"]) == 2  # finishing again does not add the calls twice
    prof.start_iteration(timed=True)
    assert prof.call_times == {}


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


class TimedNcclWork(FakeWork):
    """A handle of a group with torch's collective timing on: ``_get_duration()`` is the
    collective's own time on NCCL's stream, in milliseconds (WorkNCCL::getDuration)."""

    def __init__(self, clock, done_at, duration_ms):
        super().__init__(clock, done_at)
        self.duration_ms = duration_ms

    def _get_duration(self):
        return self.duration_ms


class UntimedWork(FakeWork):
    def _get_duration(self):
        raise RuntimeError("getDuration only works if timing was enabled")


def test_comm_time_under_overlap_comes_from_the_nccl_stream():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True)
    handle = prof.issue("s", TimedNcclWork(clock, done_at=0.0, duration_ms=0.6), t_issue=0.0)
    clock.t = 0.0024  # the compute, slowed by the collective, ends at 2.4 ms
    handle.wait()
    comm, comp, region = prof.finish_iteration()["s"]
    assert comm == pytest.approx(600.0) and region == pytest.approx(2400.0) and math.isnan(comp)
    # a group whose timing is off falls back to what the host saw
    prof.start_iteration(timed=True)
    clock.t = 0.0
    handle = prof.issue("s", UntimedWork(clock, done_at=0.001), t_issue=0.0)
    clock.t = 0.002
    handle.wait()
    assert prof.finish_iteration()["s"][0] == pytest.approx(2000.0)


def test_late_waited_handle_does_not_count_later_serialized_communication():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True, serialize=True)
    ha = prof.issue("a", FakeWork(clock, done_at=0.001), t_issue=0.0)  # serialized end at 1 ms
    clock.t = 0.002
    hb = prof.issue("b", FakeWork(clock, done_at=0.005), t_issue=0.002)  # alone 3 ms, inside a's window
    clock.t = 0.008
    ha.wait()  # a's consumer (end of backward) at 8 ms: 7 ms of which 3 ms were b's serialized comm
    clock.t = 0.009
    hb.wait()
    got = prof.finish_iteration()
    assert got["a"] == pytest.approx((1000.0, 4000.0, 8000.0))
    assert got["b"] == pytest.approx((3000.0, 4000.0, 7000.0))


def test_slowdown_coefficients_move_from_their_priors_when_samples_show_slowdown():
    """Four overlapped iterations (defaults and three channel counts) of one compute-bound site
    whose compute is slowed more the more channels the collective runs. With the durations NCCL's
    stream reports, the fitted a, b leave their priors; with comm = region (the old GPU path), the
    slowdown is never observed and they stay at the priors."""
    import numpy as np

    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.engine.cost_model import PRIOR_A, PRIOR_B
    from lagom_megatron.engine.fit import fit_cost_model
    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.engine.profile import CollectiveSite, Profile, Sample

    site = CollectiveSite(
        site_id="tp.sp_reduce_scatter[0]",
        op="reduce_scatter",
        nbytes=64 * 2**20,
        dtype="bf16",
        group="tp",
        group_size=8,
        n_nodes=1,
        calls_per_iter=1,
    )
    comp_us = 2000.0
    runs = [
        (CommConfig(), 600.0, 0.20),
        (CommConfig(n_channels=2), 1500.0, 0.03),
        (CommConfig(n_channels=8), 700.0, 0.10),
        (CommConfig(n_channels=16), 500.0, 0.25),
    ]

    def samples(with_duration):
        out = []
        for it, (cfg, comm_us, slow) in enumerate(runs, start=1):
            clock = Clock()
            prof = Profiler(clock=clock)
            prof.start_iteration(timed=True)
            work = TimedNcclWork(clock, 0.0, comm_us / 1e3) if with_duration else FakeWork(clock, 0.0)
            handle = prof.issue(site.site_id, work, t_issue=0.0)
            clock.t = comp_us * (1 + slow) / 1e6
            handle.wait()
            if not with_duration:  # the old GPU path: comm = elapsed(issue, wait) = the region
                prof._calls[0].t_end = clock.t
            comm, _, region = prof.finish_iteration()[site.site_id]
            out.append(
                Sample(
                    site_id=site.site_id,
                    config=cfg,
                    t_comm_us=comm,
                    t_comp_us=comp_us,
                    t_region_us=region,
                    iteration=it,
                )
            )
        return out

    cluster = ClusterSpec.load("h100-sxm-ib400")
    fitted = fit_cost_model(
        Profile(backend="nccl", cluster=cluster.name, iteration_us=1e4, sites=[site], samples=samples(True)), cluster
    )
    blind = fit_cost_model(
        Profile(backend="nccl", cluster=cluster.name, iteration_us=1e4, sites=[site], samples=samples(False)), cluster
    )
    assert (blind.a_S[0], blind.b_S[0]) == (PRIOR_A, PRIOR_B)
    moved = abs(fitted.a_S[0] - PRIOR_A) + abs(fitted.b_S[0] - PRIOR_B)
    assert moved > 0.05, (fitted.a_S[0], fitted.b_S[0])
    assert np.all(np.isfinite([fitted.a_S[0], fitted.b_S[0]]))


class _CudaEventStandIn:
    """``torch.cuda.Event(enable_timing=True)``: ``record()`` stamps the (fake) stream time,
    ``elapsed_time(end)`` returns milliseconds, as torch's CUDA event does."""

    clock = None

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = self.clock()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_cuda_event_path_times_each_call_and_drops_a_call_never_waited(monkeypatch):
    import torch

    clock = Clock()
    monkeypatch.setattr(_CudaEventStandIn, "clock", clock)
    monkeypatch.setattr(torch.cuda, "Event", _CudaEventStandIn)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    prof = Profiler(clock=clock, use_cuda_events=True)
    prof.start_iteration(timed=True)
    h = prof.issue("g", FakeWork(clock, done_at=0.004), t_issue=prof.mark())
    clock.t = 0.002
    h.wait()  # the consumer's wait: the compute stream waits for the gather, done at 4 ms
    clock.t = 0.010
    h = prof.issue("g", FakeWork(clock, done_at=0.012), t_issue=prof.mark())
    clock.t = 0.020
    h.wait()
    prof.finish_iteration()
    # no Work duration here (gloo-like handle): T_comm falls back to the region, per call
    assert prof.call_times["g"] == [
        pytest.approx((4000.0, math.nan, 4000.0), nan_ok=True),
        pytest.approx((10000.0, math.nan, 10000.0), nan_ok=True),
    ]
    prof.start_iteration(timed=True)
    prof.issue("g", FakeWork(clock, done_at=0.030), t_issue=prof.mark())  # its consumer never waits
    clock.t = 0.040
    prof.finish_iteration()
    assert prof.call_times == {}  # no wait event: not timed call by call
