"""Ranks compare the tuner-row hit counts of shared communicators at train end (``megatron.hits``):
two gloo ranks with a stand-in for the plugin status. ``tp`` spans both ranks (one communicator:
its rows must count alike), ``dp`` is one rank each (two communicators: their counts may differ).
A mismatch is one warning naming the row and the ranks; a rank whose status read raises still
joins the all-gather (no hang) and nothing raises into training."""

import json

import pytest
import torch.multiprocessing as mp

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.nccl.plugin_status import PluginStatus, describe_mismatches, shared_hit_mismatches
from tests.timeouts import exit_after  # noqa: E402


def _entry(group, op, nbytes, gain):
    return PlanEntry(
        config=CommConfig(n_channels=4),
        predicted_t_comm_us=10.0,
        predicted_t_region_us=100.0 - gain,
        predicted_default_t_region_us=100.0,
        group=group,
        op=op,
        nbytes=nbytes,
        group_size=2,
        n_nodes=1,
    )


PLAN = Plan(
    entries={
        "tp.ar[0]": _entry("tp", "all_reduce", 4096, 30.0),
        "dp.rs[0]": _entry("dp", "reduce_scatter", 8192, 20.0),
    },
    fingerprint={},
    backend="nccl",
    mechanism="tuner",
)
"""Rows in file order: 1 = tp all-reduce (largest gain first), 2 = dp reduce-scatter."""

CASES = {  # name -> per rank: the row hits its stand-in reports (None: the read raises)
    "agree": [(5, 7), (5, 3)],  # dp differs, but dp is a different communicator on each rank
    "tp_differs": [(5, 7), (4, 7)],
    "read_fails": [(5, 7), None],
}


def _worker(rank, store_path, out_path):
    import os

    import torch.distributed as dist

    from lagom_megatron.megatron.control.observed import compare_shared_hits, log_plan_hits
    from lagom_megatron.megatron.hooks.sites import GroupNames

    os.environ["RANK"] = str(rank)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    groups = GroupNames(local_world_size=2)
    groups.add("tp", dist.new_group([0, 1]))
    dp = [dist.new_group([0]), dist.new_group([1])]
    groups.add("dp", dp[rank])
    out = {}
    for name, per_rank in CASES.items():
        hits = per_rank[rank]

        def reader(hits=hits):
            if hits is None:
                raise OSError("status unreadable")
            return PluginStatus(path="x", abi_version=6, init_count=3, row_hits=hits, table_loaded=True)

        out[name] = compare_shared_hits(PLAN, groups, status_reader=reader)
    out["logged"] = log_plan_hits(
        PLAN,
        groups,
        status_reader=lambda: PluginStatus(
            path="x", abi_version=6, init_count=3, row_hits=(rank + 1, 1), table_loaded=True
        ),
    )
    dist.barrier()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hits")
    mp.spawn(exit_after, args=(_worker, str(tmp / "store"), str(tmp / "out")), nprocs=2, join=True)
    return [json.loads((tmp / f"out.{r}").read_text()) for r in (0, 1)]


def test_members_of_one_communicator_compare_their_row_hits(results):
    r0, r1 = results
    assert r0["agree"] == r1["agree"] == []
    want = (
        "lagom: WARNING: ranks of one communicator matched tuner rows a different number of times, so NCCL "
        "may have chosen differently on them: row 1 (allreduce,4096-4096 B, group tp) rank 0: 5, rank 1: 4"
    )
    assert r0["tp_differs"] == r1["tp_differs"] == [want]
    # rank 1 left out, named with its error; nobody waits or raises
    assert (
        r0["read_fails"]
        == r1["read_fails"]
        == [
            "lagom: WARNING: tuner row hits not read, left out of the "
            "comparison across ranks: rank 1: OSError: status unreadable"
        ]
    )
    (logged,) = r0["logged"]
    assert r1["logged"] == [logged] and "row 1 (allreduce" in logged and "rank 0: 1, rank 1: 2" in logged


def test_mismatches_are_per_communicator_instance():
    """Four ranks, tp = {0,1} and {2,3}: counts differ between the two tp communicators (allowed)
    and inside {2,3} (reported); a rank without hits is left out."""
    tp = [(0, 1), (0, 1), (2, 3), (2, 3)]
    reports = [((9,), {"tp": tp[0]}), ((9,), {"tp": tp[1]}), ((4,), {"tp": tp[2]}), ((6,), {"tp": tp[3]})]
    assert shared_hit_mismatches(["tp"], reports) == [(0, {2: 4, 3: 6})]
    reports[3] = (None, {"tp": tp[3]})
    assert shared_hit_mismatches(["tp"], reports) == []
    assert shared_hit_mismatches(["dp"], reports) == []  # no rank reports a dp group
    assert describe_mismatches([], []) == ""
