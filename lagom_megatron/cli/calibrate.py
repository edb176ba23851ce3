"""``lagom calibrate contention | bandwidth``: fit simulator constants on the user's own hardware (scripts/gpu/)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

from lagom_megatron.cli.options import (
    FORCE_HELP,
    readable_file,
    readable_file_or_dir,
    refuse_overwriting_an_input,
    refuse_replacing,
    writable_file,
)

CALIBRATED_MARK = "calibrated by `lagom calibrate bandwidth`"
MAX_PROBLEMS = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="KIND", required=True)
    p = sub.add_parser("contention", help="a GPU's contention constants from scripts/gpu/contention_probe.py's CSV")
    p.add_argument("csv", type=readable_file, help="the probe's CSV (scripts/gpu/contention_probe.py --out)")
    p.add_argument(
        "--out", default=None, type=writable_file, help="YAML to write (default: <csv stem>.fit.yaml beside the CSV)"
    )
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p = sub.add_parser(
        "bandwidth",
        help="per-channel bandwidth, saturation and link efficiency from nccl-tests output "
        "(scripts/gpu/nccl_sweep.sh) into a copy of a cluster file",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        type=readable_file_or_dir,
        metavar="SWEEP",
        help="nccl_sweep.sh's output folder (its *.txt files) or single run files",
    )
    p.add_argument(
        "--cluster",
        required=True,
        help="cluster name or YAML file the fit goes into (the link bandwidths the efficiencies are shares of)",
    )
    p.add_argument(
        "--out",
        default=None,
        type=writable_file,
        help="cluster YAML to write (default: <cluster name>.calibrated.yaml beside the first input)",
    )
    p.add_argument("--force", action="store_true", help=FORCE_HELP)


def run(args: argparse.Namespace) -> int:
    """Fits, writes and prints the fit; ValueError (bad input or refused output; nothing written) or OSError."""
    return _contention(args) if args.what == "contention" else _bandwidth(args)


def _contention(args: argparse.Namespace) -> int:
    from lagom_megatron.sim.calibrate import MIN_SHARE, fit, read_rows, write_yaml

    src = Path(args.csv)
    out = Path(args.out) if args.out else src.with_name(src.stem + ".fit.yaml")
    if not out.parent.is_dir():
        raise ValueError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")
    refuse_overwriting_an_input(str(out), "--out" if args.out else "output", {"csv": args.csv})
    refuse_replacing(out, "--out" if args.out else "output", "a lagom contention fit", _is_fit, force=args.force)
    fitted = fit(read_rows(src))
    if not any(fitted.rows.values()):
        raise ValueError(
            f"{src}: no usable row: each has a zero time, or a copy/reduce channel kernel whose HBM share "
            f"is below {MIN_SHARE}; nothing written"
        )
    write_yaml(fitted, out, source=src.name)
    fmt = lambda x, unit="": "no usable rows" if x is None else f"{x:.3f}{unit}"  # noqa: E731
    print(
        f"{fitted.gpu}: kappa_mem {fmt(fitted.kappa_mem)} ({fitted.rows['kappa_mem']} rows), "
        f"kappa_compute {fmt(fitted.kappa_compute)} ({fitted.rows['kappa_compute']} rows), "
        f"SM term error {fmt(fitted.sm_term_mae_pct, '%')} ({fitted.rows['sm_term']} rows)"
    )
    print(f"wrote {out}")
    return 0


def _run_files(inputs: list[str]) -> list[Path]:
    files = []
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.txt") if p.is_file())
            if not found:
                raise ValueError(
                    f"{text}: no *.txt run files in this folder (scripts/gpu/nccl_sweep.sh writes one per run)"
                )
            files += found
        else:
            files.append(path)
    return files


def _bandwidth(args: argparse.Namespace) -> int:
    import yaml

    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.engine.files import write_text_atomic
    from lagom_megatron.nccl.perf_table import PerfFormatError, read_perf_run
    from lagom_megatron.sim.calibrate import calibrated_cluster, fit_bandwidth, fit_to_cluster_fields, summary_lines

    spec = ClusterSpec.load(args.cluster)
    if spec.backend != "nccl":  # as simulate and bench: NCCL bandwidth fits mean nothing to gloo
        from lagom_megatron.sim.backend import gpu_clusters

        raise ValueError(
            f"--cluster {args.cluster}: {spec.name!r} is a {spec.backend} cluster; NCCL bandwidths are fitted into "
            f"a GPU cluster (nccl): one of {gpu_clusters()} or a GPU cluster YAML"
        )
    files = _run_files(args.inputs)
    first = Path(args.inputs[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / f"{spec.name}.calibrated.yaml"
    inputs = {"--cluster": args.cluster if Path(args.cluster).is_file() else None}
    inputs.update({f"input {p}": str(p) for p in files})
    refuse_overwriting_an_input(str(out), "--out", inputs)
    refuse_replacing(
        out,
        "--out" if args.out else "output",
        "a cluster file lagom calibrate bandwidth wrote",
        lambda text: CALIBRATED_MARK in text.split("\n", 1)[0],
        force=args.force,
    )
    runs, problems = [], []
    for path in files:
        try:
            runs.append(read_perf_run(path))
        except PerfFormatError as exc:
            problems += exc.problems
    if problems:
        more = f"; and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        raise ValueError(
            f"{len(problems)} problem(s) in the nccl-tests output, nothing written: "
            + "; ".join(problems[:MAX_PROBLEMS])
            + more
        )
    fit = fit_bandwidth(runs, spec)
    fields = fit_to_cluster_fields(fit)
    if not fields:
        raise ValueError(f"the {len(runs)} run(s) identify no cluster key, nothing written: " + "; ".join(fit.notes))
    base = {k: v for k, v in spec.to_dict().items() if v is not None}
    doc = calibrated_cluster(base, fit, name=out.stem, source=str(out))
    summary = summary_lines(fit)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    header = [
        f"# {spec.name} {CALIBRATED_MARK} at {stamp} from {len(runs)} nccl-tests run(s)",
        f"# in {', '.join(sorted({str(p.parent) for p in files}))}; fitted keys: {', '.join(fields)}.",
        "# Every other key is the cluster file's. The fit:",
    ] + [f"#   {line}" for line in summary]
    write_text_atomic(out, "\n".join(header) + "\n" + yaml.safe_dump(doc, sort_keys=False))
    print("\n".join(summary))
    print(f"wrote {out} ({', '.join(f'{k}' for k in fields)})")
    return 0


def _is_fit(text: str) -> bool:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return isinstance(data, dict) and {"fitted_at", "source_csv"} <= set(data)
