"""Builds a small real English corpus without downloads: the docstrings of Python's standard library.

    python scripts/make_sample_corpus.py --output-dir data

Reads the standard library's source files in sorted order and parses them with ``ast`` (nothing
is imported or executed), keeps every module, class and function docstring of at least
``--min-chars`` characters as one document, and writes ``sample_corpus.jsonl`` ({"text": ...} per
line) and the byte-level indexed dataset ``sample_text_document.bin/.idx`` (through
scripts/preprocess_data.py's code). Same Python version -> same corpus, byte for byte.
"""

import ast
import json
import os
import sys
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_docstrings(min_chars: int, max_bytes: int):
    """Yields cleaned docstrings of the standard library in a fixed order, up to max_bytes in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if not doc or len(doc) < min_chars or not doc.isascii():
                continue
            yield doc
            total += len(doc) + 1
            if total >= max_bytes:
                return


def main(argv=None) -> int:
    from lagom_megatron.cli.main import LagomParser  # one-line usage errors; no torch or Megatron behind them
    from lagom_megatron.cli.options import writable_dir

    parser = LagomParser(prog="make_sample_corpus.py", description=__doc__.splitlines()[0])
    # checked first: a folder that cannot be written is one line, before the minutes of reading
    parser.add_argument(
        "--output-dir",
        type=writable_dir,
        default="data",
        help="folder of the corpus files (created if missing; must be writable)",
    )
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="stop after this much text")
    parser.add_argument("--min-chars", type=int, default=80, help="shortest docstring kept")
    args = parser.parse_args(argv)
    if args.max_bytes <= 0:
        parser.error(f"--max-bytes must be a positive integer; got {args.max_bytes}")
    out = Path(args.output_dir)
    docs = list(stdlib_docstrings(args.min_chars, args.max_bytes))
    if not docs:  # checked before the folder is created, so a failed run leaves nothing behind
        print(
            f"make_sample_corpus.py: error: no docstring of at least --min-chars {args.min_chars} characters "
            "found in the standard library",
            file=sys.stderr,
        )
        return 2
    # Imported here: Megatron-Core's import warnings are not wanted for --help or a bad argument.
    from lagom_megatron.training.data import write_indexed_dataset

    jsonl = out / "sample_corpus.jsonl"
    tmp = jsonl.with_suffix(".jsonl.tmp")
    try:  # a failure later (a full disk) names the file the user asked for, not the temporary one
        out.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
        os.replace(tmp, jsonl)
        stats = write_indexed_dataset(docs, out / "sample_text_document")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(
            f"make_sample_corpus.py: error: cannot write the corpus in --output-dir {out}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    print(
        f"sample corpus: {stats['documents']} documents, {stats['tokens']} byte tokens -> {jsonl}, "
        f"{out / 'sample_text_document'}.bin/.idx"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
