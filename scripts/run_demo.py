"""The README's demo: builds the sample corpus, then trains a small GPT on 4 CPU processes with --lagom.

    python scripts/run_demo.py            (what `make demo` runs; --help prints this and changes nothing)

1. ``data/sample_text_document.{bin,idx}`` from the standard library's docstrings, if missing.
2. ``torchrun --standalone --nproc-per-node 4 scripts/pretrain_gpt.py --preset cpu-tp2-dp2 --lagom``
   (TP=2 x DP=2, sequence parallel, distributed optimizer, overlapped grad reduce / param gather),
   then the same with ``--preset cpu-pp2-dp2`` (PP=2 x DP=2, 1F1B).
3. ``cpu-tp2-dp2`` again for ``REUSE_ITERS`` iterations: it finds the plan step 2 saved and reuses
   it (no profiling or search; a plan its verification rejected keeps the defaults), and writes
   its own ``report.reused-<n>.md`` beside the tuning run's ``report.md``.

lagom writes its plan, profile and reports under ``runs/demo/<preset>/``. The demo lists what it wrote
there in ``DEMO_FILES`` and removes those files at the start of the next demo, so that every demo
searches afresh; it never removes anything else. A folder that holds a file no demo wrote, or one
another run is writing (its lock is held), stops the demo before anything is built or removed
(``lagom_megatron.preflight.files``). Each run's log streams through; at the end the mean lm loss of
the first and last 10 iterations of each tuning run is printed. Exits non-zero if a run fails or its
loss did not go down, 2 when a folder stops it, 130 when interrupted.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_PREFIX = ROOT / "data" / "sample_text_document"
PRESETS = ("cpu-tp2-dp2", "cpu-pp2-dp2")
LOSS = re.compile(r" iteration\s+\d+/\s*\d+ \|.* lm loss: ([0-9.E+-]+) \|")
REUSE_ITERS = 10
"""Iterations of the plan-reuse run (step 3)."""
DEMO_FILES = ".run_demo-files"
"""In each ``runs/demo/<preset>/``: the names the demo wrote there, one a line (the next demo removes those only)."""


def _written(run_dir: Path) -> set[str]:
    """The names an earlier demo listed in ``run_dir`` (with the list itself); empty without a list."""
    listed = run_dir / DEMO_FILES
    if not listed.is_file():
        return set()
    return {line for line in listed.read_text().splitlines() if line and "/" not in line} | {DEMO_FILES}


def folder_problem(run_dir: Path) -> str | None:
    """Why the demo may not use ``run_dir``: it cannot be written, or holds a name no earlier demo wrote; or None."""
    from lagom_megatron.preflight.files import output_folder_problem

    written = _written(run_dir)
    return output_folder_problem(
        run_dir,
        allowed=lambda p: p.name in written,
        advice="the demo removes only what an earlier demo wrote there; move the rest elsewhere, then run it again",
    )


def clear(run_dir: Path) -> None:
    """Removes what an earlier demo listed in ``run_dir`` (``folder_problem`` said nothing else is there)."""
    for name in sorted(_written(run_dir) - {DEMO_FILES}) + [DEMO_FILES]:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()


def record(run_dir: Path, before: set[str]) -> None:
    """Adds to ``run_dir``'s list what appeared there since ``before`` (the names present when the run started)."""
    from lagom_megatron.engine.files import write_text_atomic

    if not run_dir.is_dir():
        return
    names = (_written(run_dir) | {p.name for p in run_dir.iterdir()} - before) - {DEMO_FILES}
    write_text_atomic(run_dir / DEMO_FILES, "".join(f"{n}\n" for n in sorted(names)))


