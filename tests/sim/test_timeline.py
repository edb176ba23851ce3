"""The timeline's stream rules, on hand-built programs with noise off (times worked out by hand)."""

from __future__ import annotations

import pytest

from lagom_megatron.sim import timeline
from lagom_megatron.sim.constants import get
from lagom_megatron.sim.device import COMPUTE_EFF, Collective, CommCost, ComputeKernel, Gpu
from lagom_megatron.sim.program import Call, Program

GPU = Gpu(
    sms=100,
    hbm_gbs=1000.0,
    peak_tflops=100.0,
    nvlink_gbs=100.0,
    net_gbs=10.0,
    gpus_per_node=8,
    sm_arch=90,
    nvswitch=True,
    nvlink_latency_us=1.0,
    net_latency_us=5.0,
    max_channels=64,
)
COLL = Collective(op="all_gather", nbytes=1 << 20, group_size=8)


def _cost(t_us: float, ctas: int = 10, hbm_mult: float = 0.0) -> CommCost:
    """A collective of exactly ``t_us`` alone: no latency, 1 GB/s -> t_us * 1e3 bytes."""
    return CommCost(latency_us=0.0, wire_bytes=t_us * 1e3, bw_gbs=1.0, ctas=ctas, hbm_mult=hbm_mult)


def _math_kernel(us_alone: float) -> ComputeKernel:
    # pure math: flops / (100 TFLOP/s * GEMM efficiency) us, plus the fixed 1 us launch cost
    return ComputeKernel("k", "gemm", (us_alone - 1.0) * 100e6 * COMPUTE_EFF["gemm"], 0.0)


def _two_queued(kernel):
    """Collectives a and b launched on one stream (b queued behind a), then ``kernel``, then both waited."""
    prog = Program()
    a = prog.launch(Call("a", COLL, "dp"))
    b = prog.launch(Call("b", COLL, "dp"))
    prog.kernel(kernel, 0)
    prog.wait(a)
    prog.wait(b)
    return prog


def _run(prog, costs, **kw):
    return timeline.run(prog, GPU, costs, sigma_comp=0.0, sigma_comm=0.0, **kw)


def test_kernel_alone_and_beside_a_collective_holding_ctas():
    prog = Program()
    prog.kernel(_math_kernel(101.0), 0)
    assert _run(prog, []).total_us == pytest.approx(101.0)
    prog = Program()
    i = prog.launch(Call("s", COLL, "tp"))
    prog.kernel(_math_kernel(101.0), 0)
    prog.wait(i)
    res = _run(prog, [_cost(1000.0, ctas=50)])
    # the whole kernel runs on 50 of 100 SMs: math takes twice as long (100 -> 200 us, + 1 us)
    assert res.calls[0].window_busy_us == pytest.approx(201.0)
    assert res.calls[0].t_comm_us == pytest.approx(1000.0)
    assert res.total_us == pytest.approx(1000.0)


def test_serialize_runs_compute_after_the_collective():
    prog = Program()
    i = prog.launch(Call("s", COLL, "tp"))
    prog.kernel(_math_kernel(101.0), 0)
    prog.wait(i)
    res = _run(prog, [_cost(50.0, ctas=50)], serialize=True)
    assert res.calls[0].window_busy_us == pytest.approx(101.0)  # alone: T_comp
    assert res.total_us == pytest.approx(151.0)


def test_one_stream_per_group_runs_collectives_in_order():
    prog = Program()
    a = prog.launch(Call("a", COLL, "dp"))
    b = prog.launch(Call("b", COLL, "dp"))
    c = prog.launch(Call("c", COLL, "tp"))
    for i in (a, b, c):
        prog.wait(i)
    res = _run(prog, [_cost(100.0, 1), _cost(100.0, 1), _cost(30.0, 1)])
    assert res.calls[b].start_us == pytest.approx(100.0)  # behind a on the dp stream
    assert res.calls[c].start_us == pytest.approx(0.0)  # its own stream
    assert res.total_us == pytest.approx(200.0)


