"""JSONL (one document per line, a "text" field) -> Megatron indexed dataset PREFIX.bin / PREFIX.idx.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus_text_document

Byte-level tokenizer (UTF-8 bytes, end-of-document appended): nothing to download. The output is
read by ``pretrain_gpt.py --data-path PREFIX --tokenizer-type ByteLevel``. Bad input is reported on
one line with exit code 2 and leaves no file behind.
"""

import argparse
import os
import sys
from pathlib import Path


def check_paths(input_path: str, output_prefix: str) -> None:
    """Checks the command line's paths before anything is imported or written.

    Raises:
        ValueError: the input is a folder or missing, or the output prefix ends in a path
            separator or names an existing folder (it is a file-name prefix: PREFIX.bin, PREFIX.idx).
    """
    if not os.path.exists(input_path):
        raise ValueError(f"--input {input_path}: no such file")
    if os.path.isdir(input_path):
        raise ValueError(f"--input {input_path} is a folder; give a JSONL file")
    separators = tuple(s for s in (os.sep, os.altsep) if s)
    if not output_prefix or output_prefix.endswith(separators) or Path(output_prefix).is_dir():
        raise ValueError(
            f"--output-prefix {output_prefix!r} names a folder; give a file-name prefix such as "
            f"{os.path.join(output_prefix.rstrip(''.join(separators)) or '.', 'corpus_text_document')} "
            "(writes PREFIX.bin and PREFIX.idx)"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="field holding the document text")
    parser.add_argument("--tokenizer-type", choices=("ByteLevel",), default="ByteLevel")
    args = parser.parse_args(argv)
    try:
        check_paths(args.input, args.output_prefix)
        from lagom_megatron.preflight.files import folder_problem
        from lagom_megatron.training.data import read_jsonl_texts

        problem = folder_problem(Path(args.output_prefix).parent)
        if problem:
            raise ValueError(f"--output-prefix {args.output_prefix}: {problem}")
        # the whole input is read once before megatron-core is imported (tens of seconds and its warnings):
        # a bad line, an empty file or a binary one is named at once, not after the import
        if not sum(1 for text in read_jsonl_texts(args.input, key=args.json_key) if text):
            raise ValueError(f"--input {args.input}: no document with a non-empty {args.json_key!r} field")
        from lagom_megatron.training.data import write_indexed_dataset

        stats = write_indexed_dataset(read_jsonl_texts(args.input, key=args.json_key), args.output_prefix)
    except (ValueError, OSError) as exc:
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {stats['documents']} documents, {stats['tokens']} tokens: {stats['bin']}, {stats['idx']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
