"""``scripts/gpu/nccl_sweep.sh`` on CPU: its usage and checks, the commands of a dry run, and the
sweep -> ``lagom calibrate bandwidth`` chain with stand-in ``*_perf`` binaries
(``tests/nccl/perf_standin.py``, called with nccl-tests' flags and NCCL's variables) that print
nccl-tests-format output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.engine.cluster import ClusterSpec
from tests.nccl.perf_text import Truth
from tests.timeouts import COMMAND_S

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu" / "nccl_sweep.sh"
STANDIN = REPO / "tests" / "nccl" / "perf_standin.py"
OPS = ("all_gather", "reduce_scatter", "all_reduce", "alltoall", "sendrecv")


def sweep(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=COMMAND_S, env=env)


def standin_binaries(folder: Path, failing: str | None = None) -> Path:
    """One ``<op>_perf`` per op that runs the stand-in under its own name (``failing`` exits 1)."""
    folder.mkdir()
    for op in OPS:
        body = (
            "echo \"Test NCCL failure common.cu:1000 'unhandled cuda error'\"; exit 1"
            if op == failing
            else f'exec "{sys.executable}" "{STANDIN}" --as "$(basename "$0")" "$@"'
        )
        path = folder / f"{op}_perf"
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return folder


def test_help_and_bad_usage(tmp_path):
    r = sweep("--help")
    assert r.returncode == 0 and "scripts/gpu/nccl_sweep.sh [options] OUT_DIR" in r.stdout and "--dry-run" in r.stdout
    for args, message in [
        (["--channels", "1,65", "o"], "--channels: 65 is not an integer in 1..64"),
        (["--threads", "100", "o"], "--threads: 100 is not a multiple of 32 in 64..512"),
        (["--protocols", "Simple,LL64", "o"], "--protocols: LL64 is not one of LL, LL128, Simple"),
        (["--ops", "broadcast", "o"], "--ops: broadcast is not one of"),
        (["-b", "1X", "o"], "-b: 1X is not a size"),
        (["--bogus", "o"], "unknown option --bogus"),
        ([], "give OUT_DIR"),
        (
            ["--tests-dir", str(tmp_path / "none"), str(tmp_path / "out")],
            f"{tmp_path / 'none'}/all_gather_perf: missing",
        ),
    ]:
        r = sweep(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)
    assert not (tmp_path / "out").exists()


def test_a_dry_run_prints_every_command_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = sweep(
        "--dry-run",
        str(out),
        "--ops",
        "all_gather,sendrecv",
        "--channels",
        "2,8",
        "--threads",
        "256",
        "--protocols",
        "LL128,Simple",
        "--launcher",
        "mpirun -np 16 -N 8",
        "--nodes",
        "2",
        "-e",
        "64M",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "# dry run: 6 runs, nothing run or written" and not out.exists()
    simple = next(line for line in lines if line.endswith(f"{out}/all_gather.Simple.c8.t256.txt"))
    for part in (
        "NCCL_MIN_NCHANNELS=8",
        "NCCL_MAX_NCHANNELS=8",
        "NCCL_MIN_CTAS=8",
        "NCCL_MAX_CTAS=8",
        "NCCL_ALGO=Ring",
        "NCCL_PROTO=Simple",
        "NCCL_NTHREADS=256",
        "NCCL_DEBUG=INFO",
        "NCCL_DEBUG_SUBSYS=INIT,ENV",
        "mpirun -np 16 -N 8 -x NCCL_DEBUG -x NCCL_DEBUG_SUBSYS",
        "-x NCCL_NTHREADS",
        "./build/all_gather_perf -b 1M -e 64M -f 2 -g 1 -n 20 -w 5 -c 1",
    ):
        assert part in simple, part
    ll128 = next(line for line in lines if line.endswith("all_gather.LL128.c2.t640.txt"))
    assert "NCCL_PROTO=LL128" in ll128 and "NCCL_NTHREADS" not in ll128  # LL128 reads NCCL_LL128_NTHREADS
    p2p = next(line for line in lines if line.endswith("sendrecv.P2P.c2.t640.txt"))
    assert "NCCL_MAX_NCHANNELS=2" in p2p and not any(v in p2p for v in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NTHREADS"))


def test_the_sweep_output_is_what_lagom_calibrate_bandwidth_reads(tmp_path, capsys):
    build, out = standin_binaries(tmp_path / "build"), tmp_path / "sweep"
    r = sweep(
        str(out),
        "--tests-dir",
        str(build),
        "--ops",
        "all_gather,sendrecv",
        "--channels",
        "1,2,4,8,16",
        "--threads",
        "128,512",
        "--protocols",
        "LL128,Simple",
        "-e",
        "256M",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "20 runs, 0 failed; next: lagom calibrate bandwidth" in r.stdout
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 20 and "all_gather.Simple.c16.t128.txt" in files and "sendrecv.P2P.c4.t640.txt" in files
    first = (out / "all_gather.Simple.c4.t128.txt").read_text().splitlines()
    assert first[0] == "# lagom-sweep op=all_gather algorithm=Ring protocol=Simple channels=4 threads=128 nodes=1"
    assert first[1].startswith("# command: env NCCL_DEBUG=INFO")
    assert main(["calibrate", "bandwidth", str(out), "--cluster", "a40-pcie-ib100"]) == 0
    spec = ClusterSpec.load(out / "a40-pcie-ib100.calibrated.yaml")
    truth = Truth()  # what the stand-in measured with
    assert spec.per_channel_gbps == pytest.approx({k: truth.per_channel[k] for k in ("LL128", "Simple")}, rel=0.01)
    assert spec.link_eff == pytest.approx({k: truth.ceiling[k] / 24.0 for k in ("LL128", "Simple")}, rel=0.01)
    assert spec.bw_saturation_p == pytest.approx(truth.p, rel=0.03)
    assert spec.channel_thread_exponent == pytest.approx(truth.e, abs=0.01)
    assert re.search(r"intra P2P: (5\.99|6|6\.01) GB/s per channel", capsys.readouterr().out)  # reported, not a key


def test_a_failed_run_is_kept_apart_and_an_old_sweep_is_not_replaced(tmp_path):
    build, out = standin_binaries(tmp_path / "build", failing="sendrecv"), tmp_path / "sweep"
    args = [
        str(out),
        "--tests-dir",
        str(build),
        "--ops",
        "all_gather,sendrecv",
        "--channels",
        "2,4",
        "--threads",
        "512",
        "--protocols",
        "Simple",
        "-e",
        "16M",
    ]
    r = sweep(*args)
    assert r.returncode == 1 and "4 runs, 2 failed" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "all_gather.Simple.c2.t512.txt",
        "all_gather.Simple.c4.t512.txt",
        "sendrecv.P2P.c2.t640.failed",
        "sendrecv.P2P.c4.t640.failed",
    ]
    assert "Test NCCL failure" in (out / "sendrecv.P2P.c2.t640.failed").read_text()
    r = sweep(*args)
    assert r.returncode == 2 and f"OUT_DIR {out} already holds all_gather.Simple.c2.t512.txt," in r.stderr
    assert "or --overwrite to replace an earlier sweep's run files" in r.stderr
    assert sweep(*args, "--overwrite").returncode == 1
    # a user's file in the folder: refused with --overwrite too, the file kept byte for byte
    (out / "notes.txt").write_bytes(b"my notes\n\x00\xff")
    r = sweep(*args, "--overwrite")
    assert r.returncode == 2 and f"OUT_DIR {out} already holds notes.txt: give a new or empty folder" in r.stderr
    assert (out / "notes.txt").read_bytes() == b"my notes\n\x00\xff"
