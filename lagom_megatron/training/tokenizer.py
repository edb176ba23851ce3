"""Tokenizers that need no download and Megatron-LM's vocabulary padding; no torch, no Megatron."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from lagom_megatron.megatron.hooks.versions import installed_megatron_core, release

BYTE_VOCAB_SIZE = 257
"""Ids of the byte-level tokenizer: 256 byte values + end-of-document."""


class ByteLevelTokenizer:
    """UTF-8 bytes as token ids (0-255), end-of-document = pad = 256."""

    def __init__(self) -> None:
        self.vocab_size = BYTE_VOCAB_SIZE
        self.eod = BYTE_VOCAB_SIZE - 1
        self.pad = self.eod
        self.unique_identifiers = OrderedDict(cls=type(self).__name__, vocab_size=BYTE_VOCAB_SIZE)

    def tokenize(self, text: str) -> np.ndarray:
        """Encodes text as its UTF-8 bytes: int32, shape (n_bytes,), values in [0, 255]."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def detokenize(self, ids) -> str:
        """End-of-document -> newline, padding dropped, invalid UTF-8 replaced."""
        data = bytes(10 if int(i) == self.eod else int(i) for i in ids if 0 <= int(i) <= self.eod)
        return data.decode("utf-8", errors="replace")


def padded_vocab_size(orig_vocab_size: int, *, divisible_by: int = 128, tensor_model_parallel_size: int = 1) -> int:
    """Smallest multiple of ``divisible_by x TP`` >= orig_vocab_size (``_vocab_size_with_padding``); ValueError <= 0."""
    if orig_vocab_size < 1 or divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"vocabulary padding needs positive sizes; got vocab {orig_vocab_size}, divisible_by "
            f"{divisible_by}, TP {tensor_model_parallel_size}"
        )
    multiple = divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


NULL_TOKENIZER_EOD_INSIDE = (0, 18)
"""megatron-core release from which ``NullTokenizer(N)`` has N ids with end-of-document N - 1."""


def null_tokenizer_vocab_size(vocab_size: int, megatron_core_version: str | None) -> int:
    """Ids of ``NullTokenizer(vocab_size)`` (padded: core_v0.16.1 ``tokenizer.py:112``, core_v0.18.2
    ``core/tokenizers/utils/build_tokenizer.py:143``): vocab_size + 1 before megatron-core 0.18
    (``tokenizer.py:817,834-835``; mcore 0.16.1/0.17.1 ``tokenizers/text/libraries/null_tokenizer.py:17,50-52``),
    vocab_size from 0.18 (mcore 0.18.2/0.19.0 ``null_tokenizer.py:19,60-62``) and for a None version."""
    if megatron_core_version is not None and release(megatron_core_version)[:2] < NULL_TOKENIZER_EOD_INSIDE:
        return vocab_size + 1
    return vocab_size


def resolve_vocab(args) -> tuple[int, int]:
    """(tokenizer, padded) vocab sizes (``--vocab-size``: NullTokenizer's N, ByteLevel's padded); ValueError if bad."""
    tp = args.tensor_model_parallel_size
    if args.tokenizer_type == "NullTokenizer":
        found = installed_megatron_core()
        orig = null_tokenizer_vocab_size(args.vocab_size, None if found is None else found.version)
        return orig, padded_vocab_size(
            orig, divisible_by=args.make_vocab_size_divisible_by, tensor_model_parallel_size=tp
        )
    orig = BYTE_VOCAB_SIZE
    if args.vocab_size is None:
        return orig, padded_vocab_size(
            orig, divisible_by=args.make_vocab_size_divisible_by, tensor_model_parallel_size=tp
        )
    if args.vocab_size < orig or args.vocab_size % tp:
        raise ValueError(
            f"--vocab-size {args.vocab_size} must be >= {orig} (the ByteLevel tokenizer's ids) and divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    return orig, args.vocab_size