def _listing(run_dir: Path) -> set[str]:
    return {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()


def run(cmd: list[str], env: dict) -> tuple[int, list[float]]:
    """Runs a command, echoing its output, and returns (exit code, logged lm losses)."""
    losses: list[float] = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            match = LOSS.search(line)
            if match:
                losses.append(float(match.group(1)))
    sys.stdout.flush()
    return proc.returncode, losses


def train_command(preset: str, run_dir: Path, *extra: str) -> list[str]:
    """The torchrun command of one demo run of ``preset`` with its lagom files in ``run_dir``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(ROOT / "scripts" / "pretrain_gpt.py"),
        "--preset",
        preset,
        "--lagom",
        "--lagom-plan",
        str((run_dir / "plan.json").relative_to(ROOT)),
        "--data-path",
        str(DATA_PREFIX.relative_to(ROOT)),
        *extra,
    ]


def main(argv: list[str] | None = None) -> int:
    """Parses the command line (``--help`` only), then runs the demo; returns its exit status."""
    argparse.ArgumentParser(
        prog="run_demo.py",
        description=__doc__.split("\n\n")[0],
        epilog=f"writes data/ and runs/demo/{{{','.join(PRESETS)}}}/; see the module docstring",
    ).parse_args(argv)
    try:
        return _main()
    except KeyboardInterrupt:
        print("\nrun_demo: interrupted", file=sys.stderr)
        return 130


def _main() -> int:
    from lagom_megatron.preflight.files import folder_in_use

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for preset in PRESETS:  # cleared below: never under a run that is writing there, never a file no demo wrote
        run_dir = ROOT / "runs" / "demo" / preset
        holder = folder_in_use(run_dir)
        if holder:
            print(
                f"run_demo: runs/demo/{preset} is in use by another run ({holder}); wait for it to finish, "
                "then run the demo again",
                file=sys.stderr,
            )
            return 2
        problem = folder_problem(run_dir)
        if problem:
            print(f"run_demo: {problem}", file=sys.stderr)
            return 2
    if not (DATA_PREFIX.with_suffix(".bin").is_file() and DATA_PREFIX.with_suffix(".idx").is_file()):
        code, _ = run(
            [sys.executable, str(ROOT / "scripts" / "make_sample_corpus.py"), "--output-dir", str(DATA_PREFIX.parent)],
            env,
        )
        if code:
            print(f"run_demo: building the sample corpus failed (exit {code})", file=sys.stderr)
            return code
    summary = []
    for preset in PRESETS:
        run_dir = ROOT / "runs" / "demo" / preset  # lagom's plan, profile and report; fresh each demo
        clear(run_dir)
        cmd = train_command(preset, run_dir)
        print(f"\n=== {preset}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        before = _listing(run_dir)
        try:
            code, losses = run(cmd, env)
        finally:
            record(run_dir, before)
        wall = time.perf_counter() - start
        if code:
            print(
                f"run_demo: {preset} {'interrupted' if code < 0 or code == 130 else 'failed'} (exit {code})",
                file=sys.stderr,
            )
            return code
        if len(losses) < 20:
            print(f"run_demo: {preset} logged {len(losses)} iterations; need at least 20", file=sys.stderr)
            return 1
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        summary.append((preset, len(losses), first, last, wall))
    preset = PRESETS[0]
    cmd = train_command(preset, ROOT / "runs" / "demo" / preset, "--train-iters", str(REUSE_ITERS))
    print(f"\n=== {preset} again, reusing its plan: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    before = _listing(ROOT / "runs" / "demo" / preset)
    try:
        code, _ = run(cmd, env)
    finally:
        record(ROOT / "runs" / "demo" / preset, before)
    if code:
        print(
            f"run_demo: {preset} (plan reuse) {'interrupted' if code < 0 or code == 130 else 'failed'} (exit {code})",
            file=sys.stderr,
        )
        return code
    reuse_wall = time.perf_counter() - start
    print("\n=== demo summary (mean lm loss of the first and last 10 iterations)")
    ok = True
    for preset, n, first, last, wall in summary:
        verdict = "decreased" if last < first else "DID NOT DECREASE"
        ok &= last < first
        print(f"{preset}: {n} iterations in {wall:.1f} s; first 10: {first:.4f}  last 10: {last:.4f}  ({verdict})")
    print(
        f"{PRESETS[0]} plan reuse: {REUSE_ITERS} iterations in {reuse_wall:.1f} s, no profiling or search; "
        f"reports in runs/demo/<preset>/"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
