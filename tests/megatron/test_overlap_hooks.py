"""The hooks on what Megatron-Core overlaps on a GPU, run for real on two gloo processes.

One launch of ``overlap_worker.worker`` (2 processes, FileStore, no port) installs
``patches.install`` with the Transformer Engine stand-in (``te_standin``) and runs:

* TE layers: column- and row-parallel stand-in layers with sequence parallelism; the backward
  all-gather / reduce-scatter are sites named by module, routed to a pool entry, and gradients
  are bit-identical hooked, routed and unhooked;
* context parallel: TE's KV ring (batched and unbatched) and all-to-all, ``cp_group`` routed at
  the attention module, ring steps and all-to-alls timed as overlapped;
* pipeline: megatron-core's own ``P2PCommunicator._communicate`` with ``wait_on_reqs=False``
  (``--overlap-p2p-communication``): ``t_comp`` > 0; with the site routed, the half megatron-core
  posts on WORLD goes to the ``pp_world`` pool entry;
* MoE: megatron-core's ``_AllToAll`` backward is tagged;
* the deferred embedding-wgrad all-gathers of megatron-core's own ``drain_embedding_wgrad_compute``;
* FSDP2: torch's ``fully_shard`` per layer as megatron-core 0.16.1 calls it, per-unit sites,
  routed with identical gradients.
"""

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

from tests.timeouts import exit_after  # noqa: E402

