#!/usr/bin/env python3
"""Contention probe for one GPU: how much an NCCL-like channel kernel slows compute beside it.

Times compute kernels (a bf16 GEMM, an element-wise kernel, flash attention) with CUDA events, alone
and while a copy / reduce kernel runs on another stream holding ``ctas`` persistent CTAs (one per
"channel", as NCCL's CTAs are), in three modes:

* ``l2``: the CTAs loop over a 2 MiB buffer that stays in L2: SMs held, almost no HBM traffic
  (the SM term: linear, wave-quantized or persistent);
* ``copy`` (1 read + 1 write) and ``reduce`` (2 reads + 1 write): HBM traffic like a ring
  all-gather / reduce-scatter step (the memory term).

The grid: CTAs 1-64; the same total bytes spread over 2-32 CTAs; chunk sizes (bytes each CTA
handles between barriers, like NCCL's chunk) 32 KiB-4 MiB; 64-512 threads per CTA. Each row holds
what ``lagom calibrate contention`` needs (``lagom_megatron.sim.calibrate.COLUMNS``). A time
guard (``--budget-s``, default 120 s) stops the sweep and writes what was measured; the CSV is
written atomically at the end, at a new name only: an existing file (an earlier measurement
included) is never replaced.

    python scripts/gpu/contention_probe.py --out contention_h200.csv --budget-s 120
    lagom calibrate contention contention_h200.csv

Without a CUDA GPU (or without torch / Triton) it prints why and exits with status 1.
Single-GPU emulation: no NVLink, NIC or proxy traffic, so it calibrates the compute side only.

``--rehearse`` (``check.sh --rehearse``) runs the same command line without a GPU: the sweep's
points and CSV are the real ones, the times come from the simulator's own sharing rule
(``lagom_megatron.sim.calibrate``'s docstring) with the stand-in constants :data:`REHEARSAL_KAPPA`,
so ``lagom calibrate contention`` on the result must give those constants back. The ``gpu`` column
says ``rehearsal stand-in``: such a CSV is never a measurement.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lagom_megatron.sim.calibrate import COLUMNS  # noqa: E402 - the columns `lagom calibrate contention` reads

MIB = 1 << 20
GEMM_N = 8192
COMPUTE_KERNELS = (  # (name, kind, HBM bytes, tiles): the compute side of every row
    ("gemm_8192", "gemm", 3 * GEMM_N * GEMM_N * 2, (GEMM_N // 128) * (GEMM_N // 256)),
    ("gemm_few_waves", "gemm", 2 * (1024 * 16384 * 2) + 1024 * 1024 * 2, 8 * 4),
    ("elementwise", "elementwise", 4 * 256 * MIB * 4, 0),
    ("attention", "attention", 4 * (32 * 8192 * 128) * 2, 0),
)
REHEARSAL_KAPPA = {"kappa_mem": 0.5, "kappa_compute": 0.25}
"""The constants a rehearsal CSV is generated with (stand-ins, not measurements)."""
REHEARSAL_DEVICE = {"sms": 132, "peak_hbm_gbs": 4000.0, "alone_us": 2000.0}
"""The device a rehearsal CSV describes: an H200's SM count, a round peak copy rate, and one
compute time for every kernel (stand-ins)."""


def sweep_points() -> list[tuple[str, int, int, int, int]]:
    """The channel-kernel points of the sweep: (mode, CTAs, threads, chunk bytes, total bytes)."""
    points = []
    for ctas in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        points.append(("l2", ctas, 512, 512 * 1024, 256 * MIB))
        points.append(("copy", ctas, 512, 512 * 1024, 256 * MIB))
    for ctas in (2, 4, 8, 16, 32):  # same total bytes over more CTAs
        points.append(("reduce", ctas, 512, 512 * 1024, 256 * MIB))
    for chunk in (32 * 1024, 128 * 1024, 512 * 1024, 2 * MIB, 4 * MIB):
        points.append(("copy", 16, 512, chunk, 256 * MIB))
    for threads in (64, 128, 256):
        points.append(("copy", 16, threads, 512 * 1024, 256 * MIB))
    return points


def rehearsal_rows() -> list[dict]:
    """The rows of :func:`sweep_points` x :data:`COMPUTE_KERNELS` with stand-in times: each slowdown is
    the simulator's rule (``lagom_megatron.sim.calibrate``) with :data:`REHEARSAL_KAPPA`; a channel
    kernel of ``c`` CTAs moves ``peak x min(1, c / 16)`` GB/s alone."""
    from lagom_megatron.sim.device import ComputeKernel, wave_factor

    sms, peak, alone = REHEARSAL_DEVICE["sms"], REHEARSAL_DEVICE["peak_hbm_gbs"], REHEARSAL_DEVICE["alone_us"]
    rows = []
    for mode, ctas, threads, chunk, total in sweep_points():
        rate = 0.0 if mode == "l2" else peak * min(1.0, ctas / 16)
        for name, kind, hbm_bytes, tiles in COMPUTE_KERNELS:
            wave = wave_factor(sms, sms - ctas, ComputeKernel(name, kind, 0.0, 0.0, tiles=tiles, persistent=False))
            demand = hbm_bytes / (alone * 1e3)
            f = min(1.0, peak / max(demand + rate, 1e-9))
            share = rate * f / peak
            if mode == "l2":
                slow = wave
            elif kind == "gemm":
                slow = wave * (1.0 + REHEARSAL_KAPPA["kappa_compute"] * share)
            else:
                slow = (1.0 / f) * (1.0 + REHEARSAL_KAPPA["kappa_mem"] * share)
            rows.append(
                dict(
                    gpu="rehearsal stand-in (no GPU)",
                    sms=sms,
                    peak_hbm_gbs=peak,
                    kernel=name,
                    kind=kind,
                    tiles=tiles,
                    persistent=0,
                    mode=mode,
                    ctas=ctas,
                    threads=threads,
                    chunk_bytes=chunk,
                    total_bytes=total,
                    t_alone_us=alone,
                    t_overlap_us=round(alone * slow, 4),
                    kernel_hbm_bytes=hbm_bytes,
                    comm_hbm_gbs=round(rate, 1),
                )
            )
    return rows


def _available() -> str | None:
    """None when a CUDA GPU, torch and Triton are usable; else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible (torch.cuda.is_available() is False)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (it ships with torch's CUDA wheels)"
    return None


def _kernels():
    """Builds the Triton channel kernel (imported lazily: the module imports without CUDA)."""
    import triton
    import triton.language as tl

    @triton.jit
    def channel(src, src2, dst, per_cta, chunk, passes, MODE: tl.constexpr, BLOCK: tl.constexpr):
        # One persistent CTA per channel: walks its slice in chunks, a barrier after each chunk
        # (NCCL's step), ``passes`` times. MODE 0 copy, 1 reduce (two reads), 2 L2 loop.
        pid = tl.program_id(0)
        base = pid * per_cta
        for _ in range(passes):
            for c0 in range(0, per_cta, chunk):
                for off in range(c0, c0 + chunk, BLOCK):
                    idx = off + tl.arange(0, BLOCK)
                    mask = idx < per_cta
                    x = tl.load(src + base + idx, mask=mask)
                    if MODE == 1:
                        x += tl.load(src2 + base + idx, mask=mask)
                    tl.store(dst + base + idx, x, mask=mask)
                tl.debug_barrier()

    return channel


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep and writes the CSV. Returns 0; 1 without a GPU (nothing written); 2 on bad options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="CSV to write (atomically; a new file: an existing one is kept)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop the sweep after this many seconds")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per point (median)")
    ap.add_argument(
        "--rehearse", action="store_true", help="no GPU: write the sweep's CSV with stand-in times (module docstring)"
    )
    args = ap.parse_args(argv)
    if args.budget_s <= 0 or args.reps < 1:
        ap.error(f"--budget-s must be > 0 and --reps >= 1; got {args.budget_s}, {args.reps}")
    out = Path(args.out)
    if not out.parent.is_dir():
        ap.error(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")
    if out.exists() or out.is_symlink():
        ap.error(f"--out {str(out)!r} exists: give a new file name (an existing file is never replaced)")
    if args.rehearse:
        rows = rehearsal_rows()
    else:
        why = _available()
        if why:
            print(f"contention_probe: {why}; nothing measured, no CSV written")
            return 1
        rows = _sweep(args.budget_s, args.reps)
    from lagom_megatron.engine.files import write_atomic

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)

    write_atomic(out, write)
    print(f"contention_probe: {len(rows)} rows -> {out}")
    return 0


