"""Vocabulary padding as Megatron-LM does it: NullTokenizer's ids (one more for its end-of-document
id before megatron-core 0.18) padded to a multiple of --make-vocab-size-divisible-by x TP; the same
padded size in the model, the log line and the plan fingerprint; a TP=2 NullTokenizer run with
--vocab-size 512 and --lagom reaches its last iteration."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from lagom_megatron.megatron.hooks.versions import installed_megatron_core
from lagom_megatron.training.argument_checks import validate_args
from lagom_megatron.training.arguments import parse_args
from lagom_megatron.training.tokenizer import null_tokenizer_vocab_size
from tests.timeouts import LAUNCH_S, run

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "3",
    "--lr",
    "1e-3",
    "--mock-data",
]


@pytest.mark.parametrize(
    "version, vocab, expected",
    [
        ("0.16.1", 512, 513),
        ("0.17.1", 32000, 32001),
        ("0.18.2", 512, 512),
        ("0.19.0", 128256, 128256),
        ("0.20.0rc0", 7, 7),
        (None, 512, 512),
    ],
)
def test_null_tokenizer_ids_per_release(version, vocab, expected):
    assert null_tokenizer_vocab_size(vocab, version) == expected


def test_padding_counts_the_ids_of_the_installed_null_tokenizer():
    from megatron.core.tokenizers import MegatronTokenizer

    from lagom_megatron.training.data import build_tokenizer

    for vocab, tp in ((512, 2), (32000, 1), (128256, 1), (1000, 2)):
        args = validate_args(
            parse_args(
                SMALL
                + [
                    "--tokenizer-type",
                    "NullTokenizer",
                    "--vocab-size",
                    str(vocab),
                    "--tensor-model-parallel-size",
                    str(tp),
                ]
            ),
            tp,
        )
        tokenizer = build_tokenizer(args)
        from megatron.core.tokenizers import megatron_tokenizer

        library = "null" if "null" in getattr(megatron_tokenizer, "TOKENIZER_LIBRARIES", ()) else "null-text"
        reference = MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=vocab)
        assert args.orig_vocab_size == tokenizer.vocab_size == reference.vocab_size
        assert args.padded_vocab_size % (128 * tp) == 0
        assert args.padded_vocab_size - 128 * tp < args.orig_vocab_size <= args.padded_vocab_size
        assert tokenizer.eod < args.padded_vocab_size  # the embedding has a row for every id


def test_padded_sizes_of_the_reported_presets():
    # --vocab-size 512 at TP 2, 32000 and 128256 at TP 1: an exact multiple, so the end-of-document
    # id of a pre-0.18 NullTokenizer needs one more block of 128 x TP.
    mc = installed_megatron_core()
    before_018 = mc is not None and tuple(int(p) for p in mc.version.split(".")[:2]) < (0, 18)
    for vocab, tp, old, new in ((512, 2, 768, 512), (32000, 1, 32128, 32000), (128256, 1, 128384, 128256)):
        args = validate_args(
            parse_args(
                SMALL
                + [
                    "--tokenizer-type",
                    "NullTokenizer",
                    "--vocab-size",
                    str(vocab),
                    "--tensor-model-parallel-size",
                    str(tp),
                ]
            ),
            tp,
        )
        assert args.padded_vocab_size == (old if before_018 else new)


@pytest.mark.distributed
def test_tp2_null_tokenizer_vocab_512_with_lagom_reaches_the_last_iteration(tmp_path):
    iters = 6
    plan = tmp_path / "plan.json"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "scripts" / "pretrain_gpt.py"),
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "512",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        str(iters),
        "--lr",
        "1e-3",
        "--log-interval",
        "1",
        "--lagom",
        "--lagom-warmup-iters",
        "1",
        "--lagom-verify-iters",
        "1",
        "--lagom-plan",
        str(plan),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run(argv, cwd=tmp_path, env=env, text=True, timeout=LAUNCH_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert re.search(rf"iteration\s+{iters}/\s*{iters} \|", out), out[-4000:]
    expected = null_tokenizer_vocab_size(512, installed_megatron_core().version)
    padded = 768 if expected == 513 else 512
    assert f"(vocabulary {expected} padded to {padded})" in out
    fingerprint = json.loads(plan.read_text())["fingerprint"]
    assert fingerprint["padded_vocab_size"] == padded
    assert fingerprint["megatron_core"] == installed_megatron_core().version
