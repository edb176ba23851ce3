"""The two-process gloo worker of ``test_coalesced_sites.py``: TE's quantized gathers and Megatron-FSDP.

Each part runs the real hooks (``patches.install``) on a real gloo process group and a real
communicator pool, and writes what it saw to ``<out_dir>/rank<r>.json``.
"""

import dataclasses
import json
import os

import torch
import torch.distributed as dist

from tests.megatron.overlap_worker import WORLD, _iteration


def fp32_gradients(config_cls: type) -> dict:
    """Megatron-FSDP's own config for gradients kept and reduced in fp32: ``grad_reduce_in_fp32`` in megatron-core
    0.16 (``megatron_fsdp/distributed_data_parallel_config.py:11`` @core_v0.16.1), ``megatron_fsdp_main_grads_dtype``
    from 0.17 on (``:128`` @core_v0.17.1, ``:132`` @core_v0.18.2 to main; communication then in that dtype)."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    if "grad_reduce_in_fp32" in fields:
        return {"grad_reduce_in_fp32": True}
    return {"megatron_fsdp_main_grads_dtype": torch.float32}


_SINGLES: list = []


def fsdp_index(index_cls: type, group) -> object:
    """Megatron-FSDP's ``FSDPDistributedIndex`` over ``group`` with a TP dimension of size 1, as Megatron's adapter
    builds it: from megatron-core 0.17 ``make_fsdp_dtensor`` asks for the TP sub-mesh (``using_tensor_parallel``,
    ``megatron_fsdp/utils.py:868`` @0.19.2), which raises without ``tp_dim``. Collective: every rank calls it."""
    from torch.distributed.device_mesh import DeviceMesh

    if not _SINGLES:
        _SINGLES.extend(dist.new_group([r]) for r in range(dist.get_world_size()))
    ranks = dist.get_process_group_ranks(group)
    mesh = DeviceMesh.from_group(
        [group, _SINGLES[dist.get_rank()]],
        "cpu",
        mesh=torch.tensor(ranks).reshape(-1, 1),
        mesh_dim_names=("dp_cp", "tp"),
    )
    return index_cls(device_mesh=mesh, dp_shard_dim="dp_cp", tp_dim="tp")


def _records(router):
    return {k: [r.op, r.nbytes, r.calls, r.group.name, r.dtype] for k, r in router.registry.records.items()}


class _GroupSpy:
    """Records the group of every ``_coalescing_manager`` opened and of every all-gather issued
    through the ``torch.distributed`` module (outside lagom's wrapper) while active."""

    def __init__(self, groups):
        self.groups, self.seen = groups, []

    def __enter__(self):
        self._cm, self._ag = dist._coalescing_manager, dist.all_gather_into_tensor

        def cm(group=None, device=None, async_ops=False):
            self.seen.append(("manager", group))
            return self._cm(group=group, device=device, async_ops=async_ops)

        def ag(*args, **kwargs):
            self.seen.append(("all_gather", kwargs.get("group")))
            return self._ag(*args, **kwargs)

        dist._coalescing_manager, dist.all_gather_into_tensor = cm, ag
        return self

    def __exit__(self, *exc):
        dist._coalescing_manager, dist.all_gather_into_tensor = self._cm, self._ag

    def names(self, tp):
        """(kind, group name, is the original group) per call seen."""
        return [[kind, self.groups.lookup(g).name, g is tp] for kind, g in self.seen]


def _te_quantized_part(router, pool, groups, tp):
    from lagom_megatron.engine.knobs import CommConfig
    from tests.megatron.te_standin.module.linear import Linear
    from tests.megatron.te_standin.quantized import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer

    out = {}
    rank = dist.get_rank()
    cfg = CommConfig(n_channels=3)
    pool.prepare({"tp": {cfg}})
    for recipe in (MXFP8Quantizer, Float8BlockQuantizer, NVFP4Quantizer):
        name = recipe.__name__
        torch.manual_seed(0)
        holder = torch.nn.Module()
        holder.fc1 = Linear(
            128, 8, tp_group=tp, parallel_mode="column", sequence_parallel=True, input_quantizer=recipe()
        )
        torch.nn.init.normal_(holder.fc1.weight)
        router.registry.name_modules(holder, prefix="chunk0.")
        # 128 tokens x 128 hidden per rank, integer codes 0..15 (exact in every stand-in format)
        x = (torch.arange(128 * 128, dtype=torch.float32).reshape(128, 128) * (rank + 1)) % 16
        x.requires_grad_(True)

        def step():
            holder.zero_grad()
            x.grad = None
            holder.fc1(x).square().sum().backward()
            return [holder.fc1.weight.grad.clone(), x.grad.clone()]

        router.active = False
        reference = step()
        router.active = True
        got, _ = _iteration(router, step)
        out[f"{name}_records"] = _records(router)
        out[f"{name}_parts"] = router.registry.records["tp.sp_all_gather[chunk0.fc1]"].facts["parts"]
        out[f"{name}_same_hooked"] = all(torch.equal(a, b) for a, b in zip(reference, got))
        _, out[f"{name}_serialized"] = _iteration(router, step, timed=True, serialize=True)
        _, out[f"{name}_overlapped"] = _iteration(router, step, timed=True)
        router.set_assignment({"tp.sp_all_gather[chunk0.fc1]": cfg})
        before = router.calls_routed
        with _GroupSpy(groups) as spy:
            got, _ = _iteration(router, step, record=False)
        out[f"{name}_routed_calls"] = router.calls_routed - before
        out[f"{name}_routed_groups"] = spy.names(tp)
        out[f"{name}_same_routed"] = all(torch.equal(a, b) for a, b in zip(reference, got))
        router.set_assignment({})
    out.update(_te_both_usages(router, tp))
    return out


def _te_both_usages(router, tp):
    """One MXFP8 gather with row- and column-wise usage, as ``gather_along_first_dim`` issues it (TE v2.18
    ``distributed.py:1595-1634``): four inner gathers, recorded as the parts of one site."""
    from tests.megatron.te_standin.distributed import gather_along_first_dim
    from tests.megatron.te_standin.quantized import MXFP8Quantizer

    x = (torch.arange(128 * 128, dtype=torch.float32).reshape(128, 128) * (dist.get_rank() + 1)) % 16

    def step():
        out, handle = gather_along_first_dim(x, tp, async_op=True, quantizer=MXFP8Quantizer())
        handle.wait()
        return out

    out, _ = _iteration(router, step)
    rec = router.registry.records["tp.sp_all_gather[0]"]
    gathered = torch.cat([(torch.arange(128 * 128).reshape(128, 128) * (r + 1)) % 16 for r in range(WORLD)])
    same = all(torch.equal(d.to(torch.float32), gathered) for d in (out._rowwise_data, out._columnwise_data))
    return {"both_usages": [rec.op, rec.nbytes, rec.calls, rec.facts["parts"], same]}


class _CudaStreamsOnCpu:
    """The ``torch.cuda`` stream calls Megatron-FSDP makes around its collectives, as no-ops on a
    CPU build (``param_and_grad_buffer.py:3205-3213,3581-3607``: ``current_stream``, ``Stream``,
    ``stream(...)``, ``wait_stream``, ``record_event``; ``megatron_fsdp.py:182-188,361-362``), and
    ``Tensor.cuda`` as the identity (``uneven_dtensor.py:183``). On CPU every gloo call is
    ordered by the host, so the streams have nothing to order. Restored on exit."""

    class _Stream:
        def wait_stream(self, other):
            pass

        def record_event(self, event=None):
            return _CudaStreamsOnCpu._Event()

    class _Event:
        def wait(self, stream=None):
            pass

    def __enter__(self):
        import contextlib

        cuda = torch.cuda
        self._saved = [
            (cuda, n, getattr(cuda, n))
            for n in ("Stream", "current_stream", "stream", "current_device", "empty_cache", "synchronize")
        ]
        self._saved.append((torch.Tensor, "cuda", torch.Tensor.cuda))
        cuda.Stream = cuda.current_stream = lambda *a, **k: self._Stream()
        cuda.stream = lambda s: contextlib.nullcontext()
        cuda.current_device = lambda: 0
        cuda.empty_cache = cuda.synchronize = lambda *a, **k: None
        torch.Tensor.cuda = lambda t, *a, **k: t
        return self

    def __exit__(self, *exc):
        for owner, name, value in self._saved:
            setattr(owner, name, value)


class _Layer(torch.nn.Module):
    """An FSDP unit module (the ``TransformerLayer`` of ``--use-megatron-fsdp``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _megatron_fsdp_part(router, pool, groups, dp):
    """megatron-core 0.16.1's own Megatron-FSDP (``optim_grads_params``, overlapped gather and
    reduce-scatter) on a model of two units between two root-level linears."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import FSDPDistributedIndex, MegatronFSDP
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as mfsdp_pgb
    from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )

    from lagom_megatron.engine.knobs import CommConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Layer(), _Layer(), torch.nn.Linear(8, 4))
    index = fsdp_index(FSDPDistributedIndex, dp)
    # gloo has no PREMUL_SUM: scale, then SUM (gradient_reduce_preprocessing, param_and_grad_buffer.py:3762-3777)
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        **fp32_gradients(DistributedDataParallelConfig),
        gradient_reduce_div_fusion=False,
    )
    fsdp = MegatronFSDP(model, index, ddp_config=config, fsdp_unit_modules=[_Layer], device=torch.device("cpu"))
    buffer = fsdp.param_and_grad_buffer
    router.registry.bind_model([fsdp])
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(30 + dist.get_rank()))

    def step():
        fsdp.zero_grad_buffer()
        fsdp(x).square().sum().backward()
        fsdp.finish_grad_sync()
        # each parameter's reduced gradient shard on this rank (the buffers' padding left out)
        return [
            g.main_grad_buffer.get_item(i, only_shard=True).clone()
            for g in buffer.parameter_groups
            for i in range(len(g.params))
        ]

    out = {
        "mfsdp_groups": [[g.fsdp_unit_id, g.model_weight_buffer.bucket_index.size] for g in buffer.parameter_groups],
        "mfsdp_tags": router.registry.fsdp_bucket_tags(buffer),
    }
    router.active = False
    reference = step()
    router.active = True
    got, _ = _iteration(router, step)
    out["mfsdp_records"] = _records(router)
    out["mfsdp_same_hooked"] = all(torch.equal(a, b) for a, b in zip(reference, got))
    out["mfsdp_grad_shard"] = [sum(t.numel() for t in reference), sum(float(t.abs().sum()) for t in reference)]
    _, out["mfsdp_timings"] = _iteration(router, step, timed=True)
    cfg = CommConfig(n_channels=3)
    pool.prepare({"dp": {cfg}})
    router.set_assignment({"dp.param_all_gather[chunk0.bucket1]": cfg, "dp.grad_reduce_scatter[chunk0.bucket0]": cfg})
    seen, cm = [], mfsdp_pgb._coalescing_manager

    def spy(group=None, *args, **kwargs):
        seen.append([groups.lookup(group).name, group is dp])
        return cm(group, *args, **kwargs)

    mfsdp_pgb._coalescing_manager = spy
    before = router.calls_routed
    try:
        got, _ = _iteration(router, step, record=False)
    finally:
        mfsdp_pgb._coalescing_manager = cm
    out["mfsdp_routed_calls"] = router.calls_routed - before
    out["mfsdp_routed_managers"] = seen
    out["mfsdp_same_routed"] = all(torch.equal(a, b) for a, b in zip(reference, got))
    out["mfsdp_groups_restored"] = all(
        b.data_parallel_group is dp
        for g in buffer.parameter_groups
        for b in (g.model_weight_buffer, g.main_grad_buffer)
    )
    router.set_assignment({})
    # data parallel 1: Megatron-FSDP over a group of one rank has no sites
    solos = [dist.new_group([r]) for r in range(WORLD)]
    torch.manual_seed(0)
    solo = MegatronFSDP(
        torch.nn.Sequential(_Layer(), _Layer()),
        fsdp_index(FSDPDistributedIndex, solos[dist.get_rank()]),
        ddp_config=config,
        fsdp_unit_modules=[_Layer],
        device=torch.device("cpu"),
    )
    router.registry.bind_model([solo])

    def solo_step():
        solo.zero_grad_buffer()
        solo(x).square().sum().backward()
        solo.finish_grad_sync()

    router.set_assignment(
        {"other.param_all_gather[chunk0.bucket0]": cfg, "other.grad_reduce_scatter[chunk0.bucket0]": cfg}
    )
    _iteration(router, solo_step, timed=True)
    out["mfsdp_solo_records"] = _records(router)
    router.set_assignment({})
    return out


