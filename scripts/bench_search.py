"""Search benchmark: evaluations and wall time vs sites, and priority vs exhaustive optimality.

Same as ``lagom bench search``; see ``lagom_megatron/cli/bench.py`` and ``lagom_megatron/engine/bench.py``.

    python scripts/bench_search.py [--sizes 10 100 1000 10000] [--instances 200]
"""

import sys

from lagom_megatron.cli.bench import search_main

if __name__ == "__main__":
    sys.exit(search_main(sys.argv[1:]))
