"""End-to-end pre-training on CPU (gloo) through torchrun: the parallel layouts reproduce the
single-process losses, and --lagom parses and is recorded in the log."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.* lm loss: ([0-9.E+-]+) \|")

# 4 layers x 64 hidden, seq 32, dropout off, 3 iterations of 4 samples (LR at its peak from step 1).
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--vocab-size", "384", "--tokenizer-type", "ByteLevel",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "3e-3", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
        "--log-interval", "1", "--seed", "1234"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A real-text indexed dataset: the first ~60 kB of the standard library's docstrings."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from make_sample_corpus import stdlib_docstrings
    finally:
        sys.path.pop(0)
    from lagom_megatron.integration.data import write_indexed_dataset

    prefix = tmp_path_factory.mktemp("corpus") / "sample_text_document"
    write_indexed_dataset(stdlib_docstrings(min_chars=80, max_bytes=60_000), prefix)
    return str(prefix)


def torchrun(nproc, *argv, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "scripts" / "pretrain_gpt.py"), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    losses = [float(m.group(3)) for m in LOSS.finditer(proc.stdout)]
    return losses, proc.stdout


@pytest.fixture(scope="module")
def baseline(corpus):
    losses, _ = torchrun(1, *TINY, "--data-path", corpus)
    assert len(losses) == 3
    assert losses[2] < losses[0], f"the optimizer should lower the loss in 3 steps; got {losses}"
    return losses


LAYOUTS = {
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2-distopt-overlap": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                "--ddp-bucket-size", "20000", "--lagom"]),
    "pp2-1f1b": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp2-vpp2-interleaved": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                                 "--overlap-p2p-communication"]),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_matches_single_process_losses(layout, corpus, baseline):
    nproc, extra = LAYOUTS[layout]
    losses, log = torchrun(nproc, *TINY, "--data-path", corpus, *extra)
    assert len(losses) == len(baseline), log[-2000:]
    for i, (got, want) in enumerate(zip(losses, baseline), 1):
        assert got == pytest.approx(want, rel=1e-4), f"{layout}: iteration {i} lm loss got {got} but should be {want}"
    if "--lagom" in extra:
        assert "pretrain_gpt: lagom=True lagom_warmup_iters=4" in log
