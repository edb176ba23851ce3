"""``lagom bench simulated`` on a small fast subset: the CSV's exact columns, the claims on every
row, the sensitivity table, and the option checks (the full table is a benchmark, committed under
docs/bench/)."""

from __future__ import annotations

import csv

import pytest

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
    rc = bench.main(["--out", str(tmp_path), "--presets", "moe-2b-8e-a40x8-ep8", "--clusters", "a40-pcie-ib200",
                     "h100-sxm-ib400", "--seeds", "0", "1", "--iters", "3", "--verify-iters", "4", "--no-plot"])
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
        assert r["lagom_kept_ms"] == pytest.approx(r["lagom_plan_ms"] if d["lagom_phase"] == "applied" else r["default_ms"], rel=1e-4)
        assert r["oracle"] == pytest.approx(r["default_ms"] / d["oracle_ms"], rel=1e-3)
        assert 0.0 <= r["overlap_frac"] <= 1.0 and r["free_comm_bound"] >= 1.0 - 1e-9
    # registered buffers change nothing modelled on PCIe: the column is empty there
    assert all((r["nccl_ub_ms"] == "") == (r["cluster"] == "a40-pcie-ib200") for r in rows)
    assert rc == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "1.07-1.33x" in out and "met on every row" in out


def test_must_show_flags_each_claim():
    row = {"lagom_kept_ms": 101.0, "default_ms": 110.0, "static_caps_ms": 100.0, "nemo_yaml_ms": 120.0,
           "hp_stream_ms": 110.0, "nccl_ub_ms": None, "autoccl_ms": 115.0, "lagom_plan_ms": 105.0,
           "oracle": 110.0 / 100.0, "model_mape": 6.0}
    fails = bench.must_show(row, noise=0.01)
    assert len(fails) == 3 and "best baseline" in fails[0] and "oracle gain" in fails[1] and "MAPE" in fails[2]
    ok = {**row, "lagom_kept_ms": 100.4, "lagom_plan_ms": 100.9, "model_mape": 4.9}  # gain 0.0902 >= 0.9 x 0.1
    assert bench.must_show(ok, noise=0.01) == []
    # an oracle gain within twice the iteration noise is not compared
    assert bench.must_show({**ok, "oracle": 1.015, "lagom_plan_ms": 110.0}, noise=0.01) == []
    assert len(bench.must_show({**ok, "oracle": 1.025, "lagom_plan_ms": 110.0}, noise=0.01)) == 1
    # registered buffers, where they apply, are a baseline like the others
    assert bench.must_show({**ok, "nccl_ub_ms": 99.0}, noise=0.01)[0].startswith("kept 100.4 ms > 1.005 x best baseline 99.0")


def test_sensitivity_prints_a_tornado_line_per_constant(tmp_path, capsys):
    rc = bench.main(["--out", str(tmp_path), "--sensitivity", "--constants", "sat_p", "--presets", "moe-2b-8e-a40x8-ep8",
                     "--clusters", "a40-pcie-ib200", "--verify-iters", "4"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "SENSITIVITY" in out and "sat_p" in out and "3..16" in out
    lines = list(csv.DictReader((tmp_path / "sensitivity.csv").open()))
    assert [(ln["constant"], ln["end"]) for ln in lines] == [("-", "value"), ("sat_p", "low"), ("sat_p", "high")]
    assert all(float(ln["kept"]) > 0.9 for ln in lines)


@pytest.mark.parametrize("argv, message", [
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
])
def test_bad_options_are_refused_up_front(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--out", str(tmp_path / "o")] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "--iters must" not in err and "--verify-iters must" not in err  # the option is named once
    assert not (tmp_path / "o" / "simulated.csv").exists()


def test_unwritable_out_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit):
        bench.main(["--out", str(f / "sub"), "--presets", "mixtral-8x7b-h100x32"])
    assert "--out" in capsys.readouterr().err


def test_default_table_has_the_rows_the_claims_are_about():
    rows = bench.ROWS
    assert len(rows) >= 20
    assert {"a40-pcie-ib200", "a40-nvlink-ib800"} <= {c for _, c, _ in rows}
    assert any(m == 1 for *_, m in rows)
    assert any("fsdp" in p and c in ("h100-sxm-ib400", "a100-ib100") for p, c, _ in rows)
    assert tuple(bench.SEEDS) == (0, 1, 2, 3, 4)


def test_short_accumulation_override():
    from lagom_megatron.config.presets import load_preset

    p = bench.with_microbatches(load_preset("gpt3-13b-h100x64"), 2)
    assert p.training.global_batch_size == 2 * 16 * 2  # micro-batch 2 x DP 16 x 2 micro-batches
    with pytest.raises(ValueError, match="must be >= 1; got 0"):
        bench.with_microbatches(p, 0)


def test_oracle_gives_sites_nccl_cannot_tell_apart_one_config():
    """With the tuner plugin NCCL tells calls apart only by communicator, collective and bytes, so
    the oracle's per-site pass moves such sites together (a plan no tuner table could hold
    otherwise)."""
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.nccl.rules import NcclRules
    from lagom_megatron.sim.backend import SimulatedCluster
    from lagom_megatron.sim.bench.references import oracle, tie_sets

    sim = SimulatedCluster(bench.with_microbatches(load_preset("llama3-70b-h100x64"), 2), "h100-sxm-ib400", seed=0)
    rules = NcclRules(sim.cluster, backend="sim")
    tied = tie_sets(sim.sites, rules)
    sets = {tuple(v) for v in tied.values()}
    twins = tuple(f"dp.grad_reduce_scatter[chunk{c}.bucket0]" for c in (4, 3, 2, 1))
    assert twins in sets and all(tied[s] == list(twins) for s in twins)
    plan, best_us, _ = oracle(sim)
    for members in sets:
        assert len({plan[s] for s in members}) == 1, {s: plan[s] for s in members}
    default_us = sim.run_iteration(iteration=0, noise=False).iteration_us
    assert best_us <= default_us
    comm = NcclRules(sim.cluster, backend="sim", mechanism="communicator")
    assert all(tie_sets(sim.sites, comm)[s.site_id] == [s.site_id] for s in sim.sites)
