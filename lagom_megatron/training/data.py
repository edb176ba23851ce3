"""Training data (``megatron.core.datasets``): ``--data-path``'s datasets checked before any rank starts (no torch),
written from JSONL, and each DP rank's micro-batches as ``MegatronPretrainingSampler``'s."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from lagom_megatron.training.tokenizer import ByteLevelTokenizer

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""First bytes of an indexed dataset's ``.idx``, then version 1 (``<Q``), the dtype code (``<B``), the sequence and
document counts (``<Q`` each): megatron-core 0.16.1 ``datasets/indexed_dataset.py:47, 147-151, 193-198, 264-276``."""

INDEX_DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
"""``DType`` codes of the ``.idx`` header (megatron-core 0.16.1 ``indexed_dataset.py:50-60``)."""

DATA_SCAN_BYTES = 256 << 20
"""Bytes of a ``.bin`` read for its largest token id: all of a smaller file, evenly spaced windows of a larger one."""

SCAN_WINDOWS = 64
"""Windows a ``.bin`` over DATA_SCAN_BYTES is read in (DATA_SCAN_BYTES in all)."""

_SCANNED: dict[tuple, tuple[int, int]] = {}
"""(realpath, size, mtime_ns) of a ``.bin`` -> (largest token id, bytes read): each rank checks three times."""

DATASET_HINT = "an indexed dataset PREFIX.bin + PREFIX.idx, e.g. from scripts/preprocess_data.py"


def _is_weight(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return not Path(word + ".bin").exists()


def data_path_prefixes(data_path: list[str]) -> list[str]:
    """``--data-path``'s prefixes (``P1 P2 ...`` or ``W1 P1 W2 P2 ...``, as ``get_blend_from_list`` reads them:
    megatron-core 0.16.1 ``datasets/utils.py:49-88``); ValueError: a blend whose weights and paths are not paired."""
    given = " ".join(data_path)
    weights = [i for i, word in enumerate(data_path) if _is_weight(word)]
    if not weights:
        return list(data_path)
    pairs = "a blend pairs each weight with the dataset prefix after it: --data-path W1 PREFIX1 W2 PREFIX2 ..."
    if len(data_path) % 2:
        raise ValueError(
            f"--data-path {given}: {len(data_path)} values, {len(weights)} of them weights; {pairs} "
            "(or prefixes alone, without weights)"
        )
    misplaced = [i for i in range(len(data_path)) if (i in weights) != (i % 2 == 0)]
    if misplaced:
        i = misplaced[0]
        place = "a weight's" if i % 2 == 0 else "a prefix's"
        raise ValueError(f"--data-path {given}: {data_path[i]!r} stands in {place} place; {pairs}")
    for i in weights:
        value = float(data_path[i])
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--data-path {given}: weight {data_path[i]} must be a finite number >= 0")
    if not any(float(data_path[i]) > 0 for i in weights):
        raise ValueError(f"--data-path {given}: every weight is 0; give at least one dataset a weight > 0")
    return list(data_path[1::2])


def _index_bin_bytes(idx: Path) -> tuple[int, type, int]:
    """(bytes of ``.bin`` the ``.idx`` indexes, token dtype, token count); ValueError naming the ``.idx``."""
    size = idx.stat().st_size
    with idx.open("rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != INDEX_HEADER:
        raise ValueError(f"{idx} is not an indexed-dataset index (it does not start with {INDEX_HEADER!r})")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in INDEX_DTYPES:
        raise ValueError(
            f"{idx}: index version {version}, dtype code {code}; megatron-core reads version 1, codes 1..8"
        )
    # int32 lengths, int64 pointers, int64 document indices (indexed_dataset.py:200-207, 284-310)
    need = 34 + n_seq * (4 + 8) + n_doc * 8
    if size < need:
        raise ValueError(
            f"{idx} has {size} bytes but its header announces {n_seq} sequences and {n_doc} documents "
            f"({need} bytes): truncated"
        )
    dtype = INDEX_DTYPES[code]
    if n_seq == 0:
        return 0, dtype, 0
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=34, shape=(n_seq,))
    pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=34 + 4 * n_seq, shape=(n_seq,))
    # the reader takes sequence i at pointers[i], lengths[i] tokens (indexed_dataset.py:213-230, 419)
    itemsize = np.dtype(dtype).itemsize
    return int(pointers[-1]) + int(lengths[-1]) * itemsize, dtype, int(lengths.sum(dtype=np.int64))


