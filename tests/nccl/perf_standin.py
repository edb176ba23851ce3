"""A stand-in for nccl-tests' ``<op>_perf`` binaries, called as ``scripts/gpu/nccl_sweep.sh``
calls the real ones: the same flags (``-b -e -f -g -n -w -c``, README "Arguments"), the NCCL
variables in its environment, output in nccl-tests' format (``perf_text``) with the NCCL INFO
lines NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV prints.

    perf_standin.py --as all_gather_perf -b 1M -e 512M -f 2 -g 8 -n 20 -w 5 -c 1

What NCCL would run: channels NCCL_MIN_NCHANNELS..NCCL_MAX_NCHANNELS (both set: that count, at
most 64; NCCL v2.30.7 src/graph/connect.cc:334-358, 497-505), P2P channels that count rounded up
to a power of two (src/graph/paths.cc:984-990); bandwidth from ``perf_text.Truth`` (its values can
be overridden through ``STANDIN_TRUTH``, a JSON object of Truth's fields).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.nccl.perf_text import Truth, channel_line, nccl_info, run_text, sizes  # noqa: E402

SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    return int(text[:-1]) * SUFFIX[text[-1]] if text[-1] in SUFFIX else int(text)


def main(argv: list[str]) -> int:
    assert argv[0] == "--as", argv
    program, args = argv[1], dict(zip(argv[2::2], argv[3::2]))
    op = program.removesuffix("_perf")
    env = os.environ
    truth = Truth(**json.loads(env.get("STANDIN_TRUTH", "{}")))
    lo, hi = int(env.get("NCCL_MIN_NCHANNELS", "2")), int(env.get("NCCL_MAX_NCHANNELS", "2"))
    coll = min(64, max(lo, min(hi, 2)))  # a PCIe node's 2 rings, raised to the minimum
    p2p = 1 << (coll - 1).bit_length()
    point_to_point = op in ("alltoall", "sendrecv")
    proto = "P2P" if point_to_point else env.get("NCCL_PROTO", "Simple")
    threads = 640 if point_to_point or proto == "LL128" else int(env.get("NCCL_NTHREADS", "512"))
    ranks, host = int(args.get("-g", "1")), "standin-node"
    lines = []
    if env.get("NCCL_DEBUG") == "INFO":
        lines = ["NCCL version 2.27.5+cuda12.9"] + [channel_line(host, r, coll, p2p) for r in range(ranks)]
        for key in ("NCCL_ALGO", "NCCL_PROTO"):
            if key in env:
                lines.append(nccl_info(host, 0, f"{key} set by environment to {env[key]}"))
        if "NCCL_NTHREADS" in env:
            lines.append(nccl_info(host, 0, f"NCCL_NTHREADS set by environment to {env['NCCL_NTHREADS']}."))
    busbw = truth.busbw(proto, p2p if point_to_point else coll, threads)
    print(
        run_text(
            op=op,
            sizes=sizes(_size(args.get("-b", "32M")), _size(args.get("-e", "32M"))),
            busbw=busbw,
            ranks=ranks,
            hosts=[host],
            latency_us=truth.latency_us,
            sweep_line=None,
            nccl_lines=lines,
            check=args.get("-c", "1") != "0",
            iters=int(args.get("-n", "20")),
            warmup=int(args.get("-w", "1")),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
