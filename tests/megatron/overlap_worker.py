"""The two-process gloo worker of ``test_overlap_hooks.py``: TE stand-in, CP ring, PP overlap, MoE, FSDP2.

Each part runs the real hooks (``patches.install``) on a real gloo process group and a real
communicator pool, and writes what it saw to ``<out_dir>/rank<r>.json``.
"""

import json
import os
import time

import torch
import torch.distributed as dist

WORLD = 2
SLEEP = 0.03  # seconds of "compute" between posting requests and waiting them


def _iteration(router, fn, *, timed=False, serialize=False, record=True):
    router.registry.start_iteration(record=record)
    router.profiler.start_iteration(timed=timed, serialize=serialize)
    result = fn()
    router.registry.finish_iteration()
    return result, router.profiler.finish_iteration()


def _records(router):
    return {k: [r.op, r.nbytes, r.calls, r.group.name] for k, r in router.registry.records.items()}


def _te_part(router, pool, groups, tp):
    from lagom_megatron.engine.knobs import CommConfig
    from tests.megatron.te_standin.module.layernorm_linear import LayerNormLinear
    from tests.megatron.te_standin.module.linear import Linear

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        LayerNormLinear(8, 16, tp_group=tp, parallel_mode="column", sequence_parallel=True),
        Linear(16, 8, tp_group=tp, parallel_mode="row", sequence_parallel=True),
        Linear(8, 8, tp_group=tp, parallel_mode="column", sequence_parallel=False),
    )
    for p in model.parameters():
        torch.nn.init.normal_(p)
    router.registry.name_modules(model, prefix="chunk0.")
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    batches = [torch.randn(4, 8, generator=gen) for _ in range(2)]

    def step():
        model.zero_grad()
        for x in batches:
            model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    out = {}
    router.active = False
    reference = step()
    router.active = True
    grads, _ = _iteration(router, step)
    out["te_records"] = _records(router)
    out["te_same_grads_hooked"] = all(torch.equal(a, b) for a, b in zip(reference, grads))
    _, timings = _iteration(router, step, timed=True, serialize=True)
    out["te_timings"] = timings
    cfg = CommConfig(n_channels=3)
    pool.prepare({"tp": {cfg}})
    router.set_assignment({"tp.sp_reduce_scatter[chunk0.0]": cfg})
    before = router.calls_routed
    grads, _ = _iteration(router, step, record=False)
    out["te_routed_calls"] = router.calls_routed - before
    out["te_same_grads_routed"] = all(torch.equal(a, b) for a, b in zip(reference, grads))
    router.set_assignment({})
    return out


def _cp_part(router, pool, groups, cp, batch):
    from lagom_megatron.engine.knobs import CommConfig
    from tests.megatron.te_standin.attention.dot_product_attention.dot_product_attention import DotProductAttention

    holder = torch.nn.Module()
    holder.attn = DotProductAttention(
        cp_group=cp, cp_global_ranks=[0, 1], batch_p2p_comm=batch, step_compute=lambda: time.sleep(SLEEP)
    )
    router.registry.name_modules(holder, prefix="chunk0.")
    q = torch.full((6,), 1.0 + dist.get_rank(), requires_grad=True)
    kv = torch.full((6,), 10.0 * (1 + dist.get_rank()))

    def step():
        q.grad = None
        out = holder.attn(q, kv)
        out.sum().backward()
        return out.detach().clone(), q.grad.clone()

    tag = "cp_batched" if batch else "cp_unbatched"
    res = {}
    ref, _ = _iteration(router, step)
    res[f"{tag}_records"] = _records(router)
    res[f"{tag}_out"] = [ref[0].tolist(), ref[1].tolist()]
    _, res[f"{tag}_serialized"] = _iteration(router, step, timed=True, serialize=True)
    _, res[f"{tag}_overlapped"] = _iteration(router, step, timed=True)
    cfg = CommConfig(n_channels=3)
    pool.prepare({"cp": {cfg}})
    router.set_assignment({"cp.ring_send_recv[chunk0.attn]": cfg})
    got, _ = _iteration(router, step, record=False)
    seen = holder.attn.seen_groups[-1]
    res[f"{tag}_routed_group"] = [groups.lookup(seen).name, seen is not cp, holder.attn.cp_group is cp]
    res[f"{tag}_routed_same"] = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    router.set_assignment({})
    return res