def largest_token_id(bin_path: Path, dtype: type) -> tuple[int, int]:
    """(largest token id, bytes read) of a ``.bin``: all of it up to DATA_SCAN_BYTES, else SCAN_WINDOWS windows."""
    stat = bin_path.stat()
    key = (os.path.realpath(bin_path), stat.st_size, stat.st_mtime_ns)
    if key not in _SCANNED:
        tokens = np.memmap(bin_path, dtype=dtype, mode="r") if stat.st_size else np.zeros(0, dtype)
        if tokens.nbytes <= DATA_SCAN_BYTES:
            windows = [tokens]
        else:
            step = len(tokens) // SCAN_WINDOWS
            width = DATA_SCAN_BYTES // SCAN_WINDOWS // tokens.itemsize
            windows = [tokens[i * step : i * step + width] for i in range(SCAN_WINDOWS)]
        highest = max((int(w.max()) for w in windows if w.size), default=-1)
        _SCANNED[key] = (highest, sum(int(w.nbytes) for w in windows))
    return _SCANNED[key]


def dataset_problem(prefix: str) -> str | None:
    """Why ``prefix`` is not an indexed dataset megatron-core can read whole, in one line naming what to give."""
    path = Path(prefix)
    if path.suffix in (".bin", ".idx") and not Path(prefix + ".bin").exists():
        stem = str(path.with_suffix(""))
        return (
            f"--data-path {prefix!r} names the dataset's {path.suffix} file; give its prefix without the suffix: "
            f"--data-path {stem}"
        )
    if path.is_dir() and not Path(prefix + ".bin").exists():  # a folder beside its PREFIX.bin is no mistake
        found = sorted(str(p.with_suffix("")) for p in path.glob("*.idx") if p.with_suffix(".bin").is_file())
        inside = f", e.g. {', '.join(found[:3])}" if found else f" ({path} holds no PREFIX.bin + PREFIX.idx pair)"
        return f"--data-path {prefix!r} is a folder; give the prefix of a dataset in it{inside}"
    bin_path, idx = Path(prefix + ".bin"), Path(prefix + ".idx")
    for file in (bin_path, idx):
        if not file.is_file():
            return f"--data-path {prefix!r}: {file} does not exist (expected {DATASET_HINT})"
        if not os.access(file, os.R_OK):
            return f"--data-path {prefix!r}: {file} is not readable"
    try:
        want, dtype, n_tokens = _index_bin_bytes(idx)
    except ValueError as exc:
        return f"--data-path {prefix!r}: {exc}"
    have = bin_path.stat().st_size
    if have != want:
        return (
            f"--data-path {prefix!r}: {bin_path} has {have} bytes but {idx} indexes {want} "
            f"({n_tokens} tokens of {np.dtype(dtype).name}): truncated, or the two files are of different "
            "datasets; copy both whole, or make them again with scripts/preprocess_data.py"
        )
    return None


def check_data_path(data_path: list[str], vocab_size: int, tokenizer: str) -> None:
    """ValueError (one line) for the first ``--data-path`` dataset megatron-core could not read whole, or whose
    token ids reach ``vocab_size`` (the embedding would index past the tokenizer's vocabulary)."""
    for prefix in data_path_prefixes(data_path):
        problem = dataset_problem(prefix)
        if problem:
            raise ValueError(problem)
        _, dtype, _ = _index_bin_bytes(Path(prefix + ".idx"))
        highest, read = largest_token_id(Path(prefix + ".bin"), dtype)
        if highest >= vocab_size:
            whole = read >= Path(prefix + ".bin").stat().st_size
            where = "" if whole else f" (in the {read >> 20} MiB of it read)"
            raise ValueError(
                f"--data-path {prefix!r}: token id {highest} in {prefix}.bin{where} but the {tokenizer} tokenizer "
                f"has {vocab_size} ids (0..{vocab_size - 1}): the dataset was tokenized with another tokenizer; "
                f"tokenize it again with scripts/preprocess_data.py, or give --tokenizer-type NullTokenizer "
                f"--vocab-size {highest + 1} (or more)"
            )


def read_jsonl_texts(path: str | Path, *, key: str = "text") -> Iterator[str]:
    """Yields the ``key`` field of each non-empty JSONL line; ValueError (file:line) on any other line or on bytes that
    are not UTF-8."""
    with open(path, encoding="utf-8") as f:
        lines = enumerate(f, 1)
        while True:
            try:
                lineno, line = next(lines)
            except StopIteration:
                return
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}: not a UTF-8 text file ({exc.reason}: byte 0x{exc.object[exc.start]:02x})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a string {key!r} field")
            yield record[key]


