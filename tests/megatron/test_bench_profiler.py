"""``scripts/bench_profiler.py`` runs end to end (4 gloo ranks, one iteration per mode) and prints
its figures: the script drives the profiler, the consensus merge and the router exactly as the
controller does, so a change to their interfaces must keep it working."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from tests.timeouts import LAUNCH_S, run

ROOT = Path(__file__).resolve().parents[2]


def test_bench_profiler_runs_and_prints_both_overheads(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run(
        [sys.executable, str(ROOT / "scripts" / "bench_profiler.py"), "--cycles", "1"],
        cwd=tmp_path,
        env=env,
        text=True,
        timeout=LAUNCH_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    m = re.search(r"bench_profiler: (\d+) sites \| 1 iterations per mode", out)
    assert m and int(m.group(1)) > 0, out[-4000:]
    assert re.search(
        r"profiler overhead \(direct: hooks [\d.]+ ms \+ end of iteration [\d.]+ ms\): [\d.]+% of the iteration", out
    )
    assert re.search(r"routing overhead after apply \(isolated loop, warm caches\): [\d.]+ us per routed call", out)
