"""Measures the slowdown a copy kernel holding N CTAs inflicts on compute: data for s(x).

For one GPU: a compute loop (a bf16 GEMM loop, SM-bound; and an element-wise loop, HBM-bound)
runs on one stream while a persistent copy kernel runs on another with exactly N CTAs (grid = N,
each CTA loops over the buffer), standing in for an NCCL collective with N channels. CUDA events
time the compute alone, the copy alone and both overlapped, for several N and copy rates (the
copy's warps per CTA, like NCCL's nThreads). From that it fits, per compute kind,

    s = a * sm_share + b * hbm_share     (docs/engine.md; least squares, numpy)

with sm_share = N / SMs and hbm_share = copy bandwidth alone / measured HBM copy bandwidth.

The copy kernel is written in Triton because Triton lets the grid (number of CTAs) be chosen
exactly and ships with CUDA builds of torch; torch's own copy kernels pick their grid
themselves. Without Triton the sweep is skipped and says so.

Usage: python overlap_sweep.py OUT_DIR [--quick]. Writes OUT_DIR/overlap.csv and overlap.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path


try:  # module level, so that the kernel's globals (tl) resolve when Triton compiles it
    import triton
    import triton.language as tl
except Exception as _exc:  # noqa: BLE001 - any import failure means "no Triton"
    triton = tl = None
    TRITON_ERROR = f"{type(_exc).__name__}: {_exc}"

if triton is not None:

    @triton.jit
    def copy_kernel(src, dst, n_elements, reps, BLOCK: tl.constexpr):
        """Copies src to dst ``reps`` times with the grid's CTAs only: CTA ``pid`` handles blocks
        pid, pid + grid, ... (a persistent loop), so the grid size is the number of CTAs held."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        for _ in range(reps):
            for start in range(pid * BLOCK, n_elements, nprog * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n_elements
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _events_ms(torch, fn, stream=None):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s = stream or torch.cuda.current_stream()
    start.record(s)
    fn()
    end.record(s)
    return start, end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--quick", action="store_true", help="fewer points (smoke run)")
    parser.add_argument("--budget-s", type=float, default=180.0,
                        help="wall-clock budget of the sweep; points past it are skipped (default 180)")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"status": "failed"}

    try:
        import numpy as np
        import torch
    except ImportError as exc:
        result.update(status="skipped", reason=f"missing module: {exc}")
        (out / "overlap.json").write_text(json.dumps(result, indent=2))
        print(f"overlap sweep skipped: {exc}")
        return 0
    if not torch.cuda.is_available():
        result.update(status="skipped", reason="torch.cuda.is_available() is False")
        (out / "overlap.json").write_text(json.dumps(result, indent=2))
        print("overlap sweep skipped: no CUDA device")
        return 0
    if triton is None:
        result.update(status="skipped", reason=f"triton is not usable ({TRITON_ERROR}); the N-CTA copy kernel needs it")
        (out / "overlap.json").write_text(json.dumps(result, indent=2))
        print(result["reason"])
        return 0

    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    result.update(gpu=props.name, sms=sms, torch=torch.__version__, triton=triton.__version__)
    torch.manual_seed(0)

    # HBM copy bandwidth with all SMs (torch's copy), the reference for hbm_share.
    big_src = torch.empty(1 << 28, dtype=torch.float32, device=dev).uniform_()  # 1 GiB
    big_dst = torch.empty_like(big_src)
    for _ in range(3):
        big_dst.copy_(big_src)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = _events_ms(torch, lambda dst=big_dst, src=big_src: dst.copy_(src))
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    hbm_gbps = 2 * big_src.numel() * 4 / (statistics.median(times) * 1e-3) / 1e9
    result["hbm_copy_gbps"] = round(hbm_gbps, 1)
    del big_src, big_dst

    # Compute kinds: an SM-bound GEMM loop and an HBM-bound element-wise loop.
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    c = torch.empty(8192, 8192, dtype=torch.bfloat16, device=dev)
    x = torch.randn(1 << 27, dtype=torch.float32, device=dev)  # 512 MiB
    y = torch.empty_like(x)
    n_iter = 10 if args.quick else 20

    def gemm_loop():
        for _ in range(n_iter):
            torch.matmul(a, b, out=c)

    def elementwise_loop():
        for _ in range(n_iter):
            torch.mul(x, 1.0001, out=y)

    computes = {"gemm": gemm_loop, "elementwise": elementwise_loop}

    src = torch.randn(1 << 26, dtype=torch.float32, device=dev)  # 256 MiB
    dst = torch.empty_like(src)
    copy_stream = torch.cuda.Stream(device=dev)
    comp_stream = torch.cuda.current_stream(dev)
    n_list = [n for n in (1, 2, 4, 8, 16, 32, 64, 96, 128) if n <= sms]
    warps_list = (1, 4, 8)
    if args.quick:
        n_list, warps_list = [n for n in (2, 16, 64) if n <= sms], (4,)

    def launch_copy(n_ctas, warps, reps):
        block = warps * 32 * 8
        copy_kernel[(n_ctas,)](src, dst, src.numel(), reps, BLOCK=block, num_warps=warps)

    rows = []
    t0 = time.time()
    truncated = False
    for k, (name, compute) in enumerate(computes.items()):
        kind_deadline = t0 + args.budget_s * (k + 1) / len(computes)  # each kind gets its share
        compute()
        torch.cuda.synchronize()
        alone = []
        for _ in range(3):
            s, e = _events_ms(torch, compute)
            torch.cuda.synchronize()
            alone.append(s.elapsed_time(e))
        t_comp_alone = statistics.median(alone)
        for warps in warps_list:
            for n in n_list:
                if time.time() > kind_deadline:
                    truncated = True
                    break
                launch_copy(n, warps, 1)  # compile + warm up
                torch.cuda.synchronize()
                s, e = _events_ms(torch, lambda: launch_copy(n, warps, 1))
                torch.cuda.synchronize()
                t_pass = s.elapsed_time(e)
                copy_gbps = 2 * src.numel() * 4 / (t_pass * 1e-3) / 1e9
                # enough passes that the copy outlasts the compute loop by half again
                reps = max(1, min(200, int(1.5 * t_comp_alone / max(t_pass, 1e-3)) + 1))
                over, copy_over = [], []
                for _ in range(3):
                    cs, ce = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    cs.record(copy_stream)
                    with torch.cuda.stream(copy_stream):
                        launch_copy(n, warps, reps)
                    ce.record(copy_stream)
                    s, e = _events_ms(torch, compute, comp_stream)
                    torch.cuda.synchronize()
                    over.append(s.elapsed_time(e))
                    copy_over.append(cs.elapsed_time(ce))
                t_over = statistics.median(over)
                rows.append({
                    "compute": name, "n_ctas": n, "warps_per_cta": warps, "sm_share": n / sms,
                    "copy_gbps_alone": round(copy_gbps, 1), "hbm_share": copy_gbps / hbm_gbps,
                    "copy_gbps_overlapped": round(2 * src.numel() * 4 * reps / (statistics.median(copy_over) * 1e-3) / 1e9, 1),
                    "t_compute_alone_us": round(t_comp_alone * 1e3, 1), "t_compute_overlapped_us": round(t_over * 1e3, 1),
                    "slowdown": t_over / t_comp_alone - 1.0,
                })
                print(f"{name:11s} N={n:3d} warps={warps} copy {copy_gbps:7.1f} GB/s  "
                      f"compute {t_comp_alone:7.2f} -> {t_over:7.2f} ms  s={rows[-1]['slowdown']:.3f}", flush=True)

    with open(out / "overlap.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fits = {}
    for name in computes:
        pts = [r for r in rows if r["compute"] == name]
        if len(pts) < 2:
            fits[name] = {"points": len(pts), "a_sm": None, "b_hbm": None, "mape_percent": None, "max_slowdown": None}
            continue
        A = np.array([[r["sm_share"], r["hbm_share"]] for r in pts])
        s = np.array([r["slowdown"] for r in pts])
        coef, *_ = np.linalg.lstsq(A, s, rcond=None)
        pred = A @ coef
        big = np.abs(s) > 0.02  # MAPE over points with a measurable slowdown
        mape = float(np.mean(np.abs(pred[big] - s[big]) / np.abs(s[big])) * 100) if big.any() else None
        fits[name] = {"a_sm": float(coef[0]), "b_hbm": float(coef[1]), "mape_percent": mape,
                      "max_slowdown": float(s.max()), "points": len(pts)}
    result.update(status="ok", fits=fits, points=len(rows), truncated=truncated, wall_s=round(time.time() - t0, 1))
    (out / "overlap.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(fits, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
