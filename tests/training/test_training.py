"""End-to-end pre-training on CPU (gloo) through torchrun: the parallel layouts reproduce the
single-process losses, pretrain() drives its callbacks and LR schedule as documented, and --lagom
parses and is recorded in the log."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.timeouts import LAUNCH_S, run

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.* lm loss: ([0-9.E+-]+) \|")

# 4 layers x 64 hidden, seq 32, dropout off, 4 iterations of 4 samples. LR: 1 warm-up iteration to
# 3e-3, then linear decay to 0 at iteration 4 (Megatron's first step runs at the initial LR, 0).
TINY = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--vocab-size",
    "384",
    "--tokenizer-type",
    "ByteLevel",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--train-iters",
    "4",
    "--lr",
    "3e-3",
    "--min-lr",
    "0",
    "--lr-warmup-iters",
    "1",
    "--lr-decay-style",
    "linear",
    "--log-interval",
    "1",
    "--seed",
    "1234",
]

# The single-process baseline runs pretrain() through this driver, which records the callbacks and
# the returned TrainingResult (rank 0 writes them as JSON).
DRIVER = r"""
import json, os, sys
from lagom_megatron.training.argument_checks import validate_args
from lagom_megatron.training.arguments import parse_args
from lagom_megatron.training.loop import pretrain

class Recorder:
    def __init__(self): self.events = []
    def on_setup(self, ctx):
        self.events.append(["setup", len(ctx.model), type(ctx.model[0]).__name__, ctx.ddp_config.overlap_grad_reduce,
                            callable(ctx.forward_backward_func), ctx.args.train_iters])
    def on_iteration_start(self, it): self.events.append(["start", it])
    def on_iteration_end(self, it, elapsed_s, loss): self.events.append(["end", it, elapsed_s > 0, loss])
    def on_train_end(self): self.events.append(["train_end"])

