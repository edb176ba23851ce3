"""``lagom calibrate bandwidth`` on nccl-tests-format output: a good sweep folder becomes a
cluster file that loads with the fitted keys; malformed or useless input stops with exit 2 and
one error line naming ``file:line``, and nothing is written or replaced."""

from __future__ import annotations

import os

import pytest
import yaml

from lagom_megatron.cli.main import main
from lagom_megatron.engine.cluster import ClusterSpec
from tests.nccl.perf_text import Truth, run_text, sizes

TRUTH = Truth(
    per_channel={"LL": 2.0, "LL128": 3.0, "Simple": 4.8, "P2P": 5.0},
    ceiling={"LL": 8.0, "LL128": 15.0, "Simple": 18.0, "P2P": 19.0},
    p=4.0,
    e=0.7,
    latency_us=20.0,
)


def _sweep(folder, *, ops=("all_gather", "reduce_scatter"), channels=(1, 2, 4, 8, 16), threads=(128, 512)):
    folder.mkdir(parents=True, exist_ok=True)
    for op in ops:
        for ch in channels:
            for th in threads:
                line = f"# lagom-sweep op={op} algorithm=Ring protocol=Simple channels={ch} threads={th} nodes=1"
                (folder / f"{op}.Simple.c{ch}.t{th}.txt").write_text(
                    run_text(
                        op=op,
                        sizes=sizes(),
                        busbw=TRUTH.busbw("Simple", ch, th),
                        ranks=8,
                        hosts=["n"],
                        latency_us=TRUTH.latency_us,
                        sweep_line=line,
                    )
                )
    return folder


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_a_sweep_folder_becomes_a_cluster_file(tmp_path, capsys):
    sweep = _sweep(tmp_path / "sweep")
    assert main(["calibrate", "bandwidth", str(sweep), "--cluster", "a40-pcie-ib100"]) == 0
    out = sweep / "a40-pcie-ib100.calibrated.yaml"
    spec = ClusterSpec.load(out)
    assert spec.per_channel_gbps["Simple"] == pytest.approx(4.8, rel=0.01)
    assert spec.link_eff["Simple"] * spec.nvlink_gbps_per_gpu == pytest.approx(18.0, rel=0.01)
    assert spec.bw_saturation_p == pytest.approx(4.0, rel=0.05)
    assert spec.channel_thread_exponent == pytest.approx(0.7, abs=0.02)
    assert (spec.name, spec.gpu, spec.hbm_gbps) == (
        "a40-pcie-ib100.calibrated",
        "A40-PCIe-48GB",
        696,
    )  # the rest is kept
    text = out.read_text()
    assert (
        text.startswith("# a40-pcie-ib100 calibrated by `lagom calibrate bandwidth`")
        and "from 20 nccl-tests run(s)" in text
    )
    printed = capsys.readouterr().out
    assert "intra Simple: 4.8 GB/s per channel" in printed and f"wrote {out}" in printed
    # a rerun on the same folder reads its *.txt only, and --out elsewhere leaves the first file alone
    before = out.read_text()
    assert (
        main(["calibrate", "bandwidth", str(sweep), "--cluster", "a40-pcie-ib100", "--out", str(tmp_path / "b.yaml")])
        == 0
    )
    assert out.read_text() == before and ClusterSpec.load(tmp_path / "b.yaml").name == "b"


def test_a_malformed_file_names_its_lines_and_nothing_is_written(tmp_path, capsys):
    sweep = _sweep(tmp_path / "sweep", ops=("all_gather",))
    bad = sweep / "all_gather.Simple.c4.t512.txt"
    lines = bad.read_text().splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("4194304"))
    lines[row] = lines[row].rsplit(None, 4)[0]  # the in-place half cut off
    bad.write_text("\n".join(lines) + "\n")
    (sweep / "all_gather.Simple.c8.t512.txt").write_text("srun: error: Unable to create step for job 42\n")
    out = tmp_path / "out.yaml"
    out.write_text("kept: true\n")  # --force: replacing it is allowed, yet bad input writes nothing
    assert (
        main(["calibrate", "bandwidth", str(sweep), "--cluster", "a40-pcie-ib100", "--out", str(out), "--force"]) == 2
    )
    err = _error_line(capsys)
    assert err.startswith("lagom calibrate: error: 3 problem(s) in the nccl-tests output, nothing written: ")
    assert f"{bad}:{row + 1}: expected a result row: size count type redop root, then time algbw busbw #wrong" in err
    assert f"{sweep / 'all_gather.Simple.c8.t512.txt'}:1: no '# lagom-sweep' line" in err
    assert "no result table" in err
    assert out.read_text() == "kept: true\n"


def test_no_usable_row_and_nothing_identified_are_refused(tmp_path, capsys):
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / "run.txt").write_text(
        run_text(
            op="all_gather",
            sizes=[0],
            busbw=1.0,
            ranks=8,
            hosts=["n"],
            latency_us=5,
            sweep_line="# lagom-sweep op=all_gather algorithm=Ring protocol=Simple channels=2 threads=512 nodes=1",
        )
    )
    assert main(["calibrate", "bandwidth", str(zero), "--cluster", "a40-pcie-ib100"]) == 2
    assert "no usable row in 1 file(s)" in _error_line(capsys)
    one = _sweep(tmp_path / "one", ops=("all_gather",), channels=(4,), threads=(512,))
    assert main(["calibrate", "bandwidth", str(one), "--cluster", "a40-pcie-ib100"]) == 2
    assert "the 1 run(s) identify no cluster key, nothing written: " in _error_line(capsys)
    assert not list(tmp_path.rglob("*.yaml"))


