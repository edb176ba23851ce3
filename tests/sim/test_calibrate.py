"""``lagom calibrate contention``: the fit recovers the constants a synthetic probe CSV was made
with, the simulator takes fitted constants from a cluster file, and the GPU probe imports and
exits cleanly without a GPU."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lagom_megatron.cli.main import main as lagom
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.sim.calibrate import COLUMNS, fit, read_rows
from lagom_megatron.sim.constants import get
from lagom_megatron.sim.device import ComputeKernel, Gpu, compute_time_us, wave_factor
from tests.timeouts import COMMAND_S

REPO = Path(__file__).resolve().parents[2]


def _synthetic(path: Path, *, kappa_mem: float, kappa_compute: float, sms: int = 132, peak: float = 3000.0) -> None:
    rows = []
    for ctas in (1, 2, 4, 8, 16, 32, 64):
        d_comm = 40.0 * ctas
        for kind, tiles in (("elementwise", 0), ("gemm", 4096)):
            t_alone = 1000.0
            d_c = 2500.0 if kind == "elementwise" else 300.0
            f = min(1.0, peak / (d_c + d_comm))
            share = d_comm * f / peak
            k = ComputeKernel("k", kind, 0.0, 0.0, tiles=tiles)
            wave = wave_factor(sms, sms - ctas, k)
            slow = (1 / f) * (1 + kappa_mem * share) if kind == "elementwise" else wave * (1 + kappa_compute * share)
            rows.append(
                dict(
                    gpu="H200",
                    sms=sms,
                    peak_hbm_gbs=peak,
                    kernel=kind,
                    kind=kind,
                    tiles=tiles,
                    persistent=0,
                    mode="copy",
                    ctas=ctas,
                    threads=256,
                    chunk_bytes=524288,
                    total_bytes=1 << 30,
                    t_alone_us=t_alone,
                    t_overlap_us=t_alone * slow,
                    kernel_hbm_bytes=d_c * t_alone * 1e3,
                    comm_hbm_gbs=d_comm,
                )
            )
        rows.append(
            dict(
                rows[-1],
                mode="l2",
                kind="gemm",
                tiles=sms,
                comm_hbm_gbs=0.0,
                t_overlap_us=1000.0 * (2.0 if ctas else 1.0),
            )
        )
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def test_fit_recovers_the_constants_of_a_synthetic_probe(tmp_path):
    src = tmp_path / "probe.csv"
    _synthetic(src, kappa_mem=2.2, kappa_compute=0.6)
    got = fit(read_rows(src))
    assert got.kappa_mem == pytest.approx(2.2, rel=1e-6) and got.kappa_compute == pytest.approx(0.6, rel=1e-6)
    assert got.rows["sm_term"] == 7 and got.sm_term_mae_pct == pytest.approx(
        0.0, abs=1e-9
    )  # one wave, one SM taken: 2x


def test_cli_writes_yaml_and_refuses_a_bad_csv(tmp_path, capsys):
    src = tmp_path / "probe.csv"
    _synthetic(src, kappa_mem=1.5, kappa_compute=0.9)
    assert lagom(["calibrate", "contention", str(src)]) == 0
    doc = yaml.safe_load((tmp_path / "probe.fit.yaml").read_text())
    assert (
        doc["gpu"] == "H200" and doc["kappa_mem"] == pytest.approx(1.5) and doc["kappa_compute"] == pytest.approx(0.9)
    )
    bad = tmp_path / "bad.csv"
    bad.write_text("gpu,sms\nH200,132\n")
    assert lagom(["calibrate", "contention", str(bad)]) == 2
    assert "missing column(s)" in capsys.readouterr().err


def test_fitted_constants_reach_the_device_model():
    spec = ClusterSpec.load("h100-sxm-ib400")
    tuned = ClusterSpec.from_dict({**spec.to_dict(), "kappa_mem": 1.0})
    g0, g1 = Gpu.from_cluster(spec), Gpu.from_cluster(tuned)
    assert g0.kappa("kappa_mem") == get("kappa_mem") and g1.kappa("kappa_mem") == 1.0
    k = ComputeKernel("ew", "elementwise", 1e6, 1e9)
    assert compute_time_us(g1, k, comm_hbm_share=0.3) < compute_time_us(g0, k, comm_hbm_share=0.3)
    with pytest.raises(ValueError, match="kappa_mem must be a number >= 0"):
        ClusterSpec.from_dict({**spec.to_dict(), "kappa_mem": -1})


def test_probe_imports_without_cuda_and_exits_cleanly(tmp_path):
    """Without a GPU the probe measures nothing and exits 1 (as check.sh marks it FAILED), so a script that chains
    it to ``lagom calibrate contention`` stops; it names why and writes no CSV."""
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu" / "contention_probe.py"), "--out", str(tmp_path / "p.csv")],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert r.returncode == 1, r.stderr
    assert "no CUDA GPU" in r.stdout + r.stderr
    assert not (tmp_path / "p.csv").exists()


def _edited(tmp_path: Path, edit) -> Path:
    """A synthetic probe CSV with ``edit(rows)`` applied to its parsed rows (text cells)."""
    src = tmp_path / "probe.csv"
    _synthetic(src, kappa_mem=1.5, kappa_compute=0.9)
    rows = list(csv.DictReader(src.open()))
    rows = edit(rows) or rows
    with src.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return src


@pytest.mark.parametrize(
    "column, cell, shown",
    [
        ("t_overlap_us", "-5", "must be a finite number >= 0; got -5"),
        ("t_alone_us", "nan", "must be a finite number >= 0; got nan"),
        ("kernel_hbm_bytes", "inf", "must be a finite number >= 0; got inf"),
        ("t_alone_us", "12us", "must be a finite number >= 0; got '12us'"),
        ("peak_hbm_gbs", "0", "must be a finite number > 0; got 0"),
    ],
)
def test_a_bad_cell_names_file_line_column_and_value_and_writes_nothing(tmp_path, capsys, column, cell, shown):
    def edit(rows):
        rows[2][column] = cell

    src = _edited(tmp_path, edit)
    assert lagom(["calibrate", "contention", str(src)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"lagom calibrate: error: {src}:4: {column} {shown}" and captured.out == ""
    assert not (tmp_path / "probe.fit.yaml").exists()


def test_a_csv_without_a_usable_row_is_refused_and_writes_nothing(tmp_path, capsys):
    def edit(rows):
        for r in rows:
            r["t_overlap_us"] = "0"

    src = _edited(tmp_path, edit)
    assert lagom(["calibrate", "contention", str(src)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"lagom calibrate: error: {src}: no usable row: each has a zero time, or a "
        "copy/reduce channel kernel whose HBM share is below 0.02; nothing written"
    )
    assert captured.out == "" and not (tmp_path / "probe.fit.yaml").exists()


def test_a_constant_without_rows_is_reported_without_a_unit(tmp_path, capsys):
    src = _edited(tmp_path, lambda rows: [r for r in rows if r["mode"] != "l2"])  # no SM-term rows; 1 CTA: share < 0.02
    assert lagom(["calibrate", "contention", str(src)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert (
        first == "H200: kappa_mem 1.500 (6 rows), kappa_compute 0.900 (6 rows), SM term error no usable rows (0 rows)"
    )
    assert yaml.safe_load((tmp_path / "probe.fit.yaml").read_text())["sm_term_mae_pct"] is None