from .overlap_worker import SLEEP, worker  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap")
    mp.spawn(exit_after, args=(worker, str(out / "store"), str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_te_sequence_parallel_backward_collectives_are_sites_named_by_module(ranks):
    for r in ranks:
        rec = r["te_records"]
        # column-parallel LayerNormLinear (module 0): async input all-gather and dgrad reduce-scatter
        # in backward, once per micro-batch (2); 4 rows x 8 floats per rank gathered to 8 x 8
        assert rec["tp.sp_all_gather[chunk0.0]"] == ["all_gather", 8 * 8 * 4, 2, "tp"]
        assert rec["tp.sp_reduce_scatter[chunk0.0]"] == ["reduce_scatter", 8 * 8 * 4, 2, "tp"]
        # the row-parallel Linear (module 1) communicates synchronously only: no site
        assert not [k for k in rec if "chunk0.1" in k]
        # column-parallel without sequence parallelism (module 2): async dgrad all-reduce, 4 x 8 floats
        assert rec["tp.dgrad_all_reduce[chunk0.2]"] == ["all_reduce", 4 * 8 * 4, 2, "tp"]
        assert len(rec) == 3
        assert r["te_same_grads_hooked"] and r["te_same_grads_routed"]
        assert r["te_routed_calls"] == 2  # the routed reduce-scatter, one per micro-batch
        serialized = r["te_timings"]["tp.sp_all_gather[chunk0.0]"]
        assert serialized[0] > 0 and serialized[1] >= 0  # t_comm; t_comp of the serialized iteration


@pytest.mark.parametrize("tag", ["cp_batched", "cp_unbatched"])
def test_cp_ring_is_a_module_site_timed_as_overlapped_and_routed_at_the_attention_module(ranks, tag):
    for rank, r in enumerate(ranks):
        rec = r[f"{tag}_records"]
        # CP = 2: one ring step in forward, one in backward; 6 floats sent per step
        assert rec == {"cp.ring_send_recv[chunk0.attn]": ["send", 24, 2, "cp"]}
        q = 1.0 + rank
        assert r[f"{tag}_out"][0] == [q * 10.0 + q * 20.0] * 6  # sum over both ranks' KV blocks
        comm, comp, region = r[f"{tag}_serialized"]["cp.ring_send_recv[chunk0.attn]"]
        assert comp >= 2 * SLEEP * 1e6 * 0.9  # the attention step computed while the exchange was posted
        comm, comp, region = r[f"{tag}_overlapped"]["cp.ring_send_recv[chunk0.attn]"]
        assert math.isnan(comp) and region >= 2 * SLEEP * 1e6 * 0.9  # NaN outside serialized iterations
        name, swapped, restored = r[f"{tag}_routed_group"]
        assert (name, swapped, restored) == ("cp", True, True)
        assert r[f"{tag}_routed_same"]


def test_cp_all_to_all_is_a_module_site_timed_as_overlapped_and_routed(ranks):
    for rank, r in enumerate(ranks):
        # two all-to-alls in forward (q, output) and two in backward (dout, dq) of 8 floats
        assert r["cp_a2a_records"] == {"cp.a2a[chunk0.attn]": ["all_to_all", 32, 4, "cp"]}
        q = [float(i + 100 * rank) for i in range(8)]
        assert r["cp_a2a_out"] == [[2.0 * x for x in q], [6.0] * 8]  # out = 2 q, dq = 2 * 3
        comm, comp, region = r["cp_a2a_serialized"]["cp.a2a[chunk0.attn]"]
        assert comm > 0 and comp >= 4 * SLEEP * 1e6 * 0.9  # each posted all-to-all overlaps a step
        assert r["cp_a2a_routed_group"] == ["cp", True, True]
        # the attention module routed once (cp_group swapped) + each of the 4 all-to-alls per call
        assert r["cp_a2a_routed_calls"] == 1 + 4 and r["cp_a2a_routed_same"]


def test_overlapped_pipeline_p2p_has_compute_time_and_pp2_world_half_follows_the_route(ranks):
    for rank, r in enumerate(ranks):
        partner = 1 - rank
        assert r["pp_recv_default"] == [1.0 + partner] * 5
        assert r["pp_records"] == {"pp.send_recv": ["send", 20, 1, "pp"]}
        comm, comp, region = r["pp_serialized"]["pp.send_recv"]
        assert comp > 0 and comp >= SLEEP * 1e6 * 0.9  # must-show: t_comp > 0 for an overlapped P2P
        comm, comp, region = r["pp_overlapped"]["pp.send_recv"]
        assert math.isnan(comp) and region >= SLEEP * 1e6 * 0.9
        assert r["pp_recv_routed"] == [1.0 + partner] * 5
    # routed: rank 0 (even) sends on the pp entry and receives on the pp_world entry; rank 1 the reverse
    assert ranks[0]["pp_routed_groups"] == [["send", "pp"], ["recv", "pp_world"]]
    assert ranks[1]["pp_routed_groups"] == [["recv", "pp"], ["send", "pp_world"]]


def test_moe_all_to_all_backward_is_tagged(ranks):
    for r in ranks:
        rec = r["moe_records"]
        assert rec["ep.dispatch_all_to_all[0]"] == ["all_to_all", 32, 1, "ep"]
        assert rec["ep.dispatch_all_to_all_bwd[0]"] == ["all_to_all", 32, 1, "ep"]
        # the gradient of row block i comes back from the rank that received it: factor 1 + that rank
        assert r["moe_grad"] == [[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2


def test_deferred_embedding_wgrad_all_gathers_are_one_iteration_stream(ranks):
    for r in ranks:
        rec = r["embd_records"]
        # the first gather is synchronous, the two pipelined ones async; 2 x 1 x 4 floats in, x2 out
        assert rec == {f"tp.embedding_wgrad_all_gather[{k}]": ["all_gather", 64, 1, "tp"] for k in range(3)}
        assert set(r["embd_timings"]) == set(rec)
        for k in (1, 2):  # async: the wgrad GEMM of the previous micro-batch overlapped them
            assert math.isnan(r["embd_timings"][f"tp.embedding_wgrad_all_gather[{k}]"][1])


def test_fsdp2_units_are_sites_profiled_and_routed(ranks):
    if "fsdp_records" not in ranks[0]:
        pytest.skip(f"FSDP2 cannot run on CPU with torch {torch.__version__} (torch.cpu.Stream has no record_event)")
    for r in ranks:
        rec = r["fsdp_records"]
        # Linear(8, 8) + bias: 72 floats, gathered whole: forward and backward re-gather (reshard after forward)
        assert rec["dp.fsdp_all_gather[0]"] == ["all_gather", 72 * 4, 2, "dp"]
        assert rec["dp.fsdp_reduce_scatter[0]"][0::2] == ["reduce_scatter", 1]
        assert rec["dp.fsdp_all_gather[1]"][0] == "all_gather" and rec["dp.fsdp_reduce_scatter[1]"][2] == 1
        assert set(r["fsdp_timings"]) >= set(rec)
        # routed: all-gather of unit 0 (forward and backward) and reduce-scatter of unit 1
        assert r["fsdp_routed_calls"] == 3 and r["fsdp_routed_same"]


def test_every_new_entry_point_was_patched(ranks):
    patched = set(ranks[0]["patched"])
    for name in (
        "torch.distributed.all_gather_into_tensor",
        "torch.distributed.reduce_scatter_tensor",
        "megatron.core.pipeline_parallel.p2p_communication._p2p_ops",
        "_AllToAll.forward",
        "_AllToAll.backward",
        "_Linear.backward",
        "_LayerNormLinear.backward",
        "Linear.forward",
        "DotProductAttention.forward",
        "AttnFuncWithCPAndKVP2P.backward",
        "FSDPParamGroup.unshard",
        "FSDPParamGroup.post_backward",
        "tests.megatron.te_standin.attention.dot_product_attention.context_parallel.flash_attn_p2p_communicate",
        "megatron.core.utils.dist_all_gather_func",
        "megatron.core.pipeline_parallel.schedules.drain_embedding_wgrad_compute",
    ):
        assert name in patched, name
