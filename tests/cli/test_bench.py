"""``lagom bench simulated`` on a small fast subset: the CSV's exact columns, the claims on every
row, the sensitivity table, and the option checks (the full table is a benchmark, committed under
docs/bench/)."""

from __future__ import annotations

import csv

import pytest

from lagom_megatron.cli.bench import simulated_main
from lagom_megatron.sim.bench import table as bench


def _floats(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            out[k] = v
    return out


def test_subset_writes_the_columns_and_meets_the_claims(tmp_path, capsys):
    rc = simulated_main(
        [
            "--out",
            str(tmp_path),
            "--presets",
            "moe-2b-8e-a40x8-ep8",
            "--clusters",
            "a40-pcie-ib200",
            "h100-sxm-ib400",
            "--seeds",
            "0",
            "1",
            "--iters",
            "3",
            "--verify-iters",
            "4",
            "--no-plot",
        ]
    )
    with (tmp_path / "simulated.csv").open() as f:
        reader = csv.DictReader(f)
        assert list(reader.fieldnames) == list(bench.COLUMNS)
        raw = list(reader)
    rows = [_floats(r) for r in raw]
    assert len(rows) == 4 and sorted({r["seed"] for r in rows}) == [0.0, 1.0]
    details = [_floats(r) for r in csv.DictReader((tmp_path / "simulated_details.csv").open())]
    for r, d in zip(rows, details):
        assert bench.must_show(r) == [], (r["cluster"], bench.must_show(r))
        assert r["microbatches"] == 2
        if d["lagom_registered"]:  # kept: the next launch, with those buffers registered (registered defaults at worst)
            assert r["cluster"] == "h100-sxm-ib400" and d["lagom_registered"] == "dp"
            assert r["lagom_kept_ms"] <= r["nccl_ub_all_ms"] * 1.002 < r["default_ms"]
        else:
            assert r["lagom_kept_ms"] == pytest.approx(
                r["lagom_plan_ms"] if d["lagom_phase"] == "applied" else r["default_ms"], rel=1e-4
            )
        assert r["oracle"] == pytest.approx(r["default_ms"] / d["oracle_ms"], rel=1e-3)
        assert 0.0 <= r["overlap_frac"] <= 1.0 and 1.0 - 1e-9 <= r["contention_bound"] <= r["exposed_comm_bound"]
        # raising as well as lowering caps starts from the lowering sweep's caps: never slower than it, noise aside
        assert r["caps_raise_ms"] <= r["static_caps_ms"] * 1.03
    # registered buffers change nothing modelled on PCIe: the columns are empty there
    assert all((r["nccl_ub_ms"] == "") == (r["cluster"] == "a40-pcie-ib200") for r in rows)
    assert all((r["nccl_ub_all_ms"] == "") == (r["cluster"] == "a40-pcie-ib200") for r in rows)
    assert rc == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "1.07-1.33x" in out and "met on every row" in out


def test_sensitivity_prints_a_tornado_line_per_constant(tmp_path, capsys):
    rc = simulated_main(
        [
            "--out",
            str(tmp_path),
            "--sensitivity",
            "--constants",
            "sat_p",
            "--presets",
            "moe-2b-8e-a40x8-ep8",
            "--clusters",
            "a40-pcie-ib200",
            "--verify-iters",
            "4",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "SENSITIVITY" in out and "sat_p" in out and "3..16" in out
    lines = list(csv.DictReader((tmp_path / "sensitivity.csv").open()))
    assert [(ln["constant"], ln["end"]) for ln in lines] == [("-", "value"), ("sat_p", "low"), ("sat_p", "high")]
    assert all(float(ln["kept"]) > 0.9 for ln in lines)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--iters", "0"], "argument --iters: 0 is not an integer >= 1"),
        (["--verify-iters", "0"], "argument --verify-iters: 0 is not an integer >= 1"),
        (["--verify-iters", "x"], "argument --verify-iters: 'x' is not an integer >= 1"),
        (["--seeds", "-1"], "argument --seeds: -1 is not an integer >= 0"),
        (["--jobs", "0"], "argument --jobs: 0 is not an integer >= 1"),
        (["--microbatches", "0"], "--microbatches must be 'preset' or an integer >= 1; got 0"),
        (["--microbatches", "preset", "x"], "--microbatches must be 'preset' or an integer >= 1; got 'x'"),
        (["--presets", "cpu-tp2-dp2"], "the simulator models GPU clusters"),
        (["--presets", "no-such-preset"], "no-such-preset"),
        (["--constants", "sat_p"], "--constants needs --sensitivity"),
        (["--sensitivity", "--constants", "nope"], "--constants: unknown ['nope']"),
    ],
)
def test_bad_options_are_refused_up_front(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        simulated_main(["--out", str(tmp_path / "o")] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "--iters must" not in err and "--verify-iters must" not in err  # the option is named once
    assert not (tmp_path / "o" / "simulated.csv").exists()


def test_unwritable_out_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit):
        simulated_main(["--out", str(f / "sub"), "--presets", "mixtral-8x7b-h100x32"])
    assert "--out" in capsys.readouterr().err


def test_out_never_overwrites_a_file_the_bench_did_not_write(tmp_path, capsys):
    """A user's own simulated.csv stops the run before anything is simulated (exit 2, the file unchanged); other
    files are written beside; an earlier bench output (the bench's header) may be replaced."""
    from lagom_megatron.cli.bench import _not_a_bench_file_or_ours

    out = tmp_path / "results"
    out.mkdir()
    mine = out / "simulated.csv"
    mine.write_bytes(b"my own numbers\n1,2,3\n")
    with pytest.raises(SystemExit) as exc:
        simulated_main(["--out", str(out), "--presets", "moe-2b-8e-a40x8-ep8", "--no-plot"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds simulated.csv" in err and "never over them" in err
    assert mine.read_bytes() == b"my own numbers\n1,2,3\n" and sorted(p.name for p in out.iterdir()) == [
        "simulated.csv"
    ]

    notes, figure = out / "README.md", out / "simulated.png"
    notes.write_text("# my notes\n")
    figure.write_bytes(b"\x89PNG")
    assert _not_a_bench_file_or_ours(notes)  # written beside
    assert not _not_a_bench_file_or_ours(figure)  # a figure beside a user's table is the user's
    mine.write_text(",".join(bench.COLUMNS) + "\n")  # an earlier bench table: the bench's header
    assert _not_a_bench_file_or_ours(mine) and _not_a_bench_file_or_ours(figure)
    (out / "sensitivity.csv").write_text("constant,end\n")
    assert _not_a_bench_file_or_ours(out / "sensitivity.csv")
