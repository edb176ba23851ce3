"""``lagom bench simulated`` end to end on one small row (the full table is a benchmark, not a test)."""

from __future__ import annotations

import csv

import pytest

from lagom_megatron.sim import bench


def test_one_row_csv_is_consistent(tmp_path, capsys):
    rc = bench.main(["--out", str(tmp_path), "--presets", "llama3-8b-h100x8", "--bandwidth", "high",
                     "--microbatches", "2", "--iters", "3", "--no-plot"])
    assert rc == 0
    rows = list(csv.DictReader((tmp_path / "simulated.csv").open()))
    assert len(rows) == 1 and list(rows[0]) == list(bench.COLUMNS)
    r = {k: (float(v) if k.endswith(("_ms", "_default", "_autoccl", "_pct")) else v) for k, v in rows[0].items()}
    assert r["cluster"] == "h100-sxm-ib400" and r["microbatches"] == "2"
    assert r["speedup_vs_default"] == pytest.approx(r["default_ms"] / r["lagom_kept_ms"], rel=1e-3)
    assert r["speedup_vs_autoccl"] == pytest.approx(r["autoccl_ms"] / r["lagom_kept_ms"], rel=1e-3)
    kept_is_plan = r["lagom_phase"] == "applied"
    assert r["lagom_kept_ms"] == pytest.approx(r["lagom_plan_ms"] if kept_is_plan else r["default_ms"])
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "1.07-1.33x" in out and "1.03-1.27x" in out


def test_short_accumulation_override():
    from lagom_megatron.config.presets import load_preset

    p = bench.with_microbatches(load_preset("gpt3-13b-h100x64"), 2)
    assert p.training.global_batch_size == 2 * 16 * 2  # micro-batch 2 x DP 16 x 2 micro-batches
    with pytest.raises(ValueError, match="must be >= 1; got 0"):
        bench.with_microbatches(p, 0)