def _cp_a2a_part(router, pool, groups, cp):
    from lagom_megatron.engine.knobs import CommConfig
    from tests.megatron.te_standin.attention.dot_product_attention.dot_product_attention import DotProductAttention

    holder = torch.nn.Module()
    holder.attn = DotProductAttention(
        cp_group=cp, cp_global_ranks=[0, 1], cp_comm_type="a2a", step_compute=lambda: time.sleep(SLEEP)
    )
    router.registry.name_modules(holder, prefix="chunk0.")
    q = torch.arange(8.0) + 100 * dist.get_rank()
    q.requires_grad_(True)

    def step():
        q.grad = None
        out = holder.attn(q)
        (out * 3.0).sum().backward()
        return out.detach().clone(), q.grad.clone()

    res = {}
    ref, _ = _iteration(router, step)
    res["cp_a2a_records"] = _records(router)
    res["cp_a2a_out"] = [ref[0].tolist(), ref[1].tolist()]
    _, res["cp_a2a_serialized"] = _iteration(router, step, timed=True, serialize=True)
    cfg = CommConfig(n_channels=3)
    pool.prepare({"cp": {cfg}})
    router.set_assignment({"cp.a2a[chunk0.attn]": cfg})
    before = router.calls_routed
    got, _ = _iteration(router, step, record=False)
    res["cp_a2a_routed_calls"] = router.calls_routed - before
    seen = holder.attn.seen_groups[-1]
    res["cp_a2a_routed_group"] = [groups.lookup(seen).name, seen is not cp, holder.attn.cp_group is cp]
    res["cp_a2a_routed_same"] = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    router.set_assignment({})
    return res


def _pp_part(router, pool, groups, pp):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from lagom_megatron.engine.knobs import CommConfig

    rank = dist.get_rank()
    comm = P2PCommunicator(pp, ModelParallelConfig(pipeline_dtype=torch.float32, batch_p2p_comm=False))

    def step():
        _, recv, reqs = comm._communicate(
            tensor_send_next=None,
            tensor_send_prev=torch.full((5,), 1.0 + rank),
            recv_prev=False,
            recv_next=True,
            tensor_shape=(5,),
            wait_on_reqs=False,
        )
        time.sleep(SLEEP)  # the compute the interleaved schedule runs before it waits
        for name in sorted(reqs):
            reqs[name].wait()
        return recv.tolist()

    out = {}
    out["pp_recv_default"], _ = _iteration(router, step)
    out["pp_records"] = _records(router)
    _, out["pp_serialized"] = _iteration(router, step, timed=True, serialize=True)
    _, out["pp_overlapped"] = _iteration(router, step, timed=True)
    cfg = CommConfig(n_channels=3)
    pool.prepare({"pp": {cfg}})
    router.set_assignment({"pp.send_recv": cfg})
    seen = []
    isend, irecv = dist.isend, dist.irecv
    dist.isend = lambda *a, **k: seen.append(("send", groups.lookup(k.get("group")).name)) or isend(*a, **k)
    dist.irecv = lambda *a, **k: seen.append(("recv", groups.lookup(k.get("group")).name)) or irecv(*a, **k)
    try:
        out["pp_recv_routed"], _ = _iteration(router, step, record=False)
    finally:
        dist.isend, dist.irecv = isend, irecv
    out["pp_routed_groups"] = seen
    router.set_assignment({})
    return out


def _moe_part(router, ep):
    from megatron.core.tensor_parallel import mappings

    x = torch.arange(8.0).reshape(4, 2).requires_grad_(True)

    def step():
        x.grad = None
        with router.scope("dispatch_all_to_all", per_microbatch=True):
            y = mappings._AllToAll.apply(ep, x, None, None)
        (y * (1 + dist.get_rank())).sum().backward()  # backward outside any scope, as autograd runs it
        return x.grad.clone()

    router.registry.num_microbatches = 1
    _iteration(router, step)
    grad, _ = _iteration(router, step)
    router.registry.num_microbatches = 2
    return {"moe_records": _records(router), "moe_grad": grad.tolist()}


