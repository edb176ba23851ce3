"""Pre-train a GPT with Megatron-Core, optionally tuned by lagom (``--lagom``).

    torchrun --standalone --nproc-per-node 4 scripts/pretrain_gpt.py --preset cpu-tp2-dp2 --lagom

The program is ``lagom_megatron.training.pretrain_gpt``, which an installed package starts without
this checkout (``torchrun ... -m lagom_megatron.training.pretrain_gpt ...``); this file runs it
from the source tree. See docs/training.md.
"""

import sys

from lagom_megatron.training.pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
