"""Overlapped expert-parallel all-to-all (``overlap_moe_expert_parallel_comm``): Megatron-Core
0.16.1's combined 1F1B schedule without pipelining (``sim.workload_ep_overlap``)."""

from __future__ import annotations

import pytest

from lagom_megatron.config.presets import load_preset
from lagom_megatron.sim.backend import SimulatedCluster
from lagom_megatron.sim.bench.row import with_microbatches
from lagom_megatron.sim.timeline import windows


def _moe(overlap: bool, mbs: int = 2):
    p = with_microbatches(load_preset("moe-2b-8e-a40x8-ep8"), mbs)
    p = p.model_copy(update={"overlap": p.overlap.model_copy(update={"overlap_moe_expert_parallel_comm": overlap})})
    return SimulatedCluster(p, seed=0)


def _windows_by_call(sim):
    prog = sim.workload.program()
    win = windows(prog)
    return prog, [(c, [prog.ops[q][1].name for q in win[i]]) for i, c in enumerate(prog.calls)]


def test_forward_all_to_alls_overlap_the_other_micro_batch_backward():
    sim = _moe(True)
    L = sim.workload.layers_per_chunk
    prog, calls = _windows_by_call(sim)
    disp = [(c, names) for c, names in calls if c.site_id and "dispatch" in c.site_id]
    comb = [(c, names) for c, names in calls if c.site_id and "combine" in c.site_id]
    # micro-batch 0's forward runs alone: its all-to-alls block (empty windows)
    assert [names for c, names in disp if c.microbatch == 0] == [[]] * L
    assert [names for c, names in comb if c.microbatch == 0] == [[]] * L
    # in the combined step the dispatch overlaps the expert MLP's input-gradient GEMMs of the
    # backward layer (queued behind it: the backward dispatch, which overlaps the weight gradients)
    step = [names for c, names in disp if c.microbatch == 1]
    assert len(step) == L and all(names == ["fc2", "act", "fc1"] for names in step)
    # the combine overlaps the backward attention of the paired layer (layer 0 adds embedding.bwd)
    comb1 = [names for c, names in comb if c.microbatch == 1]
    assert len(comb1) == L and all("attention.bwd" in names and names[0] == "router" for names in comb1)
    assert comb1[-1][-1] == "embedding.bwd"
    # the backward combine (not a site) overlaps the forward attention of the next micro-batch
    bwd = [names for c, names in calls if c.site_id is None and c.microbatch == 1 and c.stream == "ep"]
    assert ["norm1", "qkv", "attention", "proj", "norm2", "router"] in bwd


def test_same_sites_more_overlap_shorter_iteration():
    on, off = _moe(True, 4), _moe(False, 4)
    assert [(s.site_id, s.calls_per_iter, s.nbytes) for s in on.sites] == [
        (s.site_id, s.calls_per_iter, s.nbytes) for s in off.sites
    ]
    t_on = on.run_iteration(iteration=0, noise=False).iteration_us
    ovl_on = on.last_timeline.compute_overlapped_us / on.last_timeline.compute_us
    t_off = off.run_iteration(iteration=0, noise=False).iteration_us
    ovl_off = off.last_timeline.compute_overlapped_us / off.last_timeline.compute_us
    assert ovl_off < 0.05 and ovl_on > ovl_off + 0.15, (ovl_on, ovl_off)  # 0.036 -> 0.20
    assert t_on < t_off
    # same compute in both: the saving is at most the exposed all-to-all time
    assert on.last_timeline.compute_us == pytest.approx(off.last_timeline.compute_us, rel=0.05)


def test_with_pipelining_it_is_refused_by_name():
    p = load_preset("mixtral-8x7b-h100x32")
    p = p.model_copy(update={"overlap": p.overlap.model_copy(update={"overlap_moe_expert_parallel_comm": True})})
    with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm with PP"):
        SimulatedCluster(p, seed=0)
