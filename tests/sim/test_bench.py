"""``lagom bench simulated``'s table: the claims checked on every row, the default rows, the
micro-batch override and the oracle (the command itself: tests/cli/test_bench.py)."""

from __future__ import annotations

import pytest

from lagom_megatron.sim.bench import table as bench
from lagom_megatron.sim.bench.row import with_microbatches


def test_must_show_flags_each_claim():
    row = {
        "lagom_kept_ms": 101.0,
        "default_ms": 110.0,
        "static_caps_ms": 100.0,
        "nemo_yaml_ms": 120.0,
        "hp_stream_ms": 110.0,
        "nccl_ub_ms": None,
        "autoccl_ms": 115.0,
        "lagom_plan_ms": 105.0,
        "oracle": 110.0 / 100.0,
        "model_mape": 6.0,
    }
    fails = bench.must_show(row, noise=0.01)
    assert len(fails) == 3 and "best baseline" in fails[0] and "oracle gain" in fails[1] and "MAPE" in fails[2]
    ok = {**row, "lagom_kept_ms": 100.4, "lagom_plan_ms": 100.9, "model_mape": 4.9}  # gain 0.0902 >= 0.9 x 0.1
    assert bench.must_show(ok, noise=0.01) == []
    # an oracle gain within twice the iteration noise is not compared
    assert bench.must_show({**ok, "oracle": 1.015, "lagom_plan_ms": 110.0}, noise=0.01) == []
    assert len(bench.must_show({**ok, "oracle": 1.025, "lagom_plan_ms": 110.0}, noise=0.01)) == 1
    # registered buffers, where they apply, are a baseline like the others
    assert bench.must_show({**ok, "nccl_ub_ms": 99.0}, noise=0.01)[0].startswith(
        "kept 100.4 ms > 1.005 x best baseline 99.0"
    )


def test_default_table_has_the_rows_the_claims_are_about():
    rows = bench.ROWS
    assert len(rows) >= 20
    assert {"a40-pcie-ib200", "a40-nvlink-ib800"} <= {c for _, c, _ in rows}
    assert any(m == 1 for *_, m in rows)
    assert any("fsdp" in p and c in ("h100-sxm-ib400", "a100-ib100") for p, c, _ in rows)
    assert tuple(bench.SEEDS) == (0, 1, 2, 3, 4)


def test_short_accumulation_override():
    from lagom_megatron.config.presets import load_preset

    p = with_microbatches(load_preset("gpt3-13b-h100x64"), 2)
    assert p.training.global_batch_size == 2 * 16 * 2  # micro-batch 2 x DP 16 x 2 micro-batches
    with pytest.raises(ValueError, match="must be >= 1; got 0"):
        with_microbatches(p, 0)


def test_oracle_gives_sites_nccl_cannot_tell_apart_one_config():
    """With the tuner plugin NCCL tells calls apart only by communicator, collective and bytes, so
    the oracle's per-site pass moves such sites together (a plan no tuner table could hold
    otherwise)."""
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.nccl.rules import NcclRules
    from lagom_megatron.sim.backend import SimulatedCluster
    from lagom_megatron.sim.bench.references import oracle, tie_sets

    sim = SimulatedCluster(with_microbatches(load_preset("llama3-70b-h100x64"), 2), "h100-sxm-ib400", seed=0)
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
