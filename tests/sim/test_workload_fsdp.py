"""FSDP (ZeRO-3) in the simulated workload, and the preset flags the simulator refuses."""

from __future__ import annotations

import pytest

from lagom_megatron.config.presets import load_preset
from lagom_megatron.sim.backend import SimulatedCluster


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


@pytest.mark.parametrize("section, key", [
    ("overlap", "overlap_moe_expert_parallel_comm"),
    ("overlap", "overlap_param_gather_with_optimizer_step"),
])
def test_flags_the_simulator_cannot_model_are_refused_by_name(section, key):
    p = load_preset("llama3-8b-h100x8")
    part = getattr(p, section).model_copy(update={key: True})
    p = p.model_copy(update={section: part})
    with pytest.raises(ValueError, match=key):
        SimulatedCluster(p, seed=0)


def test_fsdp_with_the_distributed_optimizer_is_refused():
    p = load_preset("gpt3-2.7b-a40x8-fsdp")
    p = p.model_copy(update={"overlap": p.overlap.model_copy(update={"use_distributed_optimizer": True})})
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        SimulatedCluster(p, seed=0)