def write_indexed_dataset(texts: Iterable[str], output_prefix: str | Path, tokenizer=None) -> dict:
    """``PREFIX.bin`` / ``.idx`` as ``tools/preprocess_data.py --append-eod`` (uint16); ValueError without documents.
    Returns {"documents", "tokens", "bin", "idx"}."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = tokenizer or ByteLevelTokenizer()
    prefix = Path(output_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = (Path(str(prefix) + ".tmp" + suffix) for suffix in (".bin", ".idx"))
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=np.uint16)
    n_docs = n_tokens = 0
    try:
        for text in texts:
            ids = np.asarray(tokenizer.tokenize(text), dtype=np.int64)
            if ids.size == 0:
                continue
            ids = np.append(ids, tokenizer.eod)
            # an ndarray: a torch tensor triggers numpy 2's __array__(copy=...) warning in add_document
            builder.add_document(ids, [ids.size])
            n_docs += 1
            n_tokens += int(ids.size)
        if n_docs == 0:
            raise ValueError(f"no non-empty document to write to {prefix}")
        builder.finalize(str(tmp_idx))
        tmp_bin.replace(str(prefix) + ".bin")
        tmp_idx.replace(str(prefix) + ".idx")
    except BaseException:
        # any failure leaves no temporary file, and a dataset already at PREFIX as it was
        if not builder.data_file.closed:
            builder.data_file.close()
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
    return {"documents": n_docs, "tokens": n_tokens, "bin": str(prefix) + ".bin", "idx": str(prefix) + ".idx"}


def build_tokenizer(args):
    """``--tokenizer-type``'s: library ``"null"`` in megatron-core 0.16 (``tokenizers/megatron_tokenizer.py:21,72``),
    ``"null-text"`` from 0.17 (``:84``; Megatron-LM core_v0.18.2 ``tokenizers/utils/build_tokenizer.py:88-101``)."""
    if args.tokenizer_type == "NullTokenizer":
        from megatron.core.tokenizers import MegatronTokenizer, megatron_tokenizer

        library = "null" if "null" in getattr(megatron_tokenizer, "TOKENIZER_LIBRARIES", ()) else "null-text"
        return MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=args.vocab_size)
    return ByteLevelTokenizer()


def build_datasets(args, tokenizer, valid_samples: int = 0):
    """(train, valid or None) from ``BlendedMegatronDatasetBuilder``: int64 (seq,) ``tokens``/``labels``/
    ``position_ids``, float ``loss_mask``, bool ``attention_mask`` (1, seq, seq); ValueError: no training documents."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else get_blend_from_list(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
        mid_level_dataset_surplus=0.005,
    )
    n_samples = args.train_iters * args.global_batch_size
    cls = MockGPTDataset if args.mock_data else GPTDataset
    # None, not 0: GPTDataset loops forever on 0 samples (megatron-core 0.16.1, _get_num_epochs)
    sizes = [n_samples, valid_samples or None, None]
    train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    if train is None:
        raise ValueError(f"--split {args.split!r} leaves no training documents")
    return train, valid if valid_samples else None


def microbatch_indices(
    iteration: int, *, global_batch_size: int, micro_batch_size: int, data_parallel_size: int, data_parallel_rank: int
) -> list[list[int]]:
    """Sample indices of one DP rank's micro-batches: r takes [r*mbs, (r+1)*mbs) of each ``mbs x DP`` step."""
    step = micro_batch_size * data_parallel_size
    base = iteration * global_batch_size
    start = base + data_parallel_rank * micro_batch_size
    return [
        list(range(start + m * step, start + m * step + micro_batch_size)) for m in range(global_batch_size // step)
    ]


def microbatch_iterator(
    dataset,
    *,
    train_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
    data_parallel_rank: int,
) -> Iterator[dict]:
    """This rank's micro-batches of stacked tensors (``tokens`` (mbs, seq) int64, ...)."""
    import torch

    for iteration in range(train_iters):
        for indices in microbatch_indices(
            iteration,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            data_parallel_size=data_parallel_size,
            data_parallel_rank=data_parallel_rank,
        ):
            samples = [dataset[i] for i in indices]
            yield {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}
