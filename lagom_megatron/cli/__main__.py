"""``python -m lagom_megatron.cli`` is the ``lagom`` command (the SLURM scripts' form)."""

import sys

from lagom_megatron.cli.main import main

sys.exit(main())
