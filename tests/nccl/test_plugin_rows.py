"""The exported tuner rows match the calls NCCL makes, driven through the real plugin library as NCCL
loads and calls it (``test_plugin_status.DRIVER``: ``init`` with ``comm->nRanks`` and ``comm->nNodes``,
then ``getCollInfo`` per call):

* a DDP bucket group mixing dtypes and sizes (megatron-core's ``--fp8-param-gather``: uint8 and
  bf16 buckets in one group): NCCL asks ``getCollInfo`` once per (dtype, within-4x) aggregate of its
  tasks (NVIDIA/nccl v2.30.7 ``src/enqueue.cc:405-441``), each with the aggregate's bytes; the export
  writes one row per aggregate and every one of those calls matches;
* multi-node NVLink (GB200 NVL72 class): NCCL counts an NVLink domain as one node
  (``src/init.cc:1285-1297``) and passes that to ``init``; rows carry nNodes -1, so a group spanning
  two hosts of one domain still matches, and NVLS across those hosts stays in the domain.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.nccl.export import export_plan, tuner_rows
from lagom_megatron.nccl.plugin import build_tuner
from lagom_megatron.nccl.rules import NcclRules
from lagom_megatron.nccl.validate import nccl_bins

from .test_plugin_status import _drive

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="gcc is not installed: the tuner plugin is built with gcc"
)

ALLGATHER, ALLREDUCE = 2, 4  # ncclFunc_t
MIB = 1 << 20


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_tuner(tmp_path_factory.mktemp("tuner_rows"))


def _entry(config, *, op="all_gather", nbytes, parts=(), group="dp", group_size=8, n_nodes=1):
    return PlanEntry(
        config=config,
        predicted_t_comm_us=1.0,
        predicted_t_region_us=1.0,
        group=group,
        op=op,
        nbytes=nbytes,
        group_size=group_size,
        n_nodes=n_nodes,
        parts=tuple(parts),
    )


def test_nccl_bins_aggregate_within_4x_per_dtype():
    # a reduce-scatter's bf16 buckets 4, 8 and 20 MiB: 8 < 4 x 4 joins the first, 20 >= 16 starts a
    # new aggregate; its fp32 bucket is a bin of its own (function, reduction, dtype: enqueue.cc:405-416)
    parts = [("float32", 64 * MIB), ("bfloat16", 20 * MIB), ("bfloat16", 4 * MIB), ("bfloat16", 8 * MIB)]
    assert nccl_bins(parts, nbytes=96 * MIB, op="reduce_scatter") == [64 * MIB, 12 * MIB, 20 * MIB]
    assert nccl_bins((), nbytes=5) == [5]


def test_an_all_gathers_tensors_share_one_bin_whatever_their_dtype():
    """NCCL enqueues an all-gather (and a broadcast) as bytes: ``datatype = ncclInt8``, ``count *=
    elementSize`` (NVIDIA/nccl v2.30.7 ``src/enqueue.cc:2733-2737``; v2.27.7 ``:2360-2362``), so the uint8
    and bf16 buckets of an FP8 parameter gather are one (function, reduction, dtype) bin: 4 + 8 MiB,
    then 32 + 64 MiB (64 < 4 x 32)."""
    parts = [("uint8", 64 * MIB), ("bfloat16", 4 * MIB), ("bfloat16", 8 * MIB), ("bfloat16", 32 * MIB)]
    assert nccl_bins(parts, nbytes=108 * MIB, op="all_gather") == [12 * MIB, 96 * MIB]
    assert nccl_bins(parts, nbytes=108 * MIB, op="reduce_scatter") == [64 * MIB, 12 * MIB, 32 * MIB]


def test_nccl_bins_walk_the_sorters_order_not_an_exact_sort():
    """NCCL's task sorter keeps 4 bins per power of two of a task's traffic bytes from 1 KiB to 1 GiB
    (``ncclTaskCollSorterInsert``, NVIDIA/nccl v2.30.7 ``src/include/comm.h:361-409``: ``u32fpEncode``
    with 2 bits, ``src/include/bitops.h:470-479``), newest first inside a bin, and ``ncclPrepareTasks``
    reverses the list per (function, reduction, dtype) (``src/enqueue.cc:405-416``): tasks of one
    sorter bin come in the order they were issued. So a group issuing 1100 KiB, 1030 KiB (the same
    bin: 1024-1279 KiB) and 4200 KiB starts its aggregate at 1100 KiB, and 4200 < 4 x 1100 joins it:
    one getCollInfo of 6330 KiB, where an exact sort would start at 1030 and split 4200 off."""
    kib = 1024
    parts = [("bfloat16", 1100 * kib), ("bfloat16", 1030 * kib), ("bfloat16", 4200 * kib)]
    assert nccl_bins(parts, nbytes=6330 * kib, op="all_gather") == [6330 * kib]
    # an all-reduce's traffic is twice its bytes (ncclFuncTrafficPerByte, enqueue.cc:91-102): 1030 KiB
    # and 1100 KiB are 2060 and 2200 KiB of traffic, again one bin (2048-2559 KiB)
    assert nccl_bins(parts, nbytes=6330 * kib, op="all_reduce") == [6330 * kib]
    # issued the other way round, the smaller one leads and 4200 >= 4 x 1030 starts a new aggregate
    assert nccl_bins([parts[1], parts[0], parts[2]], nbytes=6330 * kib, op="all_gather") == [2130 * kib, 4200 * kib]
    # from 1 GiB of traffic on every task shares the last bin: issue order decides (a 5 GiB task
    # leads and the 1 GiB one, below a quarter of it, joins; sorted, 1 GiB would lead and 5 GiB split off)
    gib = 1 << 30
    assert nccl_bins([("float32", 5 * gib), ("float32", 1 * gib)], nbytes=6 * gib, op="all_reduce") == [6 * gib]


def test_a_mixed_bucket_group_gets_one_row_per_nccl_bin_and_every_call_matches(lib, tmp_path):
    parts = [("uint8", 64 * MIB), ("bfloat16", 4 * MIB), ("bfloat16", 8 * MIB), ("bfloat16", 32 * MIB)]
    bins = nccl_bins(parts, nbytes=sum(b for _, b in parts), op="all_gather")
    assert bins == [12 * MIB, 96 * MIB]  # an all-gather's tensors are one bin of bytes
    plan = Plan(
        entries={
            "dp.param_all_gather[chunk0.bucket3]": _entry(
                CommConfig(n_channels=6, protocol="Simple"), nbytes=108 * MIB, parts=parts
            )
        }
    )
    rows = tuner_rows(plan, extended=True)
    assert sorted(int(r.cells[1]) for r in rows) == sorted(bins)
    table = tmp_path / "table.csv"
    table.write_text(export_plan(plan, "nccl-tuner-csv", extended=True))
    # NCCL's order: the bin walked from its smallest task up (enqueue.cc:405-441)
    out = _drive(lib, table, "dp/plugin_x", [[ALLGATHER, 12 * MIB], [ALLGATHER, 96 * MIB]])
    assert out["channels"] == [6, 6] and out["after"][2] == [1, 1]
    # the site's summed bytes alone (what a single row held) match no call NCCL makes
    single = Plan(entries={"x": _entry(CommConfig(n_channels=6, protocol="Simple"), nbytes=108 * MIB)})
    table.write_text(export_plan(single, "nccl-tuner-csv", extended=True))
    out = _drive(lib, table, "dp/plugin_x", [[ALLGATHER, 12 * MIB], [ALLGATHER, 96 * MIB]])
    assert out["channels"] == [0, 0]


def test_sites_sharing_a_bin_share_one_decision():
    rules = NcclRules(ClusterSpec.load("h100-sxm-ib400"))
    a = CollectiveSite(
        site_id="dp.a[0]",
        op="reduce_scatter",
        nbytes=16 * MIB,
        dtype="bfloat16",
        group="dp",
        group_size=8,
        reduce_op="sum",
        parts=(("float32", 12 * MIB), ("bfloat16", 4 * MIB)),
    )
    b = CollectiveSite(
        site_id="dp.b[0]",
        op="reduce_scatter",
        nbytes=4 * MIB,
        dtype="bfloat16",
        group="dp",
        group_size=8,
        reduce_op="sum",
    )
    assert rules.call_keys(a) == [("dp", "reduce_scatter", 12 * MIB), ("dp", "reduce_scatter", 4 * MIB)]
    assert set(rules.call_keys(a)) & set(rules.call_keys(b))  # one getCollInfo key: tied by the search
    assert "2 tuner rows, one per NCCL bin" in rules.site_domains(a)[1]


def test_rows_match_the_node_count_nccl_passes_on_multi_node_nvlink(lib, tmp_path):
    """A tensor-parallel group of 8 over two 4-GPU hosts of one 72-GPU NVLink domain: the plan says
    2 nodes (hosts), NCCL initialises the plugin with nNodes 1 (one domain)."""
    nvl72 = dataclasses.replace(
        ClusterSpec.load("h100-sxm-ib400"),
        name="nvl72",
        gpus_per_node=4,
        nvlink_domain_gpus=72,
        sm_arch=100,
        nccl_version="2.30.7",
    )
    assert nvl72.nccl_nodes(2, 8) == 1 and nvl72.nccl_nodes(36, 144) == 2
    plan = Plan(
        entries={
            "tp.sp_all_gather[0]": _entry(
                CommConfig(n_channels=8, protocol="Simple"), nbytes=32 * MIB, group="tp", n_nodes=2
            )
        }
    )
    (row,) = tuner_rows(plan, extended=True)
    assert row.cells[6] == "-1"  # nNodes: any
    table = tmp_path / "table.csv"
    table.write_text(export_plan(plan, "nccl-tuner-csv", extended=True))
    out = _drive(lib, table, "tp/plugin_x", [[ALLGATHER, 32 * MIB], [ALLREDUCE, 32 * MIB]], n_ranks=8, n_nodes=1)
    assert out["channels"] == [8, 0] and out["after"][2] == [1]
    # NVLS across the two hosts: one NVLink domain to NCCL, so it stays in the domain there
    d = NcclRules(nvl72).domains(op="all_reduce", n_nodes=2, group_size=8)
    assert "NVLS" in d["algorithm"] and "NVLSTree" not in d["algorithm"]
    # 144 ranks on 36 hosts are two NVLink domains: NVLS across them needs CollNet (src/enqueue.cc:2008)
    assert "NVLS" not in NcclRules(nvl72).domains(op="all_reduce", n_nodes=36, group_size=144)["algorithm"]
    # 64 ranks of one domain: NCCL runs NVLS for no function but all-reduce above NCCL_MAX_NVLS_ARITY = 32
    # local ranks (src/enqueue.cc:2004-2006, src/include/device.h:213)
    assert "NVLS" in NcclRules(nvl72).domains(op="all_reduce", n_nodes=16, group_size=64)["algorithm"]
    assert "NVLS" not in NcclRules(nvl72).domains(op="all_gather", n_nodes=16, group_size=64)["algorithm"]
    assert "NVLS" in NcclRules(nvl72).domains(op="all_gather", n_nodes=8, group_size=32)["algorithm"]
