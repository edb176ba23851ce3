"""Launches ``tests/megatron/lagom_harness.py`` under torchrun and splits its output per run.

The harness runs several trainings in one launch (one process group, several ``pretrain`` calls);
each training's log starts with a ``HARNESS RUN <name>`` line on stdout. Shared by the end-to-end
and apply-fault tests.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.timeouts import run

HARNESS = Path(__file__).resolve().parent / "lagom_harness.py"


def launch_harness(
    workdir: Path, name: str, runs: list[dict], *, nproc: int, timeout_s: float
) -> tuple[dict, dict[str, str]]:
    """Runs ``runs`` (the harness's spec: name, argv, env per training) on ``nproc`` gloo ranks.

    Args:
        workdir: the folder the launch runs in; the spec and result files are written there.
        name: prefix of the spec and result files.
        runs: one dict per training (``name``, ``argv``, optional ``env``).
        nproc: ranks (``torchrun --standalone --nproc-per-node``).
        timeout_s: wall-clock limit of the launch, seconds.

    Returns:
        (the harness's result JSON: run name -> losses and hook state, run name -> its stdout lines).

    Raises:
        AssertionError: torchrun exited non-zero (the message holds the tails of both streams).
    """
    spec, out = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(HARNESS),
            str(spec),
            str(out),
        ],
        cwd=workdir,
        env=env,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    logs: dict[str, str] = {}
    current = None
    for line in proc.stdout.splitlines():
        if line.startswith("HARNESS RUN "):
            current = line.split(" ", 2)[2]
            logs[current] = ""
        elif current is not None:
            logs[current] += line + "\n"
    return json.loads(out.read_text()), logs
