"""Data: byte-level tokenizer, JSONL -> indexed dataset, Megatron dataset building, micro-batch order."""

import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from lagom_megatron.training.data import build_datasets, microbatch_indices, read_jsonl_texts, write_indexed_dataset
from lagom_megatron.training.tokenizer import ByteLevelTokenizer, padded_vocab_size
from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "Zwölf Boxkämpfer jagen Viktor quer über den Sylter Deich.",
    "Pack my box with five dozen liquor jugs. " * 20,
]


def load_script(name):
    """Imports scripts/<name>.py as a module (the scripts are thin wrappers with a main(argv))."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_byte_level_tokenizer_round_trip():
    tok = ByteLevelTokenizer()
    ids = tok.tokenize(DOCS[2])
    assert list(ids) == list(DOCS[2].encode("utf-8"))
    assert tok.detokenize(list(ids)) == DOCS[2]
    assert (tok.vocab_size, tok.eod) == (257, 256)


@pytest.mark.parametrize(
    "vocab, divisible_by, tp, expected",
    [
        (257, 128, 1, 384),
        (257, 128, 2, 512),
        (256, 128, 1, 256),
        (50257, 128, 8, 51200),
    ],
)
def test_padded_vocab_size(vocab, divisible_by, tp, expected):
    got = padded_vocab_size(vocab, divisible_by=divisible_by, tensor_model_parallel_size=tp)
    assert got == expected and got % (divisible_by * tp) == 0 and got - vocab < divisible_by * tp


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def test_preprocess_script_writes_megatron_indexed_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = tmp_path / "docs.jsonl"
    write_jsonl(src, DOCS)
    preprocess = load_script("preprocess_data")
    assert preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "out" / "docs_text_document")]) == 0
    ds = IndexedDataset(str(tmp_path / "out" / "docs_text_document"))
    non_empty = [d for d in DOCS if d]
    assert len(ds) == len(non_empty)  # the empty document is skipped
    for i, doc in enumerate(non_empty):
        assert list(ds[i]) == list(doc.encode("utf-8")) + [256]  # bytes then end-of-document
    assert not list((tmp_path / "out").glob("*.tmp*"))


def test_bad_jsonl_names_file_and_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object with a string 'text' field"):
        list(read_jsonl_texts(src))


def dataset_args(**kw):
    base = dict(
        seed=1234,
        seq_length=16,
        mock_data=False,
        data_path=None,
        split="969,30,1",
        data_cache_path=None,
        train_iters=3,
        global_batch_size=4,
    )
    base.update(kw)
    return Namespace(**base)


def test_gpt_dataset_reads_the_documents_in_sequence(tmp_path):
    prefix = tmp_path / "docs_text_document"
    write_indexed_dataset([d for d in DOCS if d], prefix)
    ds, _ = build_datasets(dataset_args(data_path=[str(prefix)], split="100,0,0"), ByteLevelTokenizer())
    assert len(ds) >= 3 * 4
    sample = ds[0]
    assert sample["tokens"].shape == (16,) and sample["attention_mask"].shape == (1, 16, 16)
    # Labels are the tokens shifted by one, and every token comes from the corpus stream.
    assert sample["labels"][:-1].tolist() == sample["tokens"][1:].tolist()
    stream = b"".join(d.encode("utf-8") + b"\x00" for d in DOCS if d)
    text = bytes(t if t < 256 else 0 for t in sample["tokens"].tolist())
    assert text in stream * 2


def test_mock_dataset_with_byte_tokenizer():
    ds, _ = build_datasets(dataset_args(mock_data=True), ByteLevelTokenizer())
    assert len(ds) >= 12
    tokens = np.asarray(ds[5]["tokens"])
    assert tokens.shape == (16,) and tokens.min() >= 0 and tokens.max() <= 256


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_microbatches_cover_the_same_global_batch_for_any_dp(dp):
    gbs, mbs = 8, 2
    for iteration in range(3):
        seen = [
            i
            for r in range(dp)
            for mb in microbatch_indices(
                iteration, global_batch_size=gbs, micro_batch_size=mbs, data_parallel_size=dp, data_parallel_rank=r
            )
            for i in mb
        ]
        assert sorted(seen) == list(range(iteration * gbs, (iteration + 1) * gbs))
    # Megatron's sampler order: rank 1 of DP 2 takes samples 2-3 of each 4-sample step.
    assert microbatch_indices(
        0, global_batch_size=8, micro_batch_size=2, data_parallel_size=2, data_parallel_rank=1
    ) == [[2, 3], [6, 7]]


def test_sample_corpus_is_english_and_deterministic():
    stdlib_docstrings = load_script("make_sample_corpus").stdlib_docstrings
    a = list(stdlib_docstrings(min_chars=80, max_bytes=30_000))
    b = list(stdlib_docstrings(min_chars=80, max_bytes=30_000))
    assert a == b and sum(len(d) for d in a) >= 30_000
    words = " ".join(a).lower().split()
    assert words.count("the") > 100 and all(d.isascii() and len(d) >= 80 for d in a)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ('{"text": "ok"}\n{"text": \n', "bad.jsonl:2: not valid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', "bad.jsonl:2: expected a JSON object with a string 'text' field"),
        ('{"text": "ok"}\n{"text": 7}\n', "bad.jsonl:2: expected a JSON object with a string 'text' field"),
        ('["ok"]\n', "bad.jsonl:1: expected a JSON object with a string 'text' field"),
    ],
)
def test_preprocess_errors_leave_no_file_behind(tmp_path, capsys, content, message):
    src = tmp_path / "bad.jsonl"
    if content is not None:
        src.write_text(content)
    out = tmp_path / "out"
    assert load_script("preprocess_data").main(["--input", str(src), "--output-prefix", str(out / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("preprocess_data.py: error: ") and message in err[0]
    assert not out.exists() or not list(out.iterdir())  # no PREFIX.tmp.bin, no partial dataset


def test_preprocess_refuses_folders_as_input_or_prefix(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, DOCS)
    (tmp_path / "existing").mkdir()
    main = load_script("preprocess_data").main
    cases = [
        (["--input", str(tmp_path), "--output-prefix", str(tmp_path / "x")], f"--input {tmp_path} is a folder"),
        (
            ["--input", str(src), "--output-prefix", str(tmp_path / "d") + os.sep],
            "names a folder; give a file-name prefix",
        ),
        (
            ["--input", str(src), "--output-prefix", str(tmp_path / "existing")],
            "names a folder; give a file-name prefix",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "existing"]  # no d.bin beside the folder
    assert not list((tmp_path / "existing").iterdir())


def test_preprocess_argument_errors_do_not_import_megatron(tmp_path):
    script = str(ROOT / "scripts" / "preprocess_data.py")
    for argv in (["--help"], ["--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "d")]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", script, *argv], capture_output=True, text=True, timeout=COMMAND_S
        )
        assert " megatron" not in proc.stderr and "torch" not in proc.stderr, argv  # -X importtime lists imports
    assert proc.returncode == 2
    assert [l for l in proc.stderr.splitlines() if not l.startswith("import time:")] == [
        f"preprocess_data.py: error: --input {tmp_path / 'none.jsonl'}: no such file"
    ]


def test_sample_corpus_argument_errors(tmp_path, capsys, monkeypatch):
    corpus = load_script("make_sample_corpus")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as info:
        corpus.main(["--output-dir", str(tmp_path / "file")])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"make_sample_corpus.py: error: argument --output-dir: {tmp_path / 'file'}: is a file; give a folder "
        "(see make_sample_corpus.py --help)"
    ]
    for value in ("0", "-5"):
        with pytest.raises(SystemExit) as info:
            corpus.main(["--output-dir", str(tmp_path / "out"), "--max-bytes", value])
        assert info.value.code == 2
        assert f"--max-bytes must be a positive integer; got {value}" in capsys.readouterr().err
    monkeypatch.setattr(corpus, "stdlib_docstrings", lambda min_chars, max_bytes: iter(()))  # as --min-chars 10**8
    assert corpus.main(["--output-dir", str(tmp_path / "new" / "out"), "--min-chars", "100000000"]) == 2
    assert "no docstring of at least --min-chars 100000000" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no empty output folder left


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs, which nobody may write, root included")
def test_sample_corpus_refuses_an_unwritable_folder_before_reading_anything(monkeypatch, capsys):
    """The folder was found unwritable only after 93 s of reading, naming a hidden temporary file."""
    corpus = load_script("make_sample_corpus")
    monkeypatch.setattr(corpus, "stdlib_docstrings", lambda *a: pytest.fail("read before the folder was checked"))
    with pytest.raises(SystemExit) as info:
        corpus.main(["--output-dir", "/sys/kernel/lagom-corpus"])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith(
            "make_sample_corpus.py: error: argument --output-dir: /sys/kernel/lagom-corpus cannot be created "
            "(/sys/kernel is not writable): "
        )
        and ".tmp" not in line
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"text": "ok"}\n{"body": "x"}\n', "bad.jsonl:2: expected a JSON object with a string 'text' field"),
        (b'{"text": "ok"}\n{"text": "cut', "bad.jsonl:2: not valid JSON"),
        (b"\n\n", "--input {src}: no document with a non-empty 'text' field"),
        (b'{"text": ""}\n', "--input {src}: no document with a non-empty 'text' field"),
        (
            b'{"text": "ok"}\n' + bytes(range(128, 256)),
            "bad.jsonl: not a UTF-8 text file (invalid start byte: byte 0x80)",
        ),
    ],
)
def test_preprocess_reads_its_input_before_megatron_core_is_imported(tmp_path, content, message):
    """A bad line, an empty or a binary input is named at once: megatron-core (tens of seconds to import, and its
    warnings) is imported only for an input that will be written."""
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    script = str(ROOT / "scripts" / "preprocess_data.py")
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", script, "--input", str(src), "--output-prefix", str(tmp_path / "o" / "d")],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 2 and " megatron.core" not in proc.stderr and "torch" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if not x.startswith("import time:")]
    assert line.startswith("preprocess_data.py: error: ") and message.format(src=src) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_preprocess_names_the_prefix_whose_folder_cannot_be_written(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, DOCS)
    blocker = tmp_path / "file"
    blocker.write_text("mine\n")
    prefix = blocker / "d"
    assert load_script("preprocess_data").main(["--input", str(src), "--output-prefix", str(prefix)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"preprocess_data.py: error: --output-prefix {prefix}: {blocker} is a file, not a folder"
    assert blocker.read_text() == "mine\n"
