"""Tokenizers that need no download, and Megatron-LM's vocabulary padding.

``ByteLevelTokenizer`` maps UTF-8 bytes to ids 0-255 and adds one end-of-document id (256); it
is what ``scripts/preprocess_data.py`` writes and what ``--tokenizer-type ByteLevel`` reads. It
has the attributes Megatron-Core's ``GPTDataset`` reads from a tokenizer (``vocab_size``, ``eod``,
``pad``, ``unique_identifiers``), so it can be handed to ``GPTDatasetConfig`` directly.
:func:`resolve_vocab` pads every accepted tokenizer's vocabulary as Megatron-LM does; the padded
size it returns is the one the model, the plan fingerprint and the log line use. This module
imports neither torch nor Megatron.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from lagom_megatron.megatron.versions import installed_megatron_core, release

BYTE_VOCAB_SIZE = 257
"""Ids of the byte-level tokenizer: 256 byte values + end-of-document."""


class ByteLevelTokenizer:
    """UTF-8 bytes as token ids (0-255), end-of-document = 256, no download and no merges.

    The pad id is the end-of-document id, as Megatron-LM's GPT2 tokenizer does; the loss mask of
    ``GPTDataset`` does not depend on it for packed pre-training sequences.
    """

    def __init__(self) -> None:
        self.vocab_size = BYTE_VOCAB_SIZE
        self.eod = BYTE_VOCAB_SIZE - 1
        self.pad = self.eod
        self.unique_identifiers = OrderedDict(cls=type(self).__name__, vocab_size=BYTE_VOCAB_SIZE)

    def tokenize(self, text: str) -> np.ndarray:
        """Encodes text as its UTF-8 bytes.

        Returns:
            int32 array of shape (n_bytes,) with values in [0, 255].
        """
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def detokenize(self, ids) -> str:
        """Decodes ids back to text; the end-of-document id becomes a newline, others above 255
        (padding of the vocabulary) are dropped; invalid UTF-8 is replaced."""
        data = bytes(10 if int(i) == self.eod else int(i) for i in ids if 0 <= int(i) <= self.eod)
        return data.decode("utf-8", errors="replace")


def padded_vocab_size(orig_vocab_size: int, *, divisible_by: int = 128, tensor_model_parallel_size: int = 1) -> int:
    """Pads a vocabulary to a multiple of ``divisible_by x TP`` (Megatron-LM's
    ``_vocab_size_with_padding`` / ``--make-vocab-size-divisible-by``) so that every
    tensor-parallel shard of the embedding has the same, aligned size.

    Args:
        orig_vocab_size: the tokenizer's number of ids.
        divisible_by: ``--make-vocab-size-divisible-by`` (128 in Megatron-LM).
        tensor_model_parallel_size: TP size.

    Returns:
        The smallest multiple of ``divisible_by * tensor_model_parallel_size`` >= orig_vocab_size.

    Raises:
        ValueError: a non-positive argument.
    """
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
    """How many ids Megatron's ``NullTokenizer(vocab_size)`` has: what Megatron-LM pads.

    Megatron-LM pads ``tokenizer.vocab_size``, not ``--vocab-size`` (Megatron-LM core_v0.16.1
    ``megatron/training/tokenizer/tokenizer.py:112``; core_v0.18.2
    ``megatron/core/tokenizers/utils/build_tokenizer.py:143``). For the null tokenizer that is:

    - megatron-core before 0.18: ``vocab_size + 1``, the end-of-document id being ``vocab_size``
      (Megatron-LM core_v0.16.1 ``tokenizer.py:817,834-835``; megatron-core 0.16.1 / 0.17.1
      ``tokenizers/text/libraries/null_tokenizer.py:17,50-52``);
    - megatron-core 0.18 and later: ``vocab_size``, the end-of-document id being ``vocab_size - 1``
      (megatron-core 0.18.2 / 0.19.0 ``tokenizers/text/libraries/null_tokenizer.py:19,60-62``).

    Args:
        vocab_size: ``--vocab-size``.
        megatron_core_version: the imported megatron-core's version (``"0.16.1"``); None when it is
            not importable, which is read as the newest behaviour.

    Returns:
        The tokenizer's number of ids, before padding.
    """
    if megatron_core_version is not None and release(megatron_core_version)[:2] < NULL_TOKENIZER_EOD_INSIDE:
        return vocab_size + 1
    return vocab_size


def resolve_vocab(args) -> tuple[int, int]:
    """The tokenizer's vocabulary size and the model's padded one for parsed arguments.

    ``--vocab-size`` means, as in Megatron-LM, the ``NullTokenizer``'s argument; the tokenizer's
    ids (:func:`null_tokenizer_vocab_size`: one more for its end-of-document id before
    megatron-core 0.18) are then padded, as Megatron-LM pads them. The byte-level tokenizer has a fixed size (257), so there ``--vocab-size``
    (as a preset's ``model.vocab_size``) is the padded size itself; keeping it fixed keeps the
    model identical across tensor-parallel sizes.

    Returns:
        (tokenizer vocab size, padded vocab size).

    Raises:
        ValueError: a padded size smaller than the tokenizer's or not divisible by TP.
    """
    tp = args.tensor_model_parallel_size
    if args.tokenizer_type == "NullTokenizer":
        found = installed_megatron_core()
        orig = null_tokenizer_vocab_size(args.vocab_size, None if found is None else found.version)
        return orig, padded_vocab_size(orig, divisible_by=args.make_vocab_size_divisible_by,
                                       tensor_model_parallel_size=tp)
    orig = BYTE_VOCAB_SIZE
    if args.vocab_size is None:
        return orig, padded_vocab_size(orig, divisible_by=args.make_vocab_size_divisible_by,
                                       tensor_model_parallel_size=tp)
    if args.vocab_size < orig or args.vocab_size % tp:
        raise ValueError(
            f"--vocab-size {args.vocab_size} must be >= {orig} (the ByteLevel tokenizer's ids) and divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    return orig, args.vocab_size
