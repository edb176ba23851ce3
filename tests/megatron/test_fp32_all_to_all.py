"""megatron-core's reduce-scatter with fp32 accumulation (``--ddp-reduce-scatter-with-fp32-accumulation``), run for real
on two gloo processes with the installed megatron-core's own ``_ParamAndGradBucketGroup`` (0.16.1 in the default venv,
0.19.x in the newest tested one).

Its ``__init__`` rebinds the module's ``dist_reduce_scatter_func`` to ``reduce_scatter_with_fp32_accumulation``
(core_v0.16.1 ``param_and_grad_buffer.py:163-165``, core_v0.19.0 ``:247-249``), which ``start_grad_sync`` calls
(``:443`` / ``:712``) and which issues one ``all_to_all_single`` of the bucket's gradients, then sums in fp32
(``reduce_scatter_with_fp32_accumulation.py:78``). The bucket group is built after ``patches.install``, as a model
built after lagom's hooks would be, and again used under a second install that finds the function already bound.
"""

import inspect
import json
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tests.timeouts import exit_after  # noqa: E402

if "work = None" not in inspect.getsource(dist.distributed_c10d._coalescing_manager):
    # torch 2.6's manager ends one that recorded no fast-path op (Megatron's all_to_all_single) with ``work``
    # unbound when no device is given, so Megatron's fp32-accumulation path raises there, with or without lagom
    pytest.skip(
        f"torch {torch.__version__}'s _coalescing_manager cannot end a manager holding only an all_to_all "
        "(Megatron's --ddp-reduce-scatter-with-fp32-accumulation path fails on it)",
        allow_module_level=True,
    )

WORLD = 2
SITE = "dp.grad_all_to_all[chunk0.bucket0]"
NUMEL = 8


def _bucket_group(pgb, group, rank):
    """One bucket of ``NUMEL`` bf16 gradients, built with the installed megatron-core's own constructors."""
    from megatron.core.distributed import DistributedDataParallelConfig

    param = torch.nn.Parameter(torch.zeros(NUMEL))
    grad = torch.zeros(NUMEL, dtype=torch.bfloat16)
    kwargs = {}
    accepted = inspect.signature(pgb._ParamAndGradBucket.__init__).parameters
    if "param_index_map" in accepted:  # core_v0.19: the bucket's own index map and extra main grads
        kwargs = {"param_index_map": {param: (0, NUMEL, 0)}, "params_with_extra_main_grads": []}
    bucket = pgb._ParamAndGradBucket([param], None, grad, 0, NUMEL, 1.0, 0, **kwargs)
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, reduce_scatter_with_fp32_accumulation=True
    )
    return pgb._ParamAndGradBucketGroup([bucket], config, group, WORLD), grad


def _gradients(rank):
    return torch.arange(NUMEL, dtype=torch.float32) * (rank + 1) + 0.5


class _Spy:
    """The group of every ``all_to_all_single`` issued through ``torch.distributed`` (above lagom's wrapper)."""

    def __enter__(self):
        self.seen, self._orig = [], dist.all_to_all_single

        def a2a(*args, **kwargs):
            self.seen.append(kwargs.get("group"))
            return self._orig(*args, **kwargs)

        dist.all_to_all_single = a2a
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