rec = Recorder()
args = validate_args(parse_args(sys.argv[2:]), int(os.environ["WORLD_SIZE"]))
result = pretrain(args, callbacks=[rec])
if int(os.environ["RANK"]) == 0:
    json.dump({"events": rec.events, "losses": result.losses, "times": result.iteration_times_s,
               "lrs": result.learning_rates}, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A real-text indexed dataset: the first ~60 kB of the standard library's docstrings."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from make_sample_corpus import stdlib_docstrings
    finally:
        sys.path.pop(0)
    from lagom_megatron.training.data import write_indexed_dataset

    prefix = tmp_path_factory.mktemp("corpus") / "sample_text_document"
    write_indexed_dataset(stdlib_docstrings(min_chars=80, max_bytes=60_000), prefix)
    return str(prefix)


def torchrun(nproc, *argv, script=ROOT / "scripts" / "pretrain_gpt.py", timeout=LAUNCH_S):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *argv,
    ]
    proc = run(cmd, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    losses = [float(m.group(3)) for m in LOSS.finditer(proc.stdout)]
    return losses, proc.stdout


@pytest.fixture(scope="module")
def baseline(corpus, tmp_path_factory):
    """TP=1 DP=1 PP=1 run of TINY with --log-interval 2: (recorded JSON, stdout)."""
    tmp = tmp_path_factory.mktemp("baseline")
    (tmp / "driver.py").write_text(DRIVER)
    _, log = torchrun(
        1,
        tmp / "out.json",
        *TINY,
        "--data-path",
        corpus,
        "--log-interval",
        "2",
        "--log-throughput",
        script=tmp / "driver.py",
    )
    record = json.loads((tmp / "out.json").read_text())
    assert len(record["losses"]) == 4
    assert record["losses"][3] < record["losses"][0], f"training should lower the loss; got {record['losses']}"
    return record, log


def test_callbacks_result_and_log_interval(baseline):
    record, log = baseline
    events = record["events"]
    assert events[0] == ["setup", 1, "DistributedDataParallel", False, True, 4]
    assert [e[0] for e in events[1:]] == ["start", "end"] * 4 + ["train_end"]
    assert [e[1] for e in events[1:-1]] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert all(e[2] for e in events[2:-1:2]) and [e[3] for e in events[2:-1:2]] == record["losses"]
    assert len(record["times"]) == 4 and all(t > 0 for t in record["times"])
    # After each step (samples 4, 8, 12, 16): warm-up ends at 4 samples (3e-3), then linear decay
    # over the remaining 12 samples to 0.
    assert record["lrs"] == pytest.approx([3e-3, 2e-3, 1e-3, 0.0])
    # --log-interval 2: lines for iterations 2 and 4, each the mean of its two iterations.
    logged = [(int(m.group(1)), float(m.group(3))) for m in LOSS.finditer(log)]
    losses = record["losses"]
    assert [i for i, _ in logged] == [2, 4]
    assert [v for _, v in logged] == pytest.approx([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2], rel=1e-6)


LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2-distopt-overlap": (
        2,
        [
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "20000",
            "--lagom",
        ],
    ),
    "pp2-1f1b": (2, ["--pipeline-model-parallel-size", "2"]),
    # send/recv overlap is Megatron-LM's default with the interleaved schedule
    "pp2-vpp2-interleaved": (
        2,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_matches_single_process_losses(layout, corpus, baseline, tmp_path):
    nproc, extra = LAYOUTS[layout]
    if "--lagom" in extra:  # keep lagom's run directory (plan, profile, report) out of the source tree
        extra = [*extra, "--lagom-plan", str(tmp_path / "plan.json")]
    losses, log = torchrun(nproc, *TINY, "--data-path", corpus, *extra)
    want_all = baseline[0]["losses"]
    assert len(losses) == len(want_all), log[-2000:]
    for i, (got, want) in enumerate(zip(losses, want_all), 1):
        assert got == pytest.approx(want, rel=1e-4), f"{layout}: iteration {i} lm loss got {got} but should be {want}"
    if "--lagom" in extra:
        assert "pretrain_gpt: lagom=True lagom_warmup_iters=4" in log


def test_evaluation_on_the_validation_split_prints_megatron_lms_line(corpus):
    """--eval-interval 2 --eval-iters 2 on 2 ranks (TP 2): Megatron-LM's validation line after iterations 2
    and 4 and after training, between rows of dashes one longer than the line; the same validation loss
    at iteration 4 and after training would be a coincidence, so the split is read on from one evaluation
    to the next; without --log-throughput there is no throughput field; flags without effect are named."""
    _, log = torchrun(
        2,
        *TINY,
        "--data-path",
        corpus,
        "--tensor-model-parallel-size",
        "2",
        "--eval-interval",
        "2",
        "--eval-iters",
        "2",
        "--distributed-backend",
        "gloo",
        "--no-persist-layer-norm",
        "--save",
        "ckpt",
    )
    lines = log.splitlines()
    found = [
        (i, m)
        for i, line in enumerate(lines)
        if (
            m := re.fullmatch(
                r" validation loss at (iteration \d+(?: on validation set)?) \| lm loss value: "
                r"([0-9.]+E[+-]\d+) \| lm loss PPL: ([0-9.]+E[+-]\d+) \| ",
                line,
            )
        )
    ]
    assert [m.group(1) for _, m in found] == ["iteration 2", "iteration 4", "iteration 4 on validation set"]
    for i, m in found:
        assert lines[i - 1] == lines[i + 1] == "-" * (len(lines[i]) + 1)
        loss, ppl = float(m.group(2)), float(m.group(3))
        assert 0 < loss < 7 and ppl == pytest.approx(2.718281828459045**loss, rel=1e-5)
    assert found[1][1].group(2) != found[2][1].group(2)
    assert "throughput per GPU" not in log
    assert (
        "pretrain_gpt: accepted without effect here: --save (this script writes no checkpoints), "
        "--no-persist-layer-norm (persistent layer-norm kernels are never used)"
    ) in log


def test_iteration_line_has_megatron_fields(baseline):
    """The baseline's logged lines carry Megatron-LM's fields (the FLOPs formula itself is tested
    in test_log_line.py: this tiny model's TFLOP/s rounds to 0.0)."""
    _, log = baseline
    lines = [line for line in log.splitlines() if " iteration " in line and "lm loss" in line]
    assert len(lines) == 2
    for line in lines:
        assert re.search(r"\| throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \| learning rate:", line), line
        assert "| loss scale: 1.0 |" in line and "| number of skipped iterations:   0 |" in line, line
        assert "| number of nan iterations:   0 |" in line, line
