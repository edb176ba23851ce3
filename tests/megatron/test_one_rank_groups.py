"""A group of one rank is never a site, on every path the router handles.

Each case calls the router as the hooked code does (the argument layouts are those of
megatron-core 0.16.1, Transformer Engine v2.18 and torch 2.13, cited in the router's modules),
once on a group of two ranks (a site: recorded) and once on a group of one rank with a
configuration assigned to the site it would have had: the call must reach the original with
its own group, and nothing is recorded, routed or handed to the pool.
"""

import types

import pytest

torch = pytest.importorskip("torch")

from lagom_megatron.engine.knobs import CommConfig  # noqa: E402
from lagom_megatron.megatron.hooks.profiler import Profiler  # noqa: E402
from lagom_megatron.megatron.hooks.router import SiteRouter  # noqa: E402
from lagom_megatron.megatron.hooks.sites import GroupInfo, GroupNames, SiteRegistry  # noqa: E402

CFG = CommConfig(n_channels=3)


class Pool:
    """Pool entry ``("entry", name)`` for any config; counts the lookups."""

    def __init__(self):
        self.lookups = 0

    def group_for(self, info, cfg):
        self.lookups += 1
        return ("entry", info.name)


def _router(*names_and_sizes):
    """A router whose groups are ``(name, size)``; returns it and the group objects by name."""
    names = GroupNames(local_world_size=2)
    groups = {}
    for name, size in names_and_sizes:
        groups[name] = types.SimpleNamespace(name=name)
        names.alias(groups[name], GroupInfo(name=name, ranks=tuple(range(size))))
    registry = SiteRegistry(names, num_microbatches=1)
    return SiteRouter(registry, Profiler(), Pool()), groups


def _assign_everything(router, site_ids):
    router.set_assignment({sid: CFG for sid in site_ids})


@pytest.mark.parametrize(
    "op,args",
    [
        (
            "all_gather",
            lambda g: ((torch.zeros(4), torch.zeros(2)), {"group": g, "async_op": True}),
        ),  # TP / FSDP gathers
        ("reduce_scatter", lambda g: ((torch.zeros(2), torch.zeros(4)), {"group": g, "async_op": True})),
        ("all_reduce", lambda g: ((torch.zeros(4),), {"group": g, "async_op": True})),  # TP dgrad all-reduce
        ("all_to_all", lambda g: ((torch.zeros(4), torch.zeros(4), None, None), {"group": g, "async_op": True})),  # EP
    ],
)
def test_collectives_on_a_one_rank_group_pass_straight_through(op, args):
    router, groups = _router(("tp", 2), ("solo", 1))
    seen = []

    def original(*a, **k):
        seen.append(k["group"])
        return "work"

    router.registry.start_iteration()
    _assign_everything(router, ["solo.async_" + op + "[0]", "solo.sp_all_gather[0]", "solo.sp_reduce_scatter[0]"])
    a, k = args(groups["solo"])
    assert router.collective(op, original, a, dict(k)) == "work"
    assert seen[-1] is groups["solo"] and router.calls_routed == 0 and router.pool.lookups == 0
    assert router.registry.records == {}
    # the two-rank group is a site (recorded) on the same path
    a, k = args(groups["tp"])
    router.collective(op, original, a, dict(k))
    assert [r.group.name for r in router.registry.records.values()] == ["tp"]


def test_a_named_scope_on_a_one_rank_group_has_no_site():
    """FSDP2 units (``patches.named_method``, synchronous calls tagged) and TE modules alike."""
    router, groups = _router(("dp", 1))
    router.registry.start_iteration()
    with router.named("decoder.layers.0", prefix="fsdp", tag_sync=True):
        router.collective("all_gather", lambda *a, **k: None, (torch.zeros(4), torch.zeros(4)), {"group": groups["dp"]})
    assert router.registry.records == {} and router.registry.sites() == []


class _Bucket:
    def __init__(self):
        self.grad_data = torch.zeros(8)
        self.param_data = torch.zeros(8)


class _BucketGroup:
    """The attributes ``bucket_sync`` reads, as megatron-core 0.16.1 ``_ParamAndGradBucketGroup`` has them."""

    def __init__(self, dp):
        self.buckets = [_Bucket()]
        self.ddp_config = types.SimpleNamespace(use_distributed_optimizer=False)
        self.data_parallel_group = dp
        self.intra_distributed_optimizer_instance_group = dp
        self.is_first_batch = False
        self.grad_reduce_handle = None
        self.param_gather_handle = None


def test_ddp_buckets_of_data_parallel_one_are_never_sites():
    """The reported case: DP = 1 gave ``dp.grad_all_reduce[chunk0.bucket0]`` with group_size 1."""
    for size, want in ((2, ["dp.grad_all_reduce[chunk0.bucket0]"]), (1, [])):
        router, groups = _router(("dp", size))
        bg = _BucketGroup(groups["dp"])
        router.registry.bind_model([types.SimpleNamespace(bucket_groups=[bg])])
        seen = []

        def start_grad_sync(self, *a, **k):
            seen.append(self.data_parallel_group)

        _assign_everything(router, ["dp.grad_all_reduce[chunk0.bucket0]"])
        router.registry.start_iteration()
        router.bucket_sync(bg, "grad", start_grad_sync, (), {})
        assert list(router.registry.records) == want
        assert router.calls_routed == len(want) and router.pool.lookups == len(want)
        assert seen == [("entry", "dp") if want else groups["dp"]]


def test_pipeline_and_context_parallel_p2p_of_one_rank_are_never_sites():
    router, groups = _router(("pp", 1), ("cp", 1))
    _assign_everything(router, ["pp.send_recv", "cp.ring_send_recv[0]"])
    router.registry.start_iteration()
    communicator = types.SimpleNamespace(
        pp_group=groups["pp"], config=types.SimpleNamespace(pipeline_dtype=torch.float32)
    )
    seen = []

    def communicate(comm, **kwargs):
        seen.append(comm.pp_group)
        return None, None, None

    router.p2p(communicator, communicate, {"tensor_send_next": torch.zeros(2), "tensor_shape": (2,)})
    # TE's flash_attn_p2p_communicate(rank, send_tensor, send_dst, recv_tensor, recv_src, cp_group, batch_p2p_comm)
    ring = router.ring_exchange(lambda *a: ["req"], (0, torch.zeros(2), 0, torch.zeros(2), 0, groups["cp"], True), {})
    assert seen == [groups["pp"]] and ring == ["req"]
    assert router.registry.records == {} and router.calls_routed == 0 and router.pool.lookups == 0


def test_the_layer_wise_optimizers_param_sync_is_never_a_site():
    # without the distributed optimizer, core_v0.19.0's param sync (layer-wise optimizer) has no param_data and
    # gathers uneven grad_data slices through torch's all_gather, which NCCL runs as grouped send/recv
    # (param_and_grad_buffer.py:404-473, :409-412): nothing lagom could tune or see as an all-gather
    router, groups = _router(("dp", 2))
    bg = _BucketGroup(groups["dp"])
    for b in bg.buckets:
        b.param_data = None
    router.registry.bind_model([types.SimpleNamespace(bucket_groups=[bg])])
    seen = []

    def start_param_sync(self, *a, **k):
        seen.append(self.data_parallel_group)

    _assign_everything(router, ["dp.param_all_gather[chunk0.bucket0]"])
    router.registry.start_iteration()
    router.bucket_sync(bg, "param", start_param_sync, (), {})
    assert list(router.registry.records) == [] and router.calls_routed == 0
    assert seen == [groups["dp"]]  # Megatron's own call, on its own group