def worker(rank: int, store_path: str, out_dir: str) -> None:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.megatron.hooks import patches
    from lagom_megatron.megatron.hooks.profiler import Profiler
    from lagom_megatron.megatron.hooks.router import SiteRouter
    from lagom_megatron.megatron.hooks.sites import GroupNames, SiteRegistry
    from lagom_megatron.megatron.pool.comm_pool import CommPool, make_pool_backend
    from lagom_megatron.training import cpu_shims
    from tests.megatron.overlap_worker import _iteration

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    dp = dist.new_group([0, 1])
    groups = GroupNames(local_world_size=WORLD)
    groups.add("dp", dp)
    registry = SiteRegistry(groups)
    router = SiteRouter(registry, Profiler(), CommPool(make_pool_backend("gloo"), groups))
    cpu_shims.apply()  # core_v0.19's start_grad_sync asks torch.cuda for the current stream
    out = {"plain": pgb.dist_reduce_scatter_func is dist.reduce_scatter_tensor}
    handle = patches.install(router, te=None, fsdp2=None, megatron_fsdp=[])
    out["wrapped"] = pgb.dist_reduce_scatter_func is not dist.reduce_scatter_tensor
    bg, grad = _bucket_group(pgb, dp, rank)  # after install: rebinds the module's function
    out["rebound"] = pgb.dist_reduce_scatter_func is pgb.reduce_scatter_with_fp32_accumulation
    registry.bind_model([types.SimpleNamespace(bucket_groups=[bg])])
    shard = slice(rank * NUMEL // WORLD, (rank + 1) * NUMEL // WORLD)

    def step():
        grad.copy_(_gradients(rank))
        bg.start_grad_sync()  # as DDP's backward hook, then finish_grad_sync as finalize_model_grads
        bg.finish_grad_sync()
        bg.is_first_batch, bg.grad_reduce_handle = False, None
        if hasattr(bg, "grad_reduce_finished"):  # core_v0.19: reset() clears it each iteration
            bg.grad_reduce_finished = False
        return grad[shard].float().tolist()

    expected = sum(_gradients(r) for r in range(WORLD))[shard].tolist()
    got, _ = _iteration(router, step)
    rec = registry.records.get(SITE)
    out["record"] = None if rec is None else [rec.op, rec.nbytes, rec.calls, rec.group.name, rec.dtype, rec.facts]
    out["records"] = sorted(registry.records)
    out["sum"] = got == expected
    _, timings = _iteration(router, step, timed=True)
    out["timed"] = timings.get(SITE)
    cfg = CommConfig(n_channels=3)
    router.pool.prepare({"dp": {cfg}})
    router.set_assignment({SITE: cfg})
    before = router.calls_routed
    with _Spy() as spy:
        got, _ = _iteration(router, step, record=False)
    out["routed"] = [
        router.calls_routed - before,
        [groups.lookup(g).name for g in spy.seen],
        [g is dp for g in spy.seen],
    ]
    out["routed_sum"] = got == expected
    router.set_assignment({})
    handle.remove()
    out["kept_after_remove"] = pgb.dist_reduce_scatter_func is pgb.reduce_scatter_with_fp32_accumulation
    # the usual order: the model (and its bucket groups) exists before lagom installs its hooks
    handle = patches.install(router, te=None, fsdp2=None, megatron_fsdp=[])
    out["second_install_unwrapped"] = pgb.dist_reduce_scatter_func is pgb.reduce_scatter_with_fp32_accumulation
    got, _ = _iteration(router, step)
    rec = registry.records.get(SITE)
    out["second_record"] = None if rec is None else [rec.op, rec.nbytes, rec.calls]
    out["second_sum"] = got == expected
    handle.remove()
    cpu_shims.remove()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f, default=str)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32_a2a")
    mp.spawn(exit_after, args=(worker, str(out / "store"), str(out)), nprocs=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_a_bucket_group_built_after_install_rebinds_megatrons_function(ranks):
    for r in ranks:
        assert r["plain"] and r["wrapped"]  # a fresh process: torch's reduce-scatter, wrapped by install
        assert r["rebound"]  # megatron-core's own __init__ replaced lagom's wrapper with its function


def test_the_site_is_an_all_to_all_of_the_bucket_gradients(ranks):
    for r in ranks:
        # one all_to_all_single of the bucket's 8 bf16 gradients (its input, 16 bytes), no reduction in NCCL
        assert r["record"] == [
            "all_to_all",
            NUMEL * 2,
            1,
            "dp",
            "bfloat16",
            {"reduce_op": None, "parts": [], "registered": ""},
        ]
        assert r["records"] == [SITE]  # not a reduce-scatter site, nor a second site for the inner call
        assert r["sum"]
        comm, comp, region = r["timed"]
        assert comm > 0 and region > 0


def test_the_all_to_all_is_routed_to_the_pool_entry(ranks):
    for r in ranks:
        routed, names, own = r["routed"]
        assert routed == 1 and names == ["dp"] and own == [False]
        assert r["routed_sum"]


def test_remove_keeps_megatrons_function_and_a_second_install_leaves_it_unwrapped(ranks):
    for r in ranks:
        assert r["kept_after_remove"]
        assert r["second_install_unwrapped"]
        assert r["second_record"] == ["all_to_all", NUMEL * 2, 1] and r["second_sum"]
