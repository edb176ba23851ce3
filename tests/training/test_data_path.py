"""``--data-path`` refused before any rank starts, in one line naming what was given and what to give: the
``.bin`` file, a folder, an unpaired blend, a truncated ``.bin`` (its size against what the ``.idx`` indexes:
megatron-core 0.16.1 ``datasets/indexed_dataset.py``), and token ids the tokenizer's vocabulary does not hold."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from lagom_megatron.training import data
from lagom_megatron.training.data import write_indexed_dataset
from tests.training.preflight_harness import doctor, train

TINY = [
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
    "--tensor-model-parallel-size",
    "1",
]


class Gpt2Ids:
    """A stand-in for a GPT-2 BPE tokenizer: ids up to its end-of-document 50256."""

    eod = 50256

    def tokenize(self, text):
        return [50000 + (ord(c) % 200) for c in text]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(ByteLevel prefix, GPT-2-id prefix) of small indexed datasets."""
    folder = tmp_path_factory.mktemp("datasets")
    texts = [f"document {i} " * 40 for i in range(30)]
    write_indexed_dataset(texts, folder / "bytes")
    write_indexed_dataset(texts, folder / "gpt2", tokenizer=Gpt2Ids())
    return folder / "bytes", folder / "gpt2"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(argv, monkeypatch, capsys, folder: Path) -> str:
    """The one error line of a refused 1-rank run; asserts exit 2, no rank started and ``folder`` unchanged."""
    before = snapshot(folder)
    t = train(TINY + argv, monkeypatch, capsys, world=1)
    assert (t.code, t.started, len(t.errors)) == (2, False, 1), t
    assert snapshot(folder) == before
    return t.errors[0].removeprefix("pretrain_gpt.py: error: ")


def test_the_bin_file_names_the_prefix_to_give(corpus, monkeypatch, capsys):
    prefix = corpus[0]
    line = refused(["--data-path", f"{prefix}.bin"], monkeypatch, capsys, prefix.parent)
    assert line == (
        f"--data-path '{prefix}.bin' names the dataset's .bin file; give its prefix without the suffix: "
        f"--data-path {prefix}"
    )


def test_a_folder_names_the_datasets_in_it(corpus, monkeypatch, capsys, tmp_path):
    folder = corpus[0].parent
    line = refused(["--data-path", str(folder)], monkeypatch, capsys, folder)
    assert line == (
        f"--data-path '{folder}' is a folder; give the prefix of a dataset in it, e.g. {folder}/bytes, {folder}/gpt2"
    )
    (tmp_path / "empty").mkdir()
    line = refused(["--data-path", str(tmp_path / "empty")], monkeypatch, capsys, tmp_path)
    assert line.endswith(f"({tmp_path / 'empty'} holds no PREFIX.bin + PREFIX.idx pair)")


@pytest.mark.parametrize(
    "blend, message",
    [
        (["0.3", "{p}", "0.7"], "3 values, 2 of them weights; {pairs} (or prefixes alone, without weights)"),
        (["{p}", "0.3", "{p}", "0.7"], "'{p}' stands in a weight's place; {pairs}"),
        (["-1", "{p}", "1", "{p}"], "weight -1 must be a finite number >= 0"),
        (["0", "{p}", "0", "{p}"], "every weight is 0; give at least one dataset a weight > 0"),
    ],
)
def test_a_blend_pairs_weights_and_prefixes(blend, message, corpus, monkeypatch, capsys):
    words = [w.format(p=corpus[0]) for w in blend]
    line = refused(["--data-path", *words], monkeypatch, capsys, corpus[0].parent)
    pairs = "a blend pairs each weight with the dataset prefix after it: --data-path W1 PREFIX1 W2 PREFIX2 ..."
    assert line == f"--data-path {' '.join(words)}: {message.format(p=corpus[0], pairs=pairs)}"


def test_a_paired_blend_is_accepted(corpus, monkeypatch, capsys):
    t = train(TINY + ["--data-path", "0.3", str(corpus[0]), "0.7", str(corpus[0])], monkeypatch, capsys, world=1)
    assert (t.code, t.errors, t.started) == (0, [], True)


