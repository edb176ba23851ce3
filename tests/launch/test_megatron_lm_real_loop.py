"""Megatron-LM's own training loop (its ``pretrain_gpt.py``, patched) on CPU with gloo and ``--lagom``.

Runs only when ``MEGATRON_LM_DIR`` names a Megatron-LM checkout with one of ``patches/`` applied, and
the ``megatron-lm`` extra installed (``pip install -e '.[megatron-lm]'``); skipped otherwise (the
default suite has no checkout). Each layout (TP2 x DP2 with sequence parallelism, the distributed
optimizer and overlapped reduce and gather; PP2 x DP2 with overlapped reduce) trains twice through
``python -m lagom_megatron.launch.megatron_lm_cpu`` under torchrun, with and without ``--lagom``:
lagom's phases all run (profiling, search, plan, verification), and every ``lm loss`` and
``grad norm`` Megatron-LM prints, and its validation loss, are the same in both runs.

    MEGATRON_LM_DIR=/path/to/Megatron-LM .venv/bin/python -m pytest -q tests/launch/test_megatron_lm_real_loop.py
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.megatron_checkout import megatron_lm_checkout
from tests.timeouts import LAUNCH_S, SCALE, run

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT, NOT_A_CHECKOUT = megatron_lm_checkout()
MISSING = [m for m in ("six", "regex", "pybind11") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(CHECKOUT is None, reason=NOT_A_CHECKOUT),
    pytest.mark.skipif(bool(MISSING), reason=f"the megatron-lm extra is not installed (missing: {', '.join(MISSING)})"),
]

ITERS = 16
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    str(ITERS),
    "--lr",
    "1e-4",
    "--log-interval",
    "1",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1000",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--distributed-backend",
    "gloo",
    "--no-persist-layer-norm",
    "--eval-interval",
    "8",
    "--eval-iters",
    "1",
]
LAYOUTS = {
    "tp2xdp2": [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ],
    "pp2xdp2": ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce"],
}
LAGOM = ["--lagom", "--lagom-warmup-iters", "2", "--lagom-verify-iters", "2"]


def _patched_checkout() -> Path:
    path = CHECKOUT
    script = path / "pretrain_gpt.py"
    assert "LagomHooks" in script.read_text(), (
        f"{script} is not patched: git apply {ROOT}/patches/<the patch for its release> in the checkout"
    )
    return path


def _train(checkout: Path, argv: list[str], log: Path) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(checkout), str(ROOT)]),
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("LAGOM_CLUSTER", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "lagom_megatron.launch.megatron_lm_cpu",
        "pretrain_gpt.py",
        *argv,
    ]
    proc = run(
        cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=LAUNCH_S
    )  # the whole launch's tree is killed at the limit
    log.write_text(proc.stdout)
    assert proc.returncode == 0, f"exit {proc.returncode} (whole log: {log}); " + rank_failure(proc.stdout)
    return proc.stdout


def rank_failure(log: str) -> str:
    """What stopped the launch: lagom's error lines and the first rank's traceback (torchrun's ``[rankN]:`` prefix
    kept), not torchrun's SIGTERM summary; the last 30 lines when there is neither."""
    lines = log.splitlines()
    errors = [line for line in lines if line.startswith(("lagom: error", "lagom doctor: error"))]
    start = next((i for i, line in enumerate(lines) if line.endswith("Traceback (most recent call last):")), None)
    if start is None:
        if errors:
            return "lagom refused:\n" + "\n".join(errors)
        return "last lines:\n" + "\n".join(lines[-30:])
    prefix = lines[start][: -len("Traceback (most recent call last):")]
    trace = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(prefix):
            continue  # another rank's or torchrun's line, interleaved
        trace.append(line)
        body = line[len(prefix) :]
        if body and not body[0].isspace() and not body.startswith(("Traceback", "During handling", "The above")):
            break  # the exception line
    return "\n".join([*errors, "the first rank's traceback:", *trace])


def _numbers(log: str) -> tuple[list[str], list[str]]:
    """(every 'lm loss' and 'grad norm' of Megatron-LM's iteration lines, its validation losses)."""
    steps = [line for line in log.splitlines() if re.search(rf"iteration +\d+/ +{ITERS} \|", line)]
    train = [m for line in steps for m in re.findall(r"(?:lm loss|grad norm): [0-9.E+-]+", line)]
    valid = re.findall(r"validation loss at iteration \d+(?: on validation set)? \| lm loss value: [0-9.E+-]+", log)
    return train, valid


@pytest.mark.timeout(2 * LAUNCH_S / SCALE)  # two launches (scaled once more by tests/conftest.py)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_lm_loop_trains_with_lagom_and_the_same_losses(layout, tmp_path):
    checkout = _patched_checkout()
    base = _train(checkout, TINY + LAYOUTS[layout], tmp_path / "base.log")
    plan = tmp_path / "run" / "plan.json"
    tuned = _train(checkout, TINY + LAYOUTS[layout] + LAGOM + ["--lagom-plan", str(plan)], tmp_path / "lagom.log")

    assert "lagom: hooks around Megatron-LM's train_step" in tuned and "lagom:" not in base
    for phase in ("phase profiling", "phase searching", "phase verifying"):
        assert f"lagom: {phase}" in tuned, phase
    assert re.search(r"lagom: phase (tuned|fell_back)", tuned), [l for l in tuned.splitlines() if l.startswith("lagom")]
    assert plan.is_file() and (plan.parent / "report.md").is_file()
    train_base, valid_base = _numbers(base)
    train_tuned, valid_tuned = _numbers(tuned)
    assert len(train_base) == 2 * ITERS, train_base  # an lm loss and a grad norm per iteration
    assert train_tuned == train_base
    assert len(valid_base) >= ITERS // 8 and valid_tuned == valid_base  # at --eval-interval, and after training
