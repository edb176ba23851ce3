"""Pre-train a GPT with Megatron-Core, optionally tuned by lagom (``--lagom``).

    torchrun --standalone --nproc-per-node 4 scripts/pretrain_gpt.py --preset cpu-tp2-dp2 --lagom

Takes Megatron-LM's flags (``--tensor-model-parallel-size``, ``--overlap-grad-reduce``, ...) plus
``--preset NAME|PATH`` and the ``--lagom*`` flags; see docs/training.md. Bad input is reported
on one line with exit code 2, before any process group is created.
"""

import os
import sys

from lagom_megatron.integration.arguments import check_installed, parse_args, validate_args


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


def main(argv=None) -> int:
    try:
        args = validate_args(parse_args(argv), int(os.environ.get("WORLD_SIZE", "1")))
        check_installed(args)
    except (ValueError, FileNotFoundError) as exc:
        if os.environ.get("RANK", "0") == "0":  # one copy of the error, not one per rank
            print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    _single_process_env()
    if args.lagom:  # lagom doctor before any process group exists; exits 1 on errors
        from lagom_megatron.doctor import preflight_pretrain

        preflight_pretrain(args)
    from lagom_megatron.integration.training import pretrain

    pretrain(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