def test_bad_paths_and_outputs(tmp_path, capsys):
    sweep = _sweep(tmp_path / "sweep", ops=("all_gather",), channels=(1, 16), threads=(512,))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["calibrate", "bandwidth", str(empty), "--cluster", "a40-pcie-ib100"]) == 2
    assert f"{empty}: no *.txt run files in this folder" in _error_line(capsys)
    assert main(["calibrate", "bandwidth", str(tmp_path / "none"), "--cluster", "a40-pcie-ib100"]) == 2
    assert f"{tmp_path / 'none'}: no such file or folder" in _error_line(capsys)
    assert main(["calibrate", "bandwidth", str(sweep), "--cluster", "no-such-cluster"]) == 2
    assert "cluster 'no-such-cluster' is neither a file nor one of" in _error_line(capsys)
    assert main(["calibrate", "bandwidth", str(sweep)]) == 2
    assert "the following arguments are required: --cluster" in _error_line(capsys)
    mine = tmp_path / "mine.yaml"
    mine.write_text(yaml.safe_dump(ClusterSpec.load("a40-pcie-ib100").to_dict()))
    before = mine.read_text()
    assert main(["calibrate", "bandwidth", str(sweep), "--cluster", str(mine), "--out", str(mine)]) == 2
    assert f"--out {mine} is the same file as --cluster {mine}" in _error_line(capsys)
    run = sweep / "all_gather.Simple.c1.t512.txt"
    assert (
        main(
            [
                "calibrate",
                "bandwidth",
                str(run),
                str(sweep / "all_gather.Simple.c16.t512.txt"),
                "--cluster",
                str(mine),
                "--out",
                str(run),
            ]
        )
        == 2
    )
    assert f"--out {run} is the same file as input {run}" in _error_line(capsys)
    assert mine.read_text() == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_out_it_cannot_read_is_not_replaced(tmp_path, capsys):
    sweep = _sweep(tmp_path / "sweep", ops=("all_gather",))
    out = tmp_path / "locked.yaml"
    out.write_text("secret\n")
    out.chmod(0o200)
    try:
        assert main(["calibrate", "bandwidth", str(sweep), "--cluster", "a40-pcie-ib100", "--out", str(out)]) == 2
        assert f"--out {out}: exists and cannot be read; not overwriting it" in _error_line(capsys)
    finally:
        out.chmod(0o600)
    assert out.read_text() == "secret\n"


def test_an_out_that_fails_to_open_is_not_replaced(tmp_path, capsys, monkeypatch):
    """The same refusal where permissions cannot show it (root reads any file): opening fails."""
    import lagom_megatron.cli.options as options

    sweep = _sweep(tmp_path / "sweep", ops=("all_gather",))
    out = tmp_path / "locked.yaml"
    out.write_text("secret\n")

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(options, "_read_text", refuse)
    assert main(["calibrate", "bandwidth", str(sweep), "--cluster", "a40-pcie-ib100", "--out", str(out)]) == 2
    assert f"--out {out}: exists and cannot be read; not overwriting it" in _error_line(capsys)
    assert out.read_text() == "secret\n"


def test_an_existing_file_it_did_not_write_is_kept_unless_force(tmp_path, capsys):
    """`--out ../mine.yaml` replaced the user's file; it is refused unless --force, and a cluster
    file this command wrote is replaced by the next calibration."""
    sweep = _sweep(tmp_path / "sweep", ops=("all_gather",))
    mine = tmp_path / "mine.yaml"
    mine.write_text("my notes\n")
    argv = ["calibrate", "bandwidth", str(sweep), "--cluster", "a40-pcie-ib100", "--out", str(mine)]
    assert main(argv) == 2
    assert _error_line(capsys) == (
        f"lagom calibrate: error: --out {mine}: exists and is not a cluster file lagom "
        "calibrate bandwidth wrote; pass --force to replace it, or give another file name"
    )
    assert mine.read_text() == "my notes\n"
    assert main(argv + ["--force"]) == 0
    assert ClusterSpec.load(mine).per_channel_gbps is not None
    first = mine.read_text()
    capsys.readouterr()
    assert main(argv) == 0  # its own output: replaced without --force
    assert mine.read_text().splitlines()[1:] == first.splitlines()[1:]


def test_a_gloo_cluster_is_refused_as_simulate_refuses_it(tmp_path, capsys):
    sweep = _sweep(tmp_path / "sweep")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    out = tmp_path / "gloo.yaml"
    assert main(["calibrate", "bandwidth", str(sweep), "--cluster", "cpu-gloo", "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert line.startswith("lagom calibrate: error: --cluster cpu-gloo: 'cpu-gloo' is a gloo cluster; "), line
    allowed = line.split("a GPU cluster (nccl): one of ")[1]
    assert "'a40-pcie-ib100'" in allowed and "'cpu-gloo'" not in allowed
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
