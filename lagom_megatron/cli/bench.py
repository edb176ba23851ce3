"""``lagom bench search`` and ``lagom bench simulated``: the benchmarks that print the figures the
design asks for (search scaling and optimality; the simulated-cluster comparison table)."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "search": ("lagom_megatron.engine.bench", "search time and evaluations vs sites; priority vs exhaustive"),
    "simulated": ("lagom_megatron.sim.bench", "iteration time under each method on simulated GPU clusters"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), help="which benchmark to run")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    return int(module.main(args.bench_args) or 0)