def test_cuda_device_max_connections_1_blocks_compute_behind_a_waiting_collective():
    # Megatron-LM#1468: with one hardware queue, a collective that cannot start yet (its stream is
    # busy) holds back the compute kernels issued after it.
    def build():
        prog = Program()
        a = prog.launch(Call("a", COLL, "dp"))
        b = prog.launch(Call("b", COLL, "dp"))
        prog.kernel(_math_kernel(150.0), 0)
        prog.wait(a)
        prog.wait(b)
        return prog

    costs = [_cost(100.0, ctas=1), _cost(100.0, ctas=1)]
    free = _run(build(), costs, high_priority=frozenset({"dp"}))
    one = _run(build(), costs, cdmc1=True)
    assert free.total_us == pytest.approx(200.0)  # the kernel runs beside a, then b (high priority: at once)
    # the kernel may start only once b has started (100 us); beside b it runs on 99 of 100 SMs
    # (151.5 us for the whole kernel), after b ends (200 us) at full speed (150 us for the whole)
    left = 1.0 - 100.0 / (1.0 + 149.0 * 100 / 99)
    assert one.total_us == pytest.approx(200.0 + left * 150.0, rel=1e-6)
    # windows: a's ends at b's launch on the same stream; the kernel is b's overlapped compute
    assert timeline.windows(build()) == [[], [2]]


def test_hbm_proportional_share_slows_a_memory_bound_kernel():
    k = ComputeKernel("copy", "elementwise", 0.0, 800e6)  # 800 MB at 850 GB/s achievable: ~941 us + 1
    prog = Program()
    prog.kernel(k, 0)
    alone = _run(prog, []).total_us
    prog = Program()
    i = prog.launch(Call("s", COLL, "tp"))
    prog.kernel(k, 0)
    prog.wait(i)
    # a collective drawing 1 GB/s x 850 = 850 GB/s of HBM: demand doubles, each side gets half,
    # and the kernel's memory time queues behind the collective's traffic: x (1 + kappa_mem x 0.5)
    res = _run(prog, [_cost(10000.0, ctas=1, hbm_mult=850.0)])
    want = 2 * (alone - 1.0) * (1 + get("kappa_mem") * 0.5) + 1.0
    assert res.calls[0].window_busy_us == pytest.approx(want, rel=0.02)


def test_a_queued_collective_waits_for_the_running_kernels_last_wave_unless_high_priority():
    # CUDA dispatches a running kernel's pending blocks before a later kernel of equal priority
    # (stream priorities, CUDA programming guide; nccl#1431): b, queued behind a, starts only when
    # the kernel's last wave is dispatched; on a high-priority stream it starts when a ends
    from lagom_megatron.sim.program import gemm

    k = gemm("g", 128 * 16, 256 * 10, 4096)  # 160 tiles on 100 SMs: two waves
    costs = [_cost(10.0, ctas=1), _cost(10.0, ctas=1)]
    normal = _run(_two_queued(k), costs)
    fast = _run(_two_queued(k), costs, high_priority=frozenset({"dp"}))
    assert fast.calls[1].start_us == pytest.approx(fast.calls[0].end_us)
    kernel_end = normal.total_us if normal.calls[1].end_us < normal.total_us else None
    assert normal.calls[1].start_us > fast.calls[1].start_us
    assert kernel_end is None or normal.calls[1].start_us < kernel_end  # at the last wave, before the end
    assert timeline.last_wave_fraction(GPU, k, 100) == pytest.approx(0.5)
    assert timeline.last_wave_fraction(GPU, gemm("small", 128, 256 * 10, 64), 100) is None  # SMs left free


def test_a_collectives_time_runs_from_its_stream_reaching_it_and_a_high_priority_call_starts_at_once():
    """torch times a collective between events on its NCCL stream (``WorkNCCL::getDuration``): the
    start event completes when the stream reaches the call, before its kernel gets SMs, so a
    dispatch wait is part of the reported time; a call routed to a high-priority pool entry
    (``high_priority_calls``) waits for no kernel, whatever its group's stream priority."""
    from lagom_megatron.sim.program import gemm

    k = gemm("g", 128 * 16, 256 * 10, 4096)  # two waves on 100 SMs
    costs = [_cost(10.0, ctas=1), _cost(10.0, ctas=1)]
    normal = _run(_two_queued(k), costs)
    b = normal.calls[1]
    assert b.ready_us == pytest.approx(normal.calls[0].end_us) and b.dispatch_wait_us > 1.0
    run = b.end_us - b.start_us
    assert b.t_comm_us == pytest.approx(b.dispatch_wait_us + run) and run >= 10.0  # the wait, then its run
    a = normal.calls[0]
    assert a.dispatch_wait_us == 0.0 and a.t_comm_us == pytest.approx(
        a.end_us - a.start_us
    )  # launched onto a free stream
    one = _run(_two_queued(k), costs, high_priority_calls=frozenset({1}))
    assert one.calls[1].start_us == pytest.approx(one.calls[0].end_us) and one.calls[1].dispatch_wait_us == 0.0
    assert one.calls[1].t_comm_us < b.t_comm_us - 1.0