def _sweep(budget_s: float, reps: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    t_end = time.monotonic() + budget_s
    dev = torch.cuda.current_device()
    prop = torch.cuda.get_device_properties(dev)
    sms, gpu = prop.multi_processor_count, prop.name.replace(",", " ")
    channel = _kernels()
    comp_stream, comm_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn, stream) -> float:
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                a.record()
                fn()
                b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        ts.sort()
        return ts[len(ts) // 2]

    # compute kernels: (name, kind, fn, hbm bytes, tiles), in the order of COMPUTE_KERNELS
    n = GEMM_N
    A = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    E = torch.randn(256 * MIB, device="cuda", dtype=torch.float32)
    q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    few = torch.randn(1024, 16384, device="cuda", dtype=torch.bfloat16)
    fewB = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16)
    fns = [
        lambda: A @ B,
        lambda: few @ fewB,
        lambda: E.mul_(1.0001).add_(1e-6),
        lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
    ]
    computes = [(name, kind, fn, hbm, tiles) for (name, kind, hbm, tiles), fn in zip(COMPUTE_KERNELS, fns)]
    buf_elems = 512 * MIB // 4
    src, src2, dst = (torch.empty(buf_elems, device="cuda", dtype=torch.float32).fill_(1.0) for _ in range(3))
    l2_elems = 2 * MIB // 4

    def comm_fn(mode: str, ctas: int, threads: int, chunk_bytes: int, total_bytes: int, passes: int):
        elems = l2_elems if mode == "l2" else total_bytes // 4
        per_cta = max(1024, elems // ctas)
        chunk = max(1024, min(per_cta, chunk_bytes // 4))
        m = {"copy": 0, "reduce": 1, "l2": 2}[mode]
        return lambda: channel[(ctas,)](
            src, src2, dst, per_cta, chunk, passes, MODE=m, BLOCK=1024, num_warps=max(1, threads // 32)
        )

    # peak copy bandwidth: the channel kernel on every SM, alone
    peak_fn = comm_fn("copy", sms, 512, 4 * MIB, 256 * MIB, 1)
    peak_fn()
    t_peak = timed(peak_fn, comm_stream)
    peak = 2 * 256 * MIB / (t_peak * 1e3)
    points = sweep_points()
    rows = []
    alone = {name: timed(fn, comp_stream) for name, _, fn, _, _ in computes}
    for mode, ctas, threads, chunk, total in points:
        one = comm_fn(mode, ctas, threads, chunk, total, 1)
        one()
        t1 = timed(one, comm_stream)
        hbm_rate = 0.0 if mode == "l2" else (3 if mode == "reduce" else 2) * total / (t1 * 1e3)
        for name, kind, fn, hbm_bytes, tiles in computes:
            if time.monotonic() > t_end:
                print("contention_probe: time budget reached, writing what was measured", file=sys.stderr)
                return rows
            passes = max(1, int(3 * alone[name] / max(t1, 1e-3)) + 1)  # the channel kernel outlasts the compute
            long = comm_fn(mode, ctas, threads, chunk, total, passes)
            ts = []
            for _ in range(reps):
                with torch.cuda.stream(comm_stream):
                    long()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(comp_stream):
                    torch.cuda._sleep(20000)  # let the channel kernel take its SMs first
                    a.record()
                    fn()
                    b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            ts.sort()
            rows.append(
                dict(
                    gpu=gpu,
                    sms=sms,
                    peak_hbm_gbs=round(peak, 1),
                    kernel=name,
                    kind=kind,
                    tiles=tiles,
                    persistent=0,
                    mode=mode,
                    ctas=ctas,
                    threads=threads,
                    chunk_bytes=chunk,
                    total_bytes=total,
                    t_alone_us=round(alone[name], 2),
                    t_overlap_us=round(ts[len(ts) // 2], 2),
                    kernel_hbm_bytes=hbm_bytes,
                    comm_hbm_gbs=round(hbm_rate, 1),
                )
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
