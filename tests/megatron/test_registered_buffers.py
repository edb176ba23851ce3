"""DDP buffers registered with NCCL (``--use-nccl-ub``) stay registered for every call that uses them.

megatron-core allocates a bucket's buffers in an NCCL memory pool and registers it on the
data-parallel group (core_v0.16.1 ``param_and_grad_buffer.py:753-770``, ``nccl_allocator.py:163-182``:
``backend.register_mem_pool(pool, symm=...)``); core_v0.18.2 keeps the pool as
``_ParamAndGradBuffer.nccl_mem_pool`` (``:1066-1074``). A pool entry of that group registers the
same pool (``NcclPoolBackend.register_memory``); where megatron-core keeps no handle the sites stay
on their own communicator and the search leaves them to NCCL, with a note in the plan. The stand-ins
below carry exactly the attributes megatron-core's classes have at those tags."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch.multiprocessing as mp

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.problem import SearchProblem
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.megatron.hooks.sites import bucket_registration, registered_pools
from lagom_megatron.nccl.pool import NcclPoolBackend
from lagom_megatron.nccl.rules import NcclRules
from tests.timeouts import exit_after  # noqa: E402


def _buffer(group, *, pool, ub=True, symmetric_off=False):
    """A ``_ParamAndGradBuffer`` as core_v0.18.2 has it (``pool=None``: core_v0.16.1, no handle)."""
    buf = types.SimpleNamespace(
        nccl_ub=ub,
        data_parallel_group=group,
        ddp_config=types.SimpleNamespace(disable_symmetric_registration=symmetric_off),
    )
    if pool is not None:
        buf.nccl_mem_pool = pool
    return buf


def test_registered_pools_follow_megatron_cores_buffers():
    dp, ep_dp = object(), object()
    names = {id(dp): "dp", id(ep_dp): "ep_dp"}
    ddp = types.SimpleNamespace(
        buffers=[_buffer(dp, pool="pool-a"), _buffer(dp, pool="pool-b", symmetric_off=True)],
        expert_parallel_buffers=[_buffer(ep_dp, pool=None)],
    )
    pools = registered_pools([ddp], lambda g: names[id(g)])
    import torch

    # megatron-core registers symmetric windows only on torch 2.9+ (core_v0.16.1 nccl_allocator.py:111-122)
    symm = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)
    assert pools == {"dp": [("pool-a", symm), ("pool-b", False)]}  # ep_dp's pool is lost (core 0.16): left out
    bg = types.SimpleNamespace(ddp_config=types.SimpleNamespace(nccl_ub=True))
    assert bucket_registration(bg, [("pool-a", True), ("pool-b", False)]) == "symmetric"  # a symmetric window
    assert bucket_registration(bg, [("pool-b", False)]) == "pool"
    assert bucket_registration(bg, pools.get("ep_dp")) == "fixed"
    assert bucket_registration(types.SimpleNamespace(ddp_config=types.SimpleNamespace(nccl_ub=False)), None) == ""


def _site(registered):
    return CollectiveSite(
        site_id="dp.grad_reduce_scatter[chunk0.bucket0]",
        op="reduce_scatter",
        nbytes=256 << 20,
        dtype="bfloat16",
        group="dp",
        group_size=8,
        reduce_op="sum",
        registered=registered,
    )


def test_the_search_knows_which_registered_sites_it_can_move():
    rules = NcclRules(ClusterSpec.load("h100-sxm-ib400"))
    kept, note = rules.site_domains(_site("fixed"))
    assert all(v == (None,) for v in kept.values()) and "kept there" in note
    movable, note = rules.site_domains(_site("pool"))
    assert len(movable["n_channels"]) > 1 and "registers the same NCCL memory pool" in note
    sites = [_site("fixed"), dataclasses.replace(_site("pool"), site_id="dp.grad_reduce_scatter[chunk0.bucket1]")]
    model = CostModel.from_priors(sites, [1.0, 1.0], rules.cluster)
    problem = SearchProblem.from_model(model, rules=rules)
    st = problem.default_state()
    st.nc[:] = 4.0  # move both; the registered-only-on-its-own site cannot hold it
    plan = problem.make_plan(st, method="test", stats={})
    fixed, pool = plan.entries.values()
    assert fixed.tunable == () and fixed.config == CommConfig() and "kept there" in fixed.note
    assert "n_channels" in pool.tunable and pool.config.n_channels == 4
    assert json.loads(json.dumps(plan.to_dict()))["entries"][sites[0].site_id]["note"] == fixed.note


def test_symmetric_windows_leave_the_site_to_nccl_where_its_symmetric_kernels_take_the_call():
    """megatron-core registers its buffers as symmetric windows unless
    ``ddp_config.disable_symmetric_registration`` (core_v0.16.1 ``nccl_allocator.py:244-263``,
    torch 2.9+). NCCL runs a call whose send and receive buffers both lie in symmetric windows on its
    symmetric kernels and never asks the tuner plugin: NCCL 2.28+ for any call on an all-NVLink
    communicator (``ncclMakeSymmetricTaskList``, NVIDIA/nccl v2.28.9 ``src/enqueue.cc:360-362``,
    ``src/scheduler/symmetric_sched.cc:26-35``; v2.30.7 ``symmetric_sched.cc:66-215``), NCCL 2.27 for a
    single collective on one node (v2.27.7 ``src/enqueue.cc:338-360``). No row or entry bound reaches
    such a call, so the search leaves it to NCCL; elsewhere (PCIe, across nodes, 2.27's coalesced
    groups) the tuner is asked and the site is routed with its pool registered on the entry."""
    bg = types.SimpleNamespace(ddp_config=types.SimpleNamespace(nccl_ub=True))
    assert bucket_registration(bg, [("pool-a", True)]) == "symmetric"
    assert bucket_registration(bg, [("pool-a", False)]) == "pool"
    h100 = dataclasses.replace(ClusterSpec.load("h100-sxm-ib400"), nccl_version="2.27.5")  # NVSwitch; 2.27's rule
    one = _site("symmetric")
    two = dataclasses.replace(one, parts=(("bfloat16", 128 << 20), ("bfloat16", 128 << 20)))
    for cluster, site, movable in (
        (h100, one, False),  # 2.27: one collective, one node
        (h100, two, True),  # 2.27: a coalesced group asks the tuner
        (dataclasses.replace(h100, nccl_version="2.28.9"), two, False),  # 2.28+: every call
        (dataclasses.replace(h100, nccl_version="2.30.7"), dataclasses.replace(two, n_nodes=2, group_size=16), True),
        (ClusterSpec.load("a40-pcie-ib200"), one, True),
    ):  # PCIe: no symmetric kernels
        d, note = NcclRules(cluster).site_domains(site)
        assert (len(d["n_channels"]) > 1) is movable, (cluster.name, cluster.nccl_version, site.parts, site.n_nodes)
        if movable:
            assert "registers the same NCCL memory pool" in note
        else:
            assert all(v == (None,) for v in d.values()) and "symmetric kernels" in note


class _ProcessGroupNccl:
    """``ProcessGroupNCCL`` as torch binds ``register_mem_pool`` (init.cpp: ``pool``, ``symm=False``);
    ``old=True``: a torch whose binding has no ``symm`` yet."""

    def __init__(self, old=False):
        self.calls, self.old = [], old

    def register_mem_pool(self, pool, *args, **kwargs):
        if self.old and (args or kwargs):
            raise TypeError("register_mem_pool() got an unexpected keyword argument 'symm'")
        self.calls.append((pool, kwargs.get("symm")))


@pytest.mark.parametrize("old", [False, True], ids=["torch-with-symm", "torch-without-symm"])
def test_an_entry_registers_its_groups_pools_as_megatron_core_does(monkeypatch, old):
    import torch

    backend = _ProcessGroupNccl(old=old)
    entry = types.SimpleNamespace(_get_backend=lambda device: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    NcclPoolBackend(use_tuner_plugin=True).register_memory(entry, [("pool-a", True), ("pool-b", False)])
    assert backend.calls == ([("pool-a", None), ("pool-b", None)] if old else [("pool-a", True), ("pool-b", False)])


def _worker(rank, store_path, out_path):
    import torch.distributed as dist

    from lagom_megatron.megatron.hooks.sites import GroupNames
    from lagom_megatron.megatron.pool.comm_pool import CommPool
    from lagom_megatron.megatron.pool.gloo import GlooPoolBackend

    class Registering(GlooPoolBackend):
        """Gloo entries; registration recorded (gloo has no NCCL memory)."""

        calls: list = []

        def register_memory(self, group, pools):
            self.calls.append((type(group).__name__, list(pools)))

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    groups = GroupNames(local_world_size=1)
    groups.add("dp", dist.new_group([0]))
    groups.add("tp", dist.new_group([0]))
    pool = CommPool(Registering(), groups)
    pool.registered = {"dp": [("pool-a", True)]}
    pool.prepare({"dp": {CommConfig(n_channels=3)}, "tp": {CommConfig(n_channels=4)}})
    with open(out_path, "w") as f:
        json.dump({"calls": Registering.calls, "entries": len(pool)}, f)
    pool.destroy()
    dist.destroy_process_group()


def test_the_pool_registers_only_the_entries_of_the_registered_group(tmp_path):
    mp.spawn(exit_after, args=(_worker, str(tmp_path / "store"), str(tmp_path / "out.json")), nprocs=1, join=True)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["entries"] == 2 and out["calls"] == [["ProcessGroup", [["pool-a", True]]]]


def test_the_router_records_the_registration_of_a_bucket_groups_buffers():
    import torch

    from .test_first_use import _bucket_group
    from .test_router import _iteration, _router

    for pools, want in (
        (None, "fixed"),
        ({"tp": [("pool-a", False)]}, "pool"),
        ({"tp": [("pool-a", True)]}, "symmetric"),
    ):
        router, registry, tp, _ = _router()
        if pools:
            registry.registered_pools = pools
        bg = _bucket_group([torch.zeros(8)], nccl_ub=True, group=tp)
        registry._bucket_tags[id(bg)] = "chunk0.bucket0"
        _iteration(router, registry, [lambda: router.bucket_sync(bg, "grad", lambda self, **k: None, (), {})])
        (site,) = registry.sites()
        assert (site.registered, site.parts) == (want, ())  # one bucket: no parts
