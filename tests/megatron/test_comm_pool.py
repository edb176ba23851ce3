"""Communicator pool on gloo: worker threads of pool entries, chunked collectives keep numerics.

Two processes with a FileStore in tmp_path (no port); each writes its findings to a JSON file
that the test reads back.
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.megatron.pool.gloo import GlooPoolBackend, MultiWork, gloo_threads, piece_ranges
from tests.timeouts import exit_after  # noqa: E402

WORLD = 2


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from lagom_megatron.megatron.hooks.sites import GroupNames
    from lagom_megatron.megatron.pool.comm_pool import CommPool, make_pool_backend
    from lagom_megatron.megatron.pool.gloo import chunked_call

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    out: dict = {}
    cpu = torch.device("cpu")
    out["default_threads"] = dist.group.WORLD._get_backend(cpu).options._threads
    groups = GroupNames(local_world_size=WORLD)
    dp = groups.add("dp", dist.new_group([0, 1]))
    pool = CommPool(make_pool_backend("gloo"), groups)
    created = pool.prepare(
        {"dp": {CommConfig(n_channels=3), CommConfig(n_channels=2, chunk_size=64), CommConfig(chunk_size=32)}}
    )
    out["created"] = created
    entry = pool.group_for(dp, CommConfig(n_channels=3))
    out["entry_threads"] = entry._get_backend(cpu).options._threads
    out["entry_ranks"] = dist.get_process_group_ranks(entry)
    out["entry_name"] = groups.lookup(entry).name
    out["two_threads_entry"] = pool.group_for(dp, CommConfig(n_channels=2, chunk_size=64)) is None
    out["restored"] = c10d.ProcessGroupGloo.__name__ == "ProcessGroupGloo" and not hasattr(
        c10d.ProcessGroupGloo, "__wrapped__"
    )
    try:
        pool.group_for(dp, CommConfig(n_channels=5))
    except KeyError as exc:
        out["missing_entry_error"] = str(exc)

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1000, generator=gen)
    # all-reduce: 1000 floats in 96-byte pieces (24 elements, last piece shorter), async
    ref = x.clone()
    dist.all_reduce(ref, group=entry)
    got = x.clone()
    h = chunked_call("all_reduce", dist.all_reduce, (got,), {"group": entry, "async_op": True}, 96, WORLD)
    out["ar_multiwork"] = isinstance(h, MultiWork) and len(h.works) == 42
    h.wait()
    out["ar_equal"] = torch.equal(ref, got)
    # reduce-scatter of a (2*6, 50) input to (6, 50), synchronous, 120-byte pieces
    inp = torch.randn(12, 50, generator=gen)
    ref = torch.empty(6, 50)
    dist.reduce_scatter_tensor(ref, inp, group=entry)
    got = torch.empty(6, 50)
    assert chunked_call("reduce_scatter", dist.reduce_scatter_tensor, (got, inp), {"group": entry}, 120, WORLD) is None
    out["rs_equal"] = torch.equal(ref, got)
    # all-gather of 300 floats into 600, async, copy-back after wait
    shard = torch.randn(300, generator=gen)
    ref = torch.empty(600)
    dist.all_gather_into_tensor(ref, shard, group=entry)
    got = torch.empty(600)
    chunked_call(
        "all_gather", dist.all_gather_into_tensor, (got, shard), {"group": entry, "async_op": True}, 400, WORLD
    ).wait()
    out["ag_equal"] = torch.equal(ref, got)
    # inside a coalescing manager (how DDP bucket groups issue): all-reduce and reduce-scatter pieces
    buf = x.clone()
    with c10d._coalescing_manager(entry, async_ops=True) as cm:
        chunked_call("all_reduce", dist.all_reduce, (buf,), {"group": entry, "async_op": True}, 400, WORLD)
    cm.wait()
    ref = x.clone()
    dist.all_reduce(ref, group=entry)
    out["coalesced_ar_equal"] = torch.equal(ref, buf)
    big = torch.randn(2000, generator=gen)
    ref = torch.empty(1000)
    dist.reduce_scatter_tensor(ref, big, group=entry)
    got = torch.empty(1000)
    with c10d._coalescing_manager(entry, async_ops=True) as cm:
        chunked_call(
            "reduce_scatter", dist.reduce_scatter_tensor, (got, big), {"group": entry, "async_op": True}, 1024, WORLD
        )
    cm.wait()
    out["coalesced_rs_equal"] = torch.equal(ref, got)
    with gloo_threads(4):
        g4 = dist.new_group([0, 1])
    out["ctx_threads"] = g4._get_backend(cpu).options._threads
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool")
    mp.start_processes(exit_after, args=(_worker, str(tmp / "store"), str(tmp)), nprocs=WORLD, start_method="spawn")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_pool_entries_get_their_threads(results):
    for r in results:
        assert r["default_threads"] == GlooPoolBackend.DEFAULT_THREADS
        assert r["created"] == 1, (
            "only n_channels=3 needs an entry (2 threads = the group's own; chunk_size is per call)"
        )
        assert r["entry_threads"] == 3 and r["entry_ranks"] == [0, 1] and r["entry_name"] == "dp"
        assert r["two_threads_entry"] and r["restored"]
        assert "no communicator-pool entry for group 'dp'" in r["missing_entry_error"]
        assert r["ctx_threads"] == 4


def test_chunked_collectives_are_bit_identical(results):
    for r in results:
        for key in ("ar_multiwork", "ar_equal", "rs_equal", "ag_equal", "coalesced_ar_equal", "coalesced_rs_equal"):
            assert r[key] is True, f"{key}: got {r[key]} on a rank"


def test_piece_ranges_and_bad_values():
    assert piece_ranges(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert piece_ranges(0, 4, 12) == [(0, 0)]
    with pytest.raises(ValueError, match=r"chunk_size \(2 bytes\) is smaller than one element \(4 bytes\)"):
        piece_ranges(10, 4, 2)
    with pytest.raises(ValueError, match="gloo n_channels .* must be in 1..16; got 0"):
        GlooPoolBackend().entry_key(CommConfig(n_channels=0))


def test_gloo_threads_rejects_bad_values_and_restores():
    from torch.distributed import distributed_c10d as c10d

    original = c10d.ProcessGroupGloo
    with pytest.raises(ValueError, match="gloo worker threads must be >= 1; got 0"):
        with gloo_threads(0):
            pass
    with gloo_threads(3):
        assert c10d.ProcessGroupGloo is not original and issubclass(c10d.ProcessGroupGloo, original)
    assert c10d.ProcessGroupGloo is original