def _megatron_fsdp_strategies_part(router, dp):
    """megatron-core 0.16.1's own Megatron-FSDP under the strategies without FSDP units (no_shard, optim,
    optim_grads: the adapter passes no units then, ``mcore_fsdp_adapter.py:96-99``), one bucket per linear,
    over iterations of two micro-batches as Megatron-Core's schedule runs them (the first under
    ``no_sync``, ``finish_grad_sync`` after the last): the sites of the second iteration, with calls."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import FSDPDistributedIndex, MegatronFSDP
    from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )

    out = {}
    gen = torch.Generator().manual_seed(40 + dist.get_rank())
    batches = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    for strategy in ("no_shard", "optim", "optim_grads"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
        index = fsdp_index(FSDPDistributedIndex, dp)
        config = DistributedDataParallelConfig(
            data_parallel_sharding_strategy=strategy,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            **fp32_gradients(DistributedDataParallelConfig),
            gradient_reduce_div_fusion=False,
            bucket_size=8 * 8 + 8,
        )
        fsdp = MegatronFSDP(model, index, ddp_config=config, fsdp_unit_modules=[], device=torch.device("cpu"))
        router.registry.bind_model([fsdp])

        def step():
            fsdp.zero_grad_buffer()
            with fsdp.no_sync():
                fsdp(batches[0]).square().sum().backward()
            fsdp(batches[1]).square().sum().backward()
            fsdp.finish_grad_sync()

        _iteration(router, step)
        _iteration(router, step)
        out[f"mfsdp_{strategy}_records"] = _records(router)
        out[f"mfsdp_{strategy}_tags"] = router.registry.fsdp_bucket_tags(fsdp.param_and_grad_buffer)
        out[f"mfsdp_{strategy}_sizes"] = [
            g.main_grad_buffer.bucket_index.size for g in fsdp.param_and_grad_buffer.parameter_groups
        ]
    return out


def _megatron_fsdp_hsdp_part(router, pool, groups, full, inner):
    """Megatron-FSDP's HSDP layout of megatron-core 0.17+ (``mfsdp_standin``): model buffers on the
    whole data-parallel group ``full``, the collectives on the helper buffers' DP-Shard group
    ``inner``; unit 1 has a transposed buffer, gathered in backward."""
    from lagom_megatron.engine.knobs import CommConfig
    from tests.megatron import mfsdp_standin as sm

    outer = dist.new_group([0, 1])
    units = [sm.ParameterGroup(u, full=full, inner=inner, seed=u, transpose=u == 1) for u in (0, 1)]
    buffer = sm.ParamAndGradBuffer(units, outer)
    ag, rs = sm.AllGatherPipeline(buffer), sm.GradReducePipeline(buffer)
    holder = torch.nn.Module()
    holder.param_and_grad_buffer = buffer
    router.registry.bind_model([holder])

    def step():
        out = []
        for bwd in (False, True):
            ag.all_gather_params([u.params[0] for u in units], bwd=bwd)
            out += [ag.wait_bucket_ready(i, bwd) for i in (0, 1)]
        for i in (0, 1):
            rs._bucket_group_gradient_reduce([i], outer_fsdp_group_grad_reduce=True)
        return out + [b.data.clone() for u in units for b in (u.hfsdp_helper_gbuf, u.main_grad_buffer)]

    router.active = False
    reference = step()
    router.active = True
    got, _ = _iteration(router, step)
    out = {"hsdp_records": _records(router), "hsdp_same_hooked": all(torch.equal(a, b) for a, b in zip(reference, got))}
    cfg = CommConfig(n_channels=3)
    pool.prepare({"intra_dist_opt": {cfg}})
    router.set_assignment(
        {
            "intra_dist_opt.param_all_gather[chunk0.bucket0]": cfg,
            "intra_dist_opt.grad_reduce_scatter[chunk0.bucket1]": cfg,
        }
    )
    seen, saved = [], (sm._coalescing_manager, dist.all_gather_into_tensor, dist.reduce_scatter_tensor)

    def spy(kind, fn):
        def call(*args, **kwargs):
            group = kwargs["group"] if "group" in kwargs else args[0]
            name = "outer" if group is outer else groups.lookup(group).name
            seen.append([kind, name, any(group is g for g in (full, inner, outer))])
            return fn(*args, **kwargs)

        return call

    sm._coalescing_manager = spy("manager", saved[0])
    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = (
        spy("all_gather", saved[1]),
        spy("reduce_scatter", saved[2]),
    )
    before = router.calls_routed
    try:
        got, _ = _iteration(router, step, record=False)
    finally:
        sm._coalescing_manager, dist.all_gather_into_tensor, dist.reduce_scatter_tensor = saved
    out["hsdp_routed_calls"] = router.calls_routed - before
    out["hsdp_seen"] = seen
    out["hsdp_same_routed"] = all(torch.equal(a, b) for a, b in zip(reference, got))
    out["hsdp_groups_restored"] = all(
        b.data_parallel_group is grp
        for u in units
        for grp, bufs in (
            (full, (u.model_weight_buffer, u.main_grad_buffer, u.transpose_weight_buffer)),
            (inner, (u.hfsdp_helper_wbuf, u.hfsdp_helper_gbuf, u.hfsdp_helper_wtbuf)),
        )
        for b in bufs
        if b is not None
    )
    router.set_assignment({})
    return out


def worker(rank: int, store_path: str, out_dir: str) -> None:
    """One rank: installs the hooks with the TE stand-in and runs every part (module docstring)."""
    from lagom_megatron.megatron.hooks import patches
    from lagom_megatron.megatron.hooks.profiler import Profiler
    from lagom_megatron.megatron.hooks.router import SiteRouter
    from lagom_megatron.megatron.hooks.sites import GroupNames, SiteRegistry
    from lagom_megatron.megatron.hooks.te_targets import find_megatron_fsdp, find_te_targets
    from lagom_megatron.megatron.pool.comm_pool import CommPool, make_pool_backend
    from tests.megatron import mfsdp_standin

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    groups = GroupNames(local_world_size=WORLD)
    named = {name: dist.new_group([0, 1]) for name in ("tp", "dp", "intra_dist_opt")}
    for name, group in named.items():
        groups.add(name, group)
    registry = SiteRegistry(groups, num_microbatches=1)
    router = SiteRouter(registry, Profiler(), CommPool(make_pool_backend("gloo"), groups))
    handle = patches.install(
        router, te=find_te_targets("tests.megatron.te_standin"), megatron_fsdp=find_megatron_fsdp() + [mfsdp_standin]
    )
    out = {"patched": handle.patched}
    try:
        out.update(_te_quantized_part(router, router.pool, groups, named["tp"]))
        with _CudaStreamsOnCpu():
            out.update(_megatron_fsdp_part(router, router.pool, groups, named["dp"]))
            out.update(_megatron_fsdp_strategies_part(router, named["dp"]))
        out.update(_megatron_fsdp_hsdp_part(router, router.pool, groups, named["dp"], named["intra_dist_opt"]))
    finally:
        handle.remove()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, default=str)
    dist.destroy_process_group()
