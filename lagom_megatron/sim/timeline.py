"""Discrete-event timeline of one iteration on one GPU: a compute stream, a stream per group (docs/simulator.md).
``cdmc1``: one queue, launch order (Megatron-LM#1468). A ready collective gets SMs after the running kernel's last wave
unless high-priority (nccl#1431, pytorch#143890); a call's window: kernels from its launch to its wait / next launch."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from lagom_megatron.sim.constants import get
from lagom_megatron.sim.device import HBM_EFF, CommCost, ComputeKernel, Gpu, compute_time_us
from lagom_megatron.sim.program import Program

WINDOW_CAP = 2000
"""Most kernels a window scans (keeps construction linear)."""


@dataclass(slots=True)
class CallRecord:
    """Times of one collective call (us from iteration start)."""

    ready_us: float = -1.0
    """When the call reached the head of its stream (torch's start event on the NCCL stream)."""
    start_us: float = -1.0
    end_us: float = -1.0
    window_busy_us: float = 0.0

    @property
    def t_comm_us(self) -> float:
        """Torch's duration (``WorkNCCL::getDuration``): from ``ready_us``, dispatch wait included."""
        return self.end_us - self.ready_us

    @property
    def dispatch_wait_us(self) -> float:
        return self.start_us - self.ready_us


@dataclass(slots=True)
class TimelineResult:
    """Iteration time, per-call records, micro-batch starts, compute busy time alone and overlapped (all us)."""

    total_us: float
    calls: list[CallRecord]
    mb_start_us: dict[int, float]
    compute_us: float = 0.0
    compute_overlapped_us: float = 0.0


def windows(prog: Program) -> list[list[int]]:
    """Per call, the op indices of the kernels in its window."""
    out: list[list[int]] = [[] for _ in prog.calls]
    ops = prog.ops
    for p, op in enumerate(ops):
        if op[0] != "L":
            continue
        i = op[1]
        stream = prog.calls[i].stream
        win = out[i]
        for q in range(p + 1, min(len(ops), p + 1 + WINDOW_CAP)):
            o = ops[q]
            if o[0] == "K":
                win.append(q)
            elif o[0] == "W" and o[1] == i:
                break
            elif o[0] == "L" and prog.calls[o[1]].stream == stream:
                break
    return out


def last_wave_fraction(gpu: Gpu, k: ComputeKernel, sms_free: float) -> float | None:
    """``k``'s work left once its last wave is dispatched (0 if its CTAs hold their SMs); None if it leaves SMs free."""
    free = int(sms_free)
    if k.max_sms is not None and k.max_sms < free:
        return None
    if k.tiles > 0 and not k.persistent:
        if k.tiles < free:
            return None
        waves = -(-k.tiles // max(1, free))
        return 1.0 / waves if waves >= 2 else 0.0
    return 0.0


def _gate(last_wave: float, wait: float) -> float:
    """Share of the running kernel left when a gated collective starts: its last wave at ``last_wave_wait`` 1."""
    return last_wave + (1.0 - wait) * (1.0 - last_wave)


def run(
    prog: Program,
    gpu: Gpu,
    costs: list[CommCost],
    *,
    serialize: bool = False,
    cdmc1: bool = False,
    seed: int = 0,
    sigma_comp: float | None = None,
    sigma_comm: float | None = None,
    win: list[list[int]] | None = None,
    high_priority: frozenset[str] = frozenset(),
    high_priority_calls: frozenset[int] = frozenset(),
) -> TimelineResult:
    """Simulates ``prog`` with ``costs[i]`` the standalone cost of call ``i``; times in us."""
    rng = random.Random(seed)
    sigma_comm = get("sigma_comm") if sigma_comm is None else sigma_comm
    sigma_comp = get("sigma_compute") if sigma_comp is None else sigma_comp
    wait = get("last_wave_wait")
    kappa_comm = get("kappa_comm")
    ops = prog.ops
    n_calls = len(prog.calls)
    rec = [CallRecord() for _ in range(n_calls)]
    win = win if win is not None else windows(prog)
    owner: dict[int, list[int]] = {}
    for i, ks in enumerate(win):
        for q in ks:
            owner.setdefault(q, []).append(i)
    mb_at = {v: k for k, v in prog.mb_start_op.items()}
    mb_start: dict[int, float] = {}
    hbm = gpu.hbm_gbs * HBM_EFF

    streams: dict[str, deque] = {}
    active: dict[int, list] = {}  # call -> [phase_left_latency_us, bytes_left]
    unstarted: deque = deque()  # launched, not started, in launch order
    done = [False] * n_calls
    t = 0.0
    pc = 0
    cur = None  # ("K", q, kernel, frac_left, noise, start) | ("I", end)
    blocked_on = -1
    comp_us = comp_ovl_us = 0.0

    gated = False  # a ready collective waits for the running kernel's last wave

    def try_start_comm() -> None:
        nonlocal gated
        gated = False
        for i in list(unstarted):
            s = streams[prog.calls[i].stream]
            if s[0] != i:
                if cdmc1:
                    return
                continue
            if rec[i].ready_us < 0:
                rec[i].ready_us = t  # the head of its stream, launched
            if (
                not cdmc1
                and cur is not None
                and cur[0] == "K"
                and prog.calls[i].stream not in high_priority
                and i not in high_priority_calls
                and costs[i].ctas > 0  # copy engines need no SM, so wait for no wave
            ):
                lw = last_wave_fraction(gpu, cur[2], gpu.sms - sum(costs[j].ctas for j in active))
                if lw is not None and cur[3] > _gate(lw, wait) + 1e-9:
                    gated = True
                    continue
            unstarted.remove(i)
            rec[i].start_us = t
            c = costs[i]
            active[i] = [c.latency_us, c.wire_bytes * max(0.2, 1.0 + rng.gauss(0.0, sigma_comm))]

    while True:
        progressed = True
        while progressed:
            progressed = False
            try_start_comm()
            if cur is not None or pc >= len(ops):
                break
            if pc in mb_at and mb_at[pc] not in mb_start:
                mb_start[mb_at[pc]] = t
            op = ops[pc]
            kind = op[0]
            if blocked_on >= 0:
                if done[blocked_on]:
                    blocked_on = -1
                    progressed = True
            elif kind == "L":
                i = op[1]
                streams.setdefault(prog.calls[i].stream, deque()).append(i)
                unstarted.append(i)
                pc += 1
                progressed = True
                if serialize:
                    blocked_on = i
            elif kind == "W":
                if done[op[1]]:
                    pc += 1
                    progressed = True
            elif kind == "I":
                cur = ("I", t + op[1])
                pc += 1
            else:
                if cdmc1 and unstarted:
                    break
                noise = max(0.2, 1.0 + rng.gauss(0.0, sigma_comp))
                cur = ["K", pc, op[1], 1.0, noise, t]
                pc += 1
        if cur is None and pc >= len(ops) and not active and not unstarted:
            break
        ctas = sum(costs[i].ctas for i in active)
        comm_demand = {i: costs[i].bw_gbs * costs[i].hbm_mult for i, a in active.items() if a[0] <= 0.0}
        k_time = None
        d_c = 0.0
        if cur is not None and cur[0] == "K":
            k = cur[2]
            sms_free = gpu.sms - ctas
            k_time = compute_time_us(gpu, k, sms_free=sms_free)
            d_c = k.hbm_bytes / (k_time * 1e3)
        comm_total = sum(comm_demand.values())
        demand = d_c + comm_total
        f = min(1.0, hbm / demand) if demand > 0 else 1.0
        if k_time is not None and (f < 1.0 or comm_total > 0.0):
            k_time = compute_time_us(
                gpu,
                cur[2],
                sms_free=gpu.sms - ctas,
                hbm_gbs=d_c * f if f < 1.0 else None,
                comm_hbm_share=comm_total * f / hbm,
            )
        # compute's HBM draw also slows the collectives (kappa_comm, sim.constants)
        fc = f / (1.0 + kappa_comm * min(1.0, d_c * f / hbm))
        dt = float("inf")
        if cur is not None:
            dt = min(dt, cur[3] * k_time * cur[4]) if cur[0] == "K" else min(dt, cur[1] - t)
            if gated and cur[0] == "K":
                lw = _gate(last_wave_fraction(gpu, cur[2], gpu.sms - ctas) or 0.0, wait)
                if cur[3] > lw + 1e-9:
                    dt = min(dt, (cur[3] - lw) * k_time * cur[4])
        for i, a in active.items():
            if a[0] > 0.0:
                dt = min(dt, a[0])
            else:
                dt = min(dt, a[1] / (costs[i].bw_gbs * fc * 1e3))
        if dt == float("inf"):
            raise RuntimeError(f"timeline deadlock at op {pc} ({ops[pc] if pc < len(ops) else 'end'}), t={t:.1f} us")
        dt = max(dt, 0.0)
        t += dt
        if cur is not None:
            if cur[0] == "K":
                comp_us += dt
                if active:
                    comp_ovl_us += dt
                cur[3] -= dt / (k_time * cur[4])
                if cur[3] <= 1e-9:
                    dur = t - cur[5]
                    for i in owner.get(cur[1], ()):
                        rec[i].window_busy_us += dur
                    cur = None
            elif t >= cur[1] - 1e-9:
                cur = None
        for i in list(active):
            a = active[i]
            if a[0] > 0.0:
                a[0] -= dt
                if a[0] <= 1e-9:
                    a[0] = 0.0
                    if a[1] <= 0.0:
                        a[1] = 0.0
            else:
                a[1] -= dt * costs[i].bw_gbs * fc * 1e3
            if a[0] <= 0.0 and a[1] <= 1e-6:
                del active[i]
                done[i] = True
                rec[i].end_us = t
                streams[prog.calls[i].stream].popleft()
    return TimelineResult(
        total_us=t, calls=rec, mb_start_us=mb_start, compute_us=comp_us, compute_overlapped_us=comp_ovl_us
    )