def test_a_truncated_bin_is_refused_with_both_sizes(corpus, monkeypatch, capsys, tmp_path):
    """The ``.idx`` indexes ``pointers[-1] + lengths[-1] x itemsize`` bytes (``indexed_dataset.py:213-230``):
    the builder's own ``.bin`` has exactly that many; a copy cut short is refused naming the file and both sizes."""
    whole = Path(f"{corpus[0]}.bin").read_bytes()
    idx = Path(f"{corpus[0]}.idx").read_bytes()
    _, code, n_seq, _ = struct.unpack("<QBQQ", idx[9:34])
    lengths = np.frombuffer(idx, np.int32, n_seq, 34)
    pointers = np.frombuffer(idx, np.int64, n_seq, 34 + 4 * n_seq)
    assert code == 8 and len(whole) == int(pointers[-1]) + 2 * int(lengths[-1]) == 2 * int(lengths.sum())
    cut = tmp_path / "trunc"
    Path(f"{cut}.bin").write_bytes(whole[:1000])
    Path(f"{cut}.idx").write_bytes(idx)
    line = refused(["--data-path", str(cut)], monkeypatch, capsys, tmp_path)
    assert line == (
        f"--data-path '{cut}': {cut}.bin has 1000 bytes but {cut}.idx indexes {len(whole)} "
        f"({len(whole) // 2} tokens of uint16): truncated, or the two files are of different datasets; "
        "copy both whole, or make them again with scripts/preprocess_data.py"
    )
    Path(f"{cut}.idx").write_bytes(idx[:40])
    line = refused(["--data-path", str(cut)], monkeypatch, capsys, tmp_path)
    assert line.startswith(f"--data-path '{cut}': {cut}.idx has 40 bytes but its header announces {n_seq} sequences")
    assert line.endswith("bytes): truncated")
    Path(f"{cut}.idx").write_bytes(b"not an index" * 4)
    assert "is not an indexed-dataset index" in refused(["--data-path", str(cut)], monkeypatch, capsys, tmp_path)


def test_the_doctor_refuses_a_truncated_bin_too(corpus, monkeypatch, capsys, tmp_path):
    cut = tmp_path / "trunc"
    Path(f"{cut}.bin").write_bytes(Path(f"{corpus[0]}.bin").read_bytes()[:1000])
    Path(f"{cut}.idx").write_bytes(Path(f"{corpus[0]}.idx").read_bytes())
    d = doctor(TINY + ["--data-path", str(cut)], monkeypatch, capsys, world=1)
    assert d.code == 1 and len(d.errors) == 1 and f"{cut}.bin has 1000 bytes but {cut}.idx indexes" in d.errors[0]


def test_token_ids_beyond_the_vocabulary_are_refused_with_both_numbers(corpus, monkeypatch, capsys):
    gpt2 = corpus[1]
    line = refused(["--data-path", str(gpt2)], monkeypatch, capsys, gpt2.parent)
    assert line == (
        f"--data-path '{gpt2}': token id 50256 in {gpt2}.bin but the ByteLevel tokenizer has 257 ids (0..256): "
        "the dataset was tokenized with another tokenizer; tokenize it again with scripts/preprocess_data.py, "
        "or give --tokenizer-type NullTokenizer --vocab-size 50257 (or more)"
    )
    t = train(
        TINY + ["--data-path", str(gpt2), "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257"],
        monkeypatch,
        capsys,
        world=1,
    )
    assert (t.code, t.errors, t.started) == (0, [], True)


def test_a_large_bin_is_sampled_in_windows(tmp_path, monkeypatch):
    """Over DATA_SCAN_BYTES, SCAN_WINDOWS evenly spaced windows of DATA_SCAN_BYTES in all are read."""
    ids = np.zeros(4096, np.uint16)
    ids[0], ids[2048] = 7, 9  # window starts (step 4096 // 4); 11 lies between windows
    ids[3000] = 11
    path = tmp_path / "big.bin"
    ids.tofile(path)
    monkeypatch.setattr(data, "DATA_SCAN_BYTES", 4096)  # 8192 bytes: over it
    monkeypatch.setattr(data, "SCAN_WINDOWS", 4)
    assert data.largest_token_id(path, np.uint16) == (9, 4096)
    monkeypatch.setattr(data, "DATA_SCAN_BYTES", 8192)
    path2 = tmp_path / "big2.bin"
    ids.tofile(path2)
    assert data.largest_token_id(path2, np.uint16) == (11, 8192)


def test_a_folder_beside_its_dataset_is_the_prefix(corpus, monkeypatch, capsys, tmp_path):
    """megatron-core's caches may sit in a folder named as the prefix: with PREFIX.bin there, PREFIX is a dataset."""
    prefix = tmp_path / "doc"
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(Path(f"{corpus[0]}{suffix}").read_bytes())
    prefix.mkdir()
    t = train(TINY + ["--data-path", str(prefix)], monkeypatch, capsys, world=1)
    assert (t.code, t.errors, t.started) == (0, [], True)
