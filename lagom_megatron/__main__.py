"""``python -m lagom_megatron`` is the ``lagom`` command."""

import sys

from lagom_megatron.cli.main import main

sys.exit(main())
