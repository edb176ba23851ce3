#!/usr/bin/env python
"""The simulated-cluster comparison table (same as ``lagom bench simulated``):

    .venv/bin/python scripts/bench_simulated.py [--out bench_out] [--presets ...] [--clusters h100-sxm-ib400 a100-ib100]

Writes bench_out/simulated.csv and bench_out/simulated.png. All numbers are simulated.
"""

import sys

from lagom_megatron.cli.bench import simulated_main

if __name__ == "__main__":
    sys.exit(simulated_main(sys.argv[1:]))
