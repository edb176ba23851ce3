"""SiteRouter on fake groups, pool and collectives: site ids, routing, chunking, profiler hand-off."""

import pytest

torch = pytest.importorskip("torch")

from lagom_megatron.engine.knobs import CommConfig  # noqa: E402
from lagom_megatron.megatron.hooks.profiler import Profiler  # noqa: E402
from lagom_megatron.megatron.hooks.router import SiteRouter  # noqa: E402
from lagom_megatron.megatron.hooks.sites import GroupInfo, GroupNames, SiteRegistry  # noqa: E402


class Pool:
    """Pool entry ``("entry", group name, n_channels)`` (None without n_channels); counts the lookups."""

    def __init__(self):
        self.lookups = 0

    def group_for(self, info, cfg):
        self.lookups += 1
        return ("entry", info.name, cfg.n_channels) if cfg.n_channels else None


class Clock:
    """A clock that counts its reads (seconds advance by 1 per read)."""

    def __init__(self):
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return float(self.reads)


class Work:
    def __init__(self):
        self.waits = 0

    def is_completed(self):
        return True

    def wait(self):
        self.waits += 1
        return True


def _router(num_microbatches=2, **kwargs):
    tp = object()
    names = GroupNames(local_world_size=2)
    names.alias(tp, GroupInfo(name="tp", ranks=(0, 1)))
    registry = SiteRegistry(names, num_microbatches=num_microbatches)
    clock = Clock()
    router = SiteRouter(registry, Profiler(clock=clock), Pool(), clock=clock, **kwargs)
    return router, registry, tp, clock


def _iteration(router, registry, calls, *, timed=False):
    registry.start_iteration()
    router.profiler.start_iteration(timed=timed)
    out = [call() for call in calls]
    registry.finish_iteration()
    return out


def test_routed_calls_swap_the_group_per_site_and_resolve_each_site_once():
    router, registry, tp, clock = _router()
    seen = []

    def all_gather(out, inp, group=None, async_op=False):
        seen.append(group)
        return "work"

    t = torch.zeros(4)
    calls = [
        lambda: router.collective("all_gather", all_gather, (t, t), {"group": tp, "async_op": True}),
        lambda: router.collective("all_gather", all_gather, (t, t, tp, True), {}),
    ] * 2
    _iteration(router, registry, calls)  # discovery: 4 calls / 2 micro-batches = period 2
    seen.clear()
    router.set_assignment({"tp.sp_all_gather[1]": CommConfig(n_channels=3)})
    for _ in range(2):
        assert _iteration(router, registry, calls) == ["work"] * 4
    entry = ("entry", "tp", 3)
    assert seen == [tp, entry, tp, entry] * 2  # site 1 by keyword and by position alike
    assert router.pool.lookups == 1  # one pool lookup for the one routed site
    assert router.calls_routed == 4
    assert {k: (r.calls, r.nbytes, r.dtype, r.op) for k, r in registry.records.items()} == {
        "tp.sp_all_gather[0]": (2, 16, "float32", "all_gather"),
        "tp.sp_all_gather[1]": (2, 16, "float32", "all_gather"),
    }
    assert clock.reads == 0  # profiler off: no clock read on the routed path
    router.set_assignment({"tp.sp_all_gather[0]": CommConfig(n_channels=2)})
    seen.clear()
    _iteration(router, registry, calls)
    assert seen == [("entry", "tp", 2), tp] * 2 and router.pool.lookups == 2


def test_synchronous_calls_outside_a_scope_pass_straight_through():
    router, registry, tp, _ = _router()
    router.set_assignment({"tp.sp_all_gather[0]": CommConfig(n_channels=3)})

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return ("done", group)

    registry.start_iteration()
    assert router.collective("all_reduce", all_reduce, (torch.zeros(2),), {"group": tp}) == ("done", tp)
    assert registry.records == {} and router.calls_routed == 0
    with router.scope("finalize_all_reduce", per_microbatch=False):
        assert router.collective("all_reduce", all_reduce, (torch.zeros(2),), {"group": tp}) == ("done", tp)
    assert list(registry.records) == ["tp.finalize_all_reduce[0]"]


