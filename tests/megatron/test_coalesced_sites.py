"""Collectives issued inside a ``_coalescing_manager`` as sites, run for real on two gloo processes.

One launch of ``coalesced_worker.worker`` (2 processes, FileStore, no port) installs
``patches.install`` with the Transformer Engine stand-in (``te_standin``) and runs:

* TE's quantized sequence-parallel gathers (MXFP8, FP8 block scaling, NVFP4): the stand-in's
  column-parallel ``Linear`` with an input quantizer gathers its input in backward through
  ``gather_along_first_dim(..., async_op=True, quantizer=...)``, which calls the coalesced helper
  exactly as TE v2.18 does (``te_standin/distributed.py``); the forward gather is synchronous. The
  site's parts are its inner gathers, so the plan's tuner table has a row per bin NCCL asks about.
* Megatron-FSDP: megatron-core 0.16.1's own ``MegatronFSDP`` (the copy ``--use-megatron-fsdp``
  uses), fully sharded, over two FSDP units and two root-level layers, with only its CUDA stream
  calls made no-ops (``coalesced_worker._CudaStreamsOnCpu``): per-unit gathers and
  reduce-scatters are sites with the simulator's ids, timed, and routed with identical gradients;
  and under the strategies without units (no_shard, optim, optim_grads), over two micro-batches:
  which collectives each issues per iteration, as the simulator's FSDP workload models them.
"""

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

from tests.timeouts import exit_after  # noqa: E402

from .coalesced_worker import worker  # noqa: E402

