"""Runs ``scripts/pretrain_gpt.py`` and ``lagom doctor`` in-process on one input, for the pre-flight tests.

``train`` calls the script's ``main`` as rank 0 of a torchrun job of ``world`` ranks, with
``lagom_megatron.training.loop.pretrain`` (the first thing that creates a process group) replaced
by a recorder, so a test sees whether a rank would have started. ``doctor`` calls ``lagom doctor``
on the same command line, for this machine (no ``--cluster``) unless a cluster is given.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lagom_megatron.training import pretrain_gpt

ROOT = Path(__file__).resolve().parents[2]
CLEAN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LAGOM_CLUSTER",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)


SCRIPT = pretrain_gpt
"""The program ``scripts/pretrain_gpt.py`` runs (``lagom_megatron.training.pretrain_gpt``)."""


@dataclass
class Outcome:
    """What one entry point did: exit code, its error lines, and (training) whether a rank started."""

    code: int
    errors: list[str]
    started: bool = False
    warnings: list[str] = field(default_factory=list)
    """(training) its ``pretrain_gpt.py: warning:`` lines."""

    @property
    def refused(self) -> bool:
        return self.code != 0


def _env(monkeypatch, env):
    for k in CLEAN:
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)


def train(argv, monkeypatch, capsys, *, world=4, env=None) -> Outcome:
    """``pretrain_gpt.py ARGV`` as rank 0 of ``world``; errors (warnings) = its ``pretrain_gpt.py: error:``
    (``warning:``) lines."""
    import lagom_megatron.training.loop as loop
    from lagom_megatron.preflight.files import _HELD, release_folder_lock

    started = []
    monkeypatch.setattr(loop, "pretrain", started.append)
    _env(monkeypatch, {"RANK": "0", "WORLD_SIZE": str(world), **(env or {})})
    capsys.readouterr()
    held = set(_HELD)
    scratch = None
    if Path.cwd() == ROOT:  # a --lagom run without --lagom-plan writes (and locks) ./lagom_out/: not in the source tree
        scratch = tempfile.mkdtemp(prefix="lagom-train-")
        monkeypatch.chdir(scratch)
    try:
        code = SCRIPT.main(list(argv))
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    finally:
        for folder in set(_HELD) - held:  # a run that may start holds its folders for the process's life
            release_folder_lock(folder)
        if scratch is not None:
            monkeypatch.chdir(ROOT)
            shutil.rmtree(scratch, ignore_errors=True)
    err = capsys.readouterr().err
    return Outcome(
        code,
        [line for line in err.splitlines() if line.startswith("pretrain_gpt.py: error:")],
        bool(started),
        [line for line in err.splitlines() if line.startswith("pretrain_gpt.py: warning:")],
    )


def doctor(argv, monkeypatch, capsys, *, world=4, env=None, options=()) -> Outcome:
    """``lagom doctor --world-size WORLD [OPTIONS] -- ARGV``; errors = the ``what`` of each error finding
    (or the one ``lagom doctor: error:`` line of a refused input)."""
    from lagom_megatron.cli.main import main

    _env(monkeypatch, env)
    capsys.readouterr()
    code = main(["doctor", "--world-size", str(world), *options, "--", *argv])
    out = capsys.readouterr()
    lines = [line.split("] ", 1)[1] for line in out.out.splitlines() if line.startswith("error: [")]
    lines += [line for line in out.err.splitlines() if line.startswith("lagom doctor: error:")]
    return Outcome(code, lines)


def hold_lock_elsewhere(plan: Path) -> subprocess.Popen:
    """Another process (another job) that holds ``plan``'s lock until killed; returns once it holds it."""
    code = (
        "import sys, time\n"
        "from lagom_megatron.preflight.files import hold_folder_lock\n"
        f"hold_folder_lock({str(plan.parent)!r}, {{'SLURM_JOB_ID': '4242'}}, value={str(plan)!r})\n"
        "print('held', flush=True)\n"
        "time.sleep(3600)\n"
    )  # killed by the test; never a limit the test could outlast
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "held"
    return proc
