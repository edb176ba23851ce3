"""``lagom calibrate contention CSV [--out FILE]``: fits a GPU's contention constants from the CSV of
``scripts/gpu/contention_probe.py`` (``lagom_megatron.sim.calibrate``) and writes them as YAML.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lagom_megatron.cli.options import readable_file, writable_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["contention"], help="what to calibrate")
    parser.add_argument("csv", type=readable_file, help="the probe's CSV (scripts/gpu/contention_probe.py --out)")
    parser.add_argument("--out", default=None, type=writable_file, help="YAML to write (default: <csv stem>.fit.yaml beside the CSV)")


def run(args: argparse.Namespace) -> int:
    """Fits and writes; prints the constants.

    Raises:
        ValueError: a bad CSV (``sim.calibrate.read_rows``), or one with no usable row (no YAML
            is written then).
        OSError: a path that cannot be read or written.
    """
    from lagom_megatron.sim.calibrate import MIN_SHARE, fit, read_rows, write_yaml

    src = Path(args.csv)
    out = Path(args.out) if args.out else src.with_name(src.stem + ".fit.yaml")
    if not out.parent.is_dir():
        raise ValueError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")
    fitted = fit(read_rows(src))
    if not any(fitted.rows.values()):
        raise ValueError(f"{src}: no usable row: each has a zero time, or a copy/reduce channel kernel whose HBM share "
                         f"is below {MIN_SHARE}; nothing written")
    write_yaml(fitted, out, source=src.name)
    fmt = lambda x, unit="": "no usable rows" if x is None else f"{x:.3f}{unit}"  # noqa: E731
    print(f"{fitted.gpu}: kappa_mem {fmt(fitted.kappa_mem)} ({fitted.rows['kappa_mem']} rows), "
          f"kappa_compute {fmt(fitted.kappa_compute)} ({fitted.rows['kappa_compute']} rows), "
          f"SM term error {fmt(fitted.sm_term_mae_pct, '%')} ({fitted.rows['sm_term']} rows)")
    print(f"wrote {out}")
    return 0
