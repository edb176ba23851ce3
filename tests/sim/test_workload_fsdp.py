"""FSDP (ZeRO-3) in the simulated workload, and the preset flags the simulator refuses."""

from __future__ import annotations

import pytest

from lagom_megatron.config.presets import load_preset
from lagom_megatron.sim.backend import SimulatedCluster
from tests.timeouts import LAUNCH_S, run


def test_fsdp_gathers_twice_and_reduce_scatters_once_per_layer_in_every_micro_batch():
    preset = load_preset("gpt3-2.7b-a40x8-fsdp")
    sim = SimulatedCluster(preset, seed=0)
    w = sim.workload
    assert w.fsdp and w.microbatches == 2
    L = w.layers_per_chunk
    ag = [s for s in sim.sites if s.site_id.startswith("dp.param_all_gather")]
    rs = [s for s in sim.sites if s.site_id.startswith("dp.grad_reduce_scatter")]
    assert len(ag) == len(rs) == L
    # forward gather + backward re-gather, in each of the 2 micro-batches; one reduce-scatter each
    assert {s.calls_per_iter for s in ag} == {4} and {s.calls_per_iter for s in rs} == {2}
    # a unit's gather moves its bf16 parameters, its reduce-scatter fp32 gradients
    mid = L // 2
    a = next(s for s in ag if s.site_id.endswith(f"bucket{mid}]"))
    r = next(s for s in rs if s.site_id.endswith(f"bucket{mid}]"))
    assert a.nbytes == int(2 * w.layer_params()) and r.nbytes == int(4 * w.layer_params())
    # all of them on one data-parallel communicator, and most compute overlaps them
    assert {s.group for s in ag + rs} == {"dp"}
    sim.run_iteration(iteration=0, noise=False)
    tl = sim.last_timeline
    assert tl.compute_overlapped_us / tl.compute_us > 0.8


@pytest.mark.parametrize(
    "section, key",
    [
        ("overlap", "overlap_moe_expert_parallel_comm"),
        ("overlap", "overlap_param_gather_with_optimizer_step"),
    ],
)
def test_flags_the_simulator_cannot_model_are_refused_by_name(section, key):
    p = load_preset("llama3-8b-h100x8")
    part = getattr(p, section).model_copy(update={key: True})
    p = p.model_copy(update={section: part})
    with pytest.raises(ValueError, match=key):
        SimulatedCluster(p, seed=0)


def test_torch_fsdp2_with_the_distributed_optimizer_is_refused_megatron_fsdp_with_it_is_the_same_program():
    """Megatron-LM asserts FSDP2 without the distributed optimizer (core_v0.16.1 arguments.py:612-613); with
    Megatron-FSDP the distributed optimizer hands its gathers to Megatron-FSDP (distrib_optimizer.py:2440-2443,
    2609-2611), so the iteration is the one without it."""
    p = load_preset("gpt3-2.7b-a40x8-fsdp")
    fsdp2 = p.model_copy(
        update={
            "overlap": p.overlap.model_copy(
                update={"use_distributed_optimizer": True, "use_megatron_fsdp": False, "use_torch_fsdp2": True}
            )
        }
    )
    with pytest.raises(ValueError, match="use_torch_fsdp2 with use_distributed_optimizer.*arguments.py:612-613"):
        SimulatedCluster(fsdp2, seed=0)
    with_opt = p.model_copy(update={"overlap": p.overlap.model_copy(update={"use_distributed_optimizer": True})})
    a, b = SimulatedCluster(p, seed=0), SimulatedCluster(with_opt, seed=0)
    assert [s.site_id for s in a.sites] == [s.site_id for s in b.sites]
    a.run_iteration(iteration=0, noise=False)
    b.run_iteration(iteration=0, noise=False)
    assert a.last_timeline.total_us == b.last_timeline.total_us


def _with_strategy(name, strategy):
    p = load_preset(name)
    return p.model_copy(update={"overlap": p.overlap.model_copy(update={"data_parallel_sharding_strategy": strategy})})


def _dp_sites(sim):
    return {s.site_id: s for s in sim.sites if s.site_id.startswith("dp.")}


