"""Pre-train a GPT with Megatron-Core, optionally tuned by lagom (``--lagom``).

    torchrun --standalone --nproc-per-node 4 scripts/pretrain_gpt.py --preset cpu-tp2-dp2 --lagom

Takes Megatron-LM's flags (``--tensor-model-parallel-size``, ``--overlap-grad-reduce``, ...) plus
``--preset NAME|PATH`` and the ``--lagom*`` flags; see docs/training.md. Bad input is reported
on one line with exit code 2, before any process group is created.
"""

import os
import sys

from lagom_megatron.integration.arguments import parse_args, validate_args


def main(argv=None) -> int:
    try:
        args = validate_args(parse_args(argv), int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.lagom:  # lagom doctor before any process group exists; exits 1 on errors
        from lagom_megatron.doctor import preflight_pretrain

        preflight_pretrain(args)
    from lagom_megatron.integration.training import pretrain

    pretrain(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
