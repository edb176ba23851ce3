"""Training data (``megatron.core.datasets``) and each DP rank's micro-batches as ``MegatronPretrainingSampler``'s."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from lagom_megatron.training.tokenizer import ByteLevelTokenizer


def read_jsonl_texts(path: str | Path, *, key: str = "text") -> Iterator[str]:
    """Yields the ``key`` field of each non-empty JSONL line; ValueError (file:line) on any other line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
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
