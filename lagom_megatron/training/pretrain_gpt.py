"""``pretrain_gpt.py``: pre-train a GPT with Megatron-Core, optionally tuned by lagom; docs/training.md.

    torchrun --standalone --nproc-per-node 4 -m lagom_megatron.training.pretrain_gpt --preset cpu-tp2-dp2 --lagom
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from lagom_megatron.megatron.hooks.versions import UntestedVersionError, check_versions
from lagom_megatron.training.argument_checks import validate_args
from lagom_megatron.training.arguments import parse_args
from lagom_megatron.preflight.check import pretrain_preflight


def _single_process_env() -> None:
    """Lets ``python scripts/pretrain_gpt.py ...`` run as one process, as torchrun would start it."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:  # a free port on loopback for the rendezvous of one process
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _program() -> str:
    """How this process was started, for a hint: the checkout's ``scripts/pretrain_gpt.py``, else the module."""
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if started is not None and started.name == "pretrain_gpt.py" and started.parent.name == "scripts":
        return "scripts/pretrain_gpt.py"
    return "-m lagom_megatron.training.pretrain_gpt"


def _launch_hint(args) -> str:
    """The torchrun command line to suggest when a plain ``python`` run needs more processes."""
    n = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if args.preset:  # the preset's world size, unless flags changed the layout so it no longer fits
        from lagom_megatron.config.presets import load_preset

        world_size = load_preset(args.preset).world_size
        n = world_size if world_size % n == 0 else n
    return f"; launch {n} processes with: torchrun --standalone --nproc-per-node {n} {_program()} ..."


REFUSAL_GRACE_S = 120.0
"""Seconds a rank other than 0 waits before exiting on a refused input, so that rank 0's error line comes first
(torchrun stops every rank when one exits non-zero; rank 0 may be much later on a busy machine)."""


def _refused(code: int, rank0: bool) -> int:
    """Exit status ``code`` of a refused input, after ``REFUSAL_GRACE_S`` on ranks other than 0."""
    if not rank0:
        import time

        time.sleep(REFUSAL_GRACE_S)
    return code


def main(argv: list[str] | None = None) -> int:
    """Parses, checks and trains as one rank of a torchrun job: 0 trained, 2 refused input, 130 Ctrl-C."""
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        if rank0:  # argparse prints usage and the error, and exits 2
            args = parse_args(argv)
        else:  # the same check, silent: one copy of the usage error, not one per rank
            with contextlib.redirect_stdout(io.StringIO()):  # --help, printed by rank 0 only
                args = parse_args(argv, exit_on_error=False)
        for warning in check_versions(allow_untested=args.lagom_allow_untested_versions):
            if rank0:
                print(f"pretrain_gpt.py: warning: {warning}", file=sys.stderr, flush=True)
    except (ValueError, FileNotFoundError, UntestedVersionError) as exc:
        if rank0:  # one copy of the error, not one per rank
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return _refused(2, rank0)

    def hint(message: str) -> str:
        if "WORLD_SIZE" not in os.environ and message.startswith("pretrain_gpt.py: error: world size 1 is not divisible"):
            return message + _launch_hint(args)
        return message

    # the pre-flight lagom doctor shares: every check before any process group exists
    code = pretrain_preflight(args, log=lambda line: print(hint(line), file=sys.stderr, flush=True))
    if code:
        return _refused(code, rank0)
    args = validate_args(args, int(os.environ.get("WORLD_SIZE", "1")))  # fills Megatron-LM's derived defaults
    _single_process_env()
    from lagom_megatron.training.loop import pretrain

    try:
        pretrain(args)
    except KeyboardInterrupt:  # Ctrl-C: torchrun passes SIGINT to every rank; one line, not a traceback per rank
        if rank0:  # lagom's report of the interrupted run is written by then (training.loop closes its callbacks)
            print("pretrain_gpt.py: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