def _embedding_wgrad_part(router, tp):
    import sys
    import types

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    # drain_embedding_wgrad_compute imports this CUDA extension even when gradient-accumulation
    # fusion is off; the stand-in is never called with the fusion off
    sys.modules.setdefault("fused_weight_gradient_mlp_cuda", types.ModuleType("fused_weight_gradient_mlp_cuda"))
    parallel_state._set_global_memory_buffer()
    config = types.SimpleNamespace(sequence_parallel=True, gradient_accumulation_fusion=False)
    weight = torch.nn.Parameter(torch.zeros(4, 4))

    def step():  # megatron-core's pipeline drain: 3 buffered micro-batches of the output layer
        acts = [torch.full((2, 1, 4), float(i)) for i in range(3)]
        grads = [torch.ones(4, 1, 4) for _ in range(3)]
        schedules.drain_embedding_wgrad_compute(config, acts, grads, weight, tp)

    _iteration(router, step)
    out = {"embd_records": _records(router)}
    _, out["embd_timings"] = _iteration(router, step, timed=True)
    parallel_state.destroy_global_memory_buffer()
    return out


FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")
"""FSDP2 records events on its CPU streams (torch 2.13 ``fsdp/_fully_shard/_fsdp_collectives.py:370``); torch 2.6's
``torch.cpu.Stream`` has no ``record_event``, so FSDP2 cannot run on CPU there (``:171`` @2.6.0)."""


def _fsdp_part(router, pool, groups, dp):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from lagom_megatron.engine.knobs import CommConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    # as megatron-core 0.16.1 torch_fully_sharded_data_parallel.py:120-146: each layer, then the root
    mesh = DeviceMesh.from_group(dp, "cpu")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(20 + dist.get_rank())
    x = torch.randn(4, 8, generator=gen)

    def step():
        model.zero_grad()
        model(x).square().sum().backward()
        return [p.grad.full_tensor().clone() for p in model.parameters()]

    out = {}
    ref, _ = _iteration(router, step)
    out["fsdp_records"] = _records(router)
    _, out["fsdp_timings"] = _iteration(router, step, timed=True)
    cfg = CommConfig(n_channels=3)
    pool.prepare({"dp": {cfg}})
    router.set_assignment({"dp.fsdp_reduce_scatter[1]": cfg, "dp.fsdp_all_gather[0]": cfg})
    before = router.calls_routed
    got, _ = _iteration(router, step, record=False)
    out["fsdp_routed_calls"] = router.calls_routed - before
    out["fsdp_routed_same"] = all(torch.equal(a, b) for a, b in zip(ref, got))
    router.set_assignment({})
    return out


def worker(rank: int, store_path: str, out_dir: str) -> None:
    """One rank: installs the hooks with the TE stand-in and runs every part (module docstring)."""
    from lagom_megatron.megatron.hooks import patches
    from lagom_megatron.megatron.hooks.profiler import Profiler
    from lagom_megatron.megatron.hooks.router import SiteRouter
    from lagom_megatron.megatron.hooks.sites import GroupNames, SiteRegistry
    from lagom_megatron.megatron.hooks.te_targets import find_te_targets
    from lagom_megatron.megatron.pool.comm_pool import CommPool, make_pool_backend
    from lagom_megatron.training import cpu_shims

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    cpu_shims.apply()
    groups = GroupNames(local_world_size=WORLD)
    named = {name: dist.new_group([0, 1]) for name in ("tp", "pp", "cp", "ep", "dp")}
    for name, group in named.items():
        groups.add(name, group)
    groups.add_partner("pp", "pp_world", (0, 1))
    registry = SiteRegistry(groups, num_microbatches=2)
    router = SiteRouter(registry, Profiler(), CommPool(make_pool_backend("gloo"), groups))
    handle = patches.install(router, te=find_te_targets("tests.megatron.te_standin"))
    out = {"patched": handle.patched}
    try:
        out.update(_te_part(router, router.pool, groups, named["tp"]))
        out.update(_cp_part(router, router.pool, groups, named["cp"], batch=True))
        out.update(_cp_part(router, router.pool, groups, named["cp"], batch=False))
        out.update(_cp_a2a_part(router, router.pool, groups, named["cp"]))
        out.update(_pp_part(router, router.pool, groups, named["pp"]))
        out.update(_moe_part(router, named["ep"]))
        out.update(_embedding_wgrad_part(router, named["tp"]))
        if FSDP2_ON_CPU:
            out.update(_fsdp_part(router, router.pool, groups, named["dp"]))
    finally:
        handle.remove()
        cpu_shims.remove()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, default=str)
    dist.destroy_process_group()
