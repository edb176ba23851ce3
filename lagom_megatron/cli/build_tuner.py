"""``lagom build-tuner``: compile the NCCL tuner plugin and print how to use it."""

from __future__ import annotations

import argparse

from lagom_megatron.cli.options import writable_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--out-dir",
        default="build",
        type=writable_dir,
        help="directory for libnccl-tuner-lagom.so (default: ./build)",
    )
    parser.add_argument("--cc", default=None, help="C compiler (default: $CC or gcc)")


def run(args: argparse.Namespace) -> int:
    """Builds the plugin, prints its path and NCCL's env; 1 on a compiler error, FileNotFoundError without one."""
    import sys

    from lagom_megatron.nccl.plugin.build import build_tuner, usage_line

    try:
        lib = build_tuner(args.out_dir, cc=args.cc)
    except RuntimeError as exc:
        print(f"lagom build-tuner: error: {exc}", file=sys.stderr)
        return 1
    print(lib)
    print(usage_line(lib))
    return 0