def test_chunk_size_splits_the_tensor_and_all_to_all_is_never_split():
    router, registry, tp, _ = _router(num_microbatches=1)
    pieces = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        pieces.append((tensor.numel(), group))
        tensor.mul_(2)
        return Work()

    def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        pieces.append((input.numel(), group))
        return Work()

    t = torch.ones(10)
    registry.start_iteration()
    with router.scope("finalize_all_reduce", per_microbatch=False):
        router.collective("all_reduce", all_reduce, (t,), {"group": tp, "async_op": True}).wait()
    router.collective("all_to_all", all_to_all, (t, t), {"group": tp, "async_op": True})
    registry.finish_iteration()
    router.set_assignment(
        {"tp.finalize_all_reduce[0]": CommConfig(chunk_size=16), "tp.async_all_to_all[0]": CommConfig(chunk_size=16)}
    )
    pieces.clear()
    registry.start_iteration()
    with router.scope("finalize_all_reduce", per_microbatch=False):
        handle = router.collective("all_reduce", all_reduce, (t,), {"group": tp, "async_op": True})
    router.collective("all_to_all", all_to_all, (t, t), {"group": tp, "async_op": True})
    handle.wait()
    assert pieces == [(4, tp), (4, tp), (2, tp), (10, tp)]  # 16-byte pieces of 4 floats; all-to-all whole
    assert torch.equal(t, torch.full((10,), 4.0))  # every element reduced twice, once per iteration


def test_timed_iteration_hands_the_call_to_the_profiler():
    router, registry, tp, clock = _router(num_microbatches=1)
    work = Work()

    def all_gather(out, inp, group=None, async_op=False):
        return work

    t = torch.zeros(4)
    call = [lambda: router.collective("all_gather", all_gather, (t, t), {"group": tp, "async_op": True})]
    _iteration(router, registry, call)
    router.set_assignment({"tp.sp_all_gather[0]": CommConfig(n_channels=3)})
    (handle,) = _iteration(router, registry, call, timed=True)
    assert handle is not work and handle.wait() is True and work.waits == 1
    assert clock.reads > 0
    assert list(router.profiler.finish_iteration()) == ["tp.sp_all_gather[0]"]


def test_applied_plan_without_records_routes_the_same_calls():
    router, registry, tp, clock = _router()
    seen = []

    def all_gather(out, inp, group=None, async_op=False):
        seen.append(group)

    t = torch.zeros(4)
    calls = [lambda: router.collective("all_gather", all_gather, (t, t), {"group": tp, "async_op": True})] * 4
    _iteration(router, registry, calls)
    router.set_assignment({"tp.sp_all_gather[1]": CommConfig(n_channels=3)})
    seen.clear()
    registry.start_iteration(record=False)
    for call in calls:
        call()
    registry.finish_iteration()
    assert seen == [tp, ("entry", "tp", 3)] * 2
    assert registry.records == {} and router.calls_routed == 2 and clock.reads == 0


def test_a_call_inside_an_open_coalescing_manager_keeps_its_group_and_is_not_split():
    from torch.distributed import distributed_c10d as c10d

    router, registry, tp, clock = _router(split_chunks=True)
    seen = []

    def all_gather(out, inp, group=None, async_op=False):
        seen.append(group)
        return "work"

    t = torch.zeros(64)
    call = lambda: router.collective("all_gather", all_gather, (t, t), {"group": tp, "async_op": True})  # noqa: E731
    _iteration(router, registry, [call, call])
    router.set_assignment({"tp.sp_all_gather[0]": CommConfig(n_channels=3, chunk_size=64)})
    seen.clear()
    state = c10d._world.pg_coalesce_state  # what _coalescing_manager fills while it is open
    state[tp] = []
    try:
        _iteration(router, registry, [call, call])
    finally:
        del state[tp]
    assert seen == [tp, tp] and router.calls_routed == 0  # torch requires the manager's group
    _iteration(router, registry, [call, call])
    # outside it: routed, and each call split into pieces of 64 bytes (256-byte output, 2 ranks: 4 each)
    assert seen[2:] == [("entry", "tp", 3)] * 8 and router.calls_routed == 2