# Bytes one coalesced backward gather moves (2 ranks, 128 x 128 per rank, column-wise usage only):
# MXFP8: data [256, 128] uint8 + scale-inverses [ru(256 / 32, 4), ru(128, 128)] = [8, 128] uint8;
# FP8 1x128 blocks: transposed data [2 x 128, 128] uint8 + scale-inverses [256 / 128, ru(128, 4)] float32;
# NVFP4: transposed packed data [2 x 128, 64] uint8 + unpadded scale-inverses [2 x 128, 128 / 16] uint8.
GATHERED = {
    "MXFP8Quantizer": 256 * 128 + 8 * 128,
    "Float8BlockQuantizer": 256 * 128 + 2 * 128 * 4,
    "NVFP4Quantizer": 256 * 64 + 256 * 8,
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("coalesced")
    mp.spawn(exit_after, args=(worker, str(out / "store"), str(out)), nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("recipe", sorted(GATHERED))
def test_te_quantized_backward_gather_is_the_module_site(ranks, recipe):
    for r in ranks:
        rec = r[f"{recipe}_records"]
        # one site for the coalesced gather (data and scale-inverses), named like the plain-tensor one
        assert rec["tp.sp_all_gather[chunk0.fc1]"] == ["all_gather", GATHERED[recipe], 1, "tp", "uint8"]
        # the dgrad reduce-scatter of the same backward, a plain tensor: [256, 8] @ [8, 128] float32 in
        assert rec["tp.sp_reduce_scatter[chunk0.fc1]"] == ["reduce_scatter", 256 * 128 * 4, 1, "tp", "float32"]
        assert len(rec) == 2, rec  # the synchronous forward gather is not a site
        assert r[f"{recipe}_same_hooked"] and r[f"{recipe}_same_routed"]
        comm, comp, region = r[f"{recipe}_serialized"]["tp.sp_all_gather[chunk0.fc1]"]
        assert comm > 0 and comp >= 0 and region > 0
        comm, comp, region = r[f"{recipe}_overlapped"]["tp.sp_all_gather[chunk0.fc1]"]
        assert math.isnan(comp) and region > 0  # timed as an overlapped call


# NCCL's bins of those gathers: each enqueued as int8 bytes (v2.30.7 src/enqueue.cc:2733-2737), sorted by size and
# aggregated while under 4x the smallest (:405-441), one getCollInfo per aggregate with its output bytes (:2127-2147).
# Scale-inverses and data are 32x (MXFP8, FP8 blocks) and 8x (NVFP4) apart: never aggregated, two tuner calls.
NCCL_BINS = {
    "MXFP8Quantizer": [8 * 128, 256 * 128],
    "Float8BlockQuantizer": [2 * 128 * 4, 256 * 128],
    "NVFP4Quantizer": [256 * 8, 256 * 64],
}


def _tuner_rows(parts, nbytes):
    """The extended tuner rows of a plan that tunes one TP all-gather site recorded with ``parts``."""
    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.engine.plan import Plan, PlanEntry
    from lagom_megatron.nccl.export import tuner_rows

    cfg = CommConfig(algorithm="Ring", protocol="Simple", n_channels=4)
    entry = PlanEntry(
        config=cfg,
        predicted_t_comm_us=1.0,
        predicted_t_region_us=1.0,
        group="tp",
        op="all_gather",
        nbytes=nbytes,
        group_size=2,
        parts=tuple(map(tuple, parts)),
    )
    return tuner_rows(Plan(entries={"tp.sp_all_gather[chunk0.fc1]": entry}), extended=True)


@pytest.mark.parametrize("recipe", sorted(GATHERED))
def test_te_quantized_gather_gets_a_tuner_row_per_nccl_bin(ranks, recipe):
    for r in ranks:
        parts = r[f"{recipe}_parts"]
        assert sum(b for _, b in parts) == GATHERED[recipe]  # the inner gathers, in TE's order: scales, then data
        assert [b for _, b in parts] == NCCL_BINS[recipe]
        rows = _tuner_rows(parts, GATHERED[recipe])
        # min_bytes = max_bytes = the bytes NCCL's tuner is asked with; never the site's total
        assert sorted(int(row.cells[1]) for row in rows) == NCCL_BINS[recipe]
        assert all(row.cells[1] == row.cells[2] and row.cells[0] == "allgather" for row in rows)
        assert all(row.sites == ("tp.sp_all_gather[chunk0.fc1]",) and row.cells[-1] == "tp" for row in rows)


def test_te_gather_of_both_usages_is_two_nccl_bins_of_two_tasks_each(ranks):
    """Row- and column-wise MXFP8 (128 x 128 per rank, 2 ranks): scale-inverses [256, 4] and [8, 128] uint8 (1,024 bytes
    each), data [256, 128] twice. NCCL aggregates the two scales (1,024 < 4 x 1,024) and the two data (32,768 < 4 x
    32,768), not across (32,768 >= 4 x 1,024): two tuner calls, 2,048 and 65,536 bytes."""
    for r in ranks:
        op, nbytes, calls, parts, same = r["both_usages"]
        assert (op, nbytes, calls, same) == ("all_gather", 2 * 1024 + 2 * 32768, 1, True)
        assert parts == [["uint8", 1024], ["uint8", 32768], ["uint8", 1024], ["uint8", 32768]]
        assert sorted(int(row.cells[1]) for row in _tuner_rows(parts, nbytes)) == [2048, 65536]


@pytest.mark.parametrize("recipe", sorted(GATHERED))
def test_te_quantized_gather_routes_the_manager_and_every_inner_call(ranks, recipe):
    for r in ranks:
        assert r[f"{recipe}_routed_calls"] == 1
        seen = r[f"{recipe}_routed_groups"]
        # forward: the synchronous gather on TP itself; backward: the manager and its 2 inner
        # gathers (column-wise data and scale-inverses) all on the pool entry of "tp"
        assert seen[0] == ["manager", "tp", True], seen
        assert seen[3:] == [["manager", "tp", False], ["all_gather", "tp", False], ["all_gather", "tp", False]], seen


def test_every_coalesced_entry_point_was_patched(ranks):
    patched = set(ranks[0]["patched"])
    names = [
        f"tests.megatron.te_standin.distributed.{name}"
        for name in ("_all_gather_mxfp8", "_all_gather_nvfp4", "_start_all_gather_fp8_blockwise")
    ]
    names += [
        "AllGatherPipeline.all_gather_params",
        "AllGatherPipeline.async_bucket_gather",
        "GradReducePipeline._bucket_group_gradient_reduce",
        "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer._coalescing_manager",
    ]
    for name in names:
        assert name in patched, sorted(patched)


def test_megatron_fsdp_unit_gathers_and_reduce_scatters_are_sites(ranks):
    # the gradients compared below: each rank's shards of the 72 + 72 + 108 parameters, together all of them
    assert sum(r["mfsdp_grad_shard"][0] for r in ranks) == 72 + 72 + 108
    assert all(r["mfsdp_grad_shard"][1] > 0 for r in ranks)
    for r in ranks:
        # bucket 0: the two root-level linears (outside every unit), buckets 1-2: the units, whose
        # tags count in backward order (the last unit is bucket0), as the simulator's FSDP workload
        assert [u for u, _ in r["mfsdp_groups"]] == [None, 0, 1]
        assert r["mfsdp_tags"] == ["chunk0.root_bucket0", "chunk0.bucket1", "chunk0.bucket0"]
        size = {tag: n * 4 for tag, (_, n) in zip(r["mfsdp_tags"], r["mfsdp_groups"])}  # fp32 bucket bytes
        rec = r["mfsdp_records"]
        # a unit's parameters are gathered in forward (prefetched) and again in backward; the root
        # bucket once (it is not freed until the optimizer step); every bucket group's gradients are
        # reduce-scattered once per micro-batch. Bytes: the whole bucket, as Megatron-FSDP sized it.
        for tag, gathers in (("chunk0.bucket0", 2), ("chunk0.bucket1", 2), ("chunk0.root_bucket0", 1)):
            assert rec[f"dp.param_all_gather[{tag}]"] == ["all_gather", size[tag], gathers, "dp", "float32"]
            assert rec[f"dp.grad_reduce_scatter[{tag}]"] == ["reduce_scatter", size[tag], 1, "dp", "float32"]
        assert len(rec) == 6, rec
        assert r["mfsdp_same_hooked"]
        timings = r["mfsdp_timings"]
        assert set(timings) == set(rec)
        for tag in size:
            comm, comp, region = timings[f"dp.param_all_gather[{tag}]"]
            assert comm > 0 and math.isnan(comp) and region >= comm  # overlapped: waited by the consumer
            comm, comp, region = timings[f"dp.grad_reduce_scatter[{tag}]"]
            assert comm > 0 and comp == 0.0  # synchronous on its stream


def test_megatron_fsdp_sites_are_routed_with_the_same_gradients(ranks):
    for r in ranks:
        # routed: the gather of unit bucket1 (forward and backward) and the reduce-scatter of bucket0
        assert r["mfsdp_routed_calls"] == 3
        managers = r["mfsdp_routed_managers"]
        # 5 gathers (3 in forward, 2 in backward) and 3 reduce-scatters, each its own manager; the 3
        # routed ones were opened on the pool entry of "dp", every other on dp itself
        assert len(managers) == 8 and {name for name, _ in managers} == {"dp"}
        assert sum(1 for _, own in managers if not own) == 3, managers
        assert r["mfsdp_same_routed"] and r["mfsdp_groups_restored"]


def test_megatron_fsdp_over_one_rank_has_no_sites(ranks):
    for r in ranks:
        assert r["mfsdp_solo_records"] == {}


@pytest.mark.parametrize(
    "strategy, gathers, reduce_name, reduces",
    [
        ("no_shard", 0, "grad_all_reduce", 1),  # no gathers; all-reduced in the last micro-batch only
        ("optim", 1, "grad_reduce_scatter", 1),  # gathered once per iteration; reduced in the last micro-batch
        ("optim_grads", 1, "grad_reduce_scatter", 2),  # gathered once per iteration; reduced in every micro-batch
    ],
)
def test_megatron_fsdp_strategies_without_units_issue_what_the_simulator_models(
    ranks, strategy, gathers, reduce_name, reduces
):
    """Two micro-batches (the first under no_sync) of four linears, one bucket each (72 fp32 elements): the
    per-iteration calls of sim/workload_fsdp.py's no_shard / optim / optim_grads."""
    tags = [f"chunk0.root_bucket{j}" for j in range(4)]
    for r in ranks:
        assert r[f"mfsdp_{strategy}_tags"] == tags
        # each bucket holds one linear's 72 elements, padded to 80 when sharded (DP 2 x chunk factor 8)
        assert r[f"mfsdp_{strategy}_sizes"] == [72 if strategy == "no_shard" else 80] * 4
        nbytes = r[f"mfsdp_{strategy}_sizes"][0] * 4
        expected = {
            f"dp.{reduce_name}[{t}]": [reduce_name.split("_", 1)[1], nbytes, reduces, "dp", "float32"] for t in tags
        }
        if gathers:
            expected.update(
                {f"dp.param_all_gather[{t}]": ["all_gather", nbytes, gathers, "dp", "float32"] for t in tags}
            )
        assert r[f"mfsdp_{strategy}_records"] == expected


def test_megatron_fsdp_hsdp_sites_are_on_the_group_the_collectives_run_on(ranks):
    """megatron-core 0.17+ HSDP (``mfsdp_standin``): the gathers and reduce-scatters run on the
    DP-Shard group of the helper buffers, not on the whole-DP group of the model buffers."""
    for r in ranks:
        rec = r["hsdp_records"]
        for tag in ("chunk0.bucket0", "chunk0.bucket1"):  # forward and backward gathers of 8 floats; 1 reduce-scatter
            assert rec[f"intra_dist_opt.param_all_gather[{tag}]"] == ["all_gather", 32, 2, "intra_dist_opt", "float32"]
            assert rec[f"intra_dist_opt.grad_reduce_scatter[{tag}]"] == [
                "reduce_scatter",
                32,
                1,
                "intra_dist_opt",
                "float32",
            ]
        assert len(rec) == 4, rec  # the outer group's reduce-scatters are not sites
        assert r["hsdp_same_hooked"]


def test_megatron_fsdp_hsdp_routing_moves_every_collective_of_the_site(ranks):
    own, entry = ["intra_dist_opt", True], ["intra_dist_opt", False]
    outer = ["outer", True]
    for r in ranks:
        assert r["hsdp_routed_calls"] == 3  # unit 1's gathers (forward, backward), unit 0's reduce-scatter
        seen = r["hsdp_seen"]
        # forward and backward gathers: unit 0 (bucket1) on its own group, unit 1 (bucket0) with the
        # manager and its gather, of the transposed buffer in backward too, on the pool entry
        gathers = [["manager"] + own, ["all_gather"] + own, ["manager"] + entry, ["all_gather"] + entry]
        assert seen[:8] == gathers * 2, seen
        assert seen[8:] == [
            ["manager"] + entry,
            ["reduce_scatter"] + entry,
            ["manager"] + outer,
            ["reduce_scatter"] + outer,
            ["manager"] + own,
            ["reduce_scatter"] + own,
            ["manager"] + outer,
            ["reduce_scatter"] + outer,
        ], seen
        assert r["hsdp_same_routed"] and r["hsdp_groups_restored"]