@pytest.mark.parametrize(
    "strategy, gathers, reduce_op, reduces_per_iter",
    [
        ("no_shard", None, "all_reduce", 1),  # megatron_fsdp.py:425-426 (no gathers), :656-662 (last micro-batch)
        ("optim", 1, "reduce_scatter", 1),  # one gather per bucket per iteration, reductions delayed
        ("optim_grads", 1, "reduce_scatter", 2),  # reduce-scatters in each of the 2 micro-batches
    ],
)
def test_unsharded_parameter_strategies_issue_what_megatron_fsdp_issues(strategy, gathers, reduce_op, reduces_per_iter):
    """Without FSDP units (mcore_fsdp_adapter.py:96-99) every site is a root bucket's, in bucket order."""
    sim = SimulatedCluster(_with_strategy("gpt3-2.7b-a40x8-fsdp", strategy), seed=0)
    w = sim.workload
    assert w.fsdp_sharding == strategy and w.microbatches == 2
    sites = _dp_sites(sim)
    # GPT-3 2.7B (tied, learned positions, biases, LayerNorm), 40M-element buckets: the embedding alone, then
    # buckets cut inside the layers, and the tail (the last FC2 bias and the final norm): 50 buckets
    n = 50
    name = "grad_all_reduce" if strategy == "no_shard" else "grad_reduce_scatter"
    reduce_ids = [f"dp.{name}[chunk0.root_bucket{j}]" for j in range(n)]
    gather_ids = [f"dp.param_all_gather[chunk0.root_bucket{j}]" for j in range(n)] if gathers else []
    assert sorted(sites) == sorted(reduce_ids + gather_ids)
    assert {(sites[i].op, sites[i].calls_per_iter) for i in reduce_ids} == {(reduce_op, reduces_per_iter)}
    assert {(sites[i].op, sites[i].calls_per_iter) for i in gather_ids} <= {("all_gather", 1)}
    h = 2560
    assert sites[reduce_ids[0]].nbytes == 4 * w.vocab * h  # the word embedding's fp32 gradients
    assert sites[reduce_ids[-1]].nbytes == 4 * 3 * h  # FC2's bias, the final norm's weight and bias
    if gathers:
        assert sites[gather_ids[1]].nbytes * 2 == sites[reduce_ids[1]].nbytes  # bf16 parameters
    # per layer: biases of the projection (h), QKV (3h), FC1 (4h), FC2 (h); two LayerNorms (2h each)
    total = w.embedding_params() + w.position_params + w.layers_per_chunk * (w.layer_params() + 9 * h + 4 * h) + 2 * h
    assert sum(sites[i].nbytes for i in reduce_ids) == pytest.approx(4 * total, abs=4 * n)
    sim.run_iteration(iteration=0, noise=False)
    assert sim.last_timeline.total_us > 0


def test_no_shard_is_ddp_work_and_full_sharding_moves_the_most():
    """Bytes per iteration on the data-parallel communicator: no_shard all-reduces every gradient once (the
    bytes of a reduce-scatter plus an all-gather, in one call); optim_grads_params gathers twice and
    reduce-scatters once per unit and micro-batch."""
    per_iter = {}
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        sites = _dp_sites(SimulatedCluster(_with_strategy("gpt3-2.7b-a40x8-fsdp", strategy), seed=0)).values()
        per_iter[strategy] = sum(s.nbytes * s.calls_per_iter for s in sites)
    assert per_iter["optim"] == pytest.approx(1.5 * per_iter["no_shard"], rel=1e-9)  # fp32 RS + bf16 AG
    assert per_iter["optim_grads"] == pytest.approx(2.5 * per_iter["no_shard"], rel=1e-9)  # 2 RS + 1 AG
    assert per_iter["optim_grads_params"] > per_iter["optim_grads"]


def test_root_buckets_are_megatron_fsdps_own(tmp_path):
    """The simulator's buckets without units against megatron-core 0.16.1's ``_get_parameter_groups`` on each
    A40 FSDP preset's real GPTModel (meta device, bf16, local spec; tests/sim/fsdp_buckets_worker.py)."""
    import json
    import sys
    from pathlib import Path

    from lagom_megatron.sim.workload_fsdp import root_buckets

    models, simulated = [], []
    for name in ("gpt3-2.7b-a40x8-fsdp", "llama2-7b-a40x16-fsdp"):
        preset = _with_strategy(name, "optim")
        w = SimulatedCluster(preset, seed=0).workload
        m = preset.model_spec()
        models.append(
            dict(
                num_layers=m.num_layers,
                hidden_size=m.hidden_size,
                ffn_hidden_size=w.ffn,
                num_attention_heads=m.num_attention_heads,
                num_query_groups=m.num_query_groups,
                swiglu=m.swiglu,
                add_bias_linear=m.add_bias_linear,
                normalization=m.normalization,
                vocab_size=w.vocab,
                max_position_embeddings=m.max_position_embeddings or preset.training.seq_length,
                position_embedding_type=m.position_embedding_type,
                tied=not m.untie_embeddings_and_output_weights,
                bucket_size=w.bucket_params,
            )
        )
        simulated.append([int(n) for _, _, n in root_buckets(w)])
    root = Path(__file__).resolve().parents[2]
    proc = run(
        [sys.executable, "-m", "tests.sim.fsdp_buckets_worker", str(tmp_path / "store"), json.dumps(models)],
        cwd=root,
        text=True,
        timeout=LAUNCH_S,
    )  # two ranks; their tree killed at the limit
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [len(b) for b in real] == [50, 98]
    assert simulated == real
