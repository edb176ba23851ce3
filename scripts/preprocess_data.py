"""JSONL (one document per line, a "text" field) -> Megatron indexed dataset PREFIX.bin / PREFIX.idx.

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus_text_document

Byte-level tokenizer (UTF-8 bytes, end-of-document appended): nothing to download. The output is
read by ``pretrain_gpt.py --data-path PREFIX --tokenizer-type ByteLevel``.
"""

import argparse
import sys

from lagom_megatron.integration.data import read_jsonl_texts, write_indexed_dataset


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--json-key", default="text", help="field holding the document text")
    parser.add_argument("--tokenizer-type", choices=("ByteLevel",), default="ByteLevel")
    args = parser.parse_args(argv)
    try:
        stats = write_indexed_dataset(read_jsonl_texts(args.input, key=args.json_key), args.output_prefix)
    except (ValueError, FileNotFoundError) as exc:
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {stats['documents']} documents, {stats['tokens']} tokens: {stats['bin']}, {stats['idx']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
