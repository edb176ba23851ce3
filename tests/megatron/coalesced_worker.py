"""The two-process gloo worker of ``test_coalesced_sites.py``: TE's quantized gathers and Megatron-FSDP.

Each part runs the real hooks (``patches.install``) on a real gloo process group and a real
communicator pool, and writes what it saw to ``<out_dir>/rank<r>.json``.
"""

import json
import os

import torch
import torch.distributed as dist

WORLD = 2


def _iteration(router, fn, *, timed=False, serialize=False, record=True):
    router.registry.start_iteration(record=record)
    router.profiler.start_iteration(timed=timed, serialize=serialize)
    result = fn()
    router.registry.finish_iteration()
    return result, router.profiler.finish_iteration()


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
    from tests.megatron.te_standin.module.linear import Linear
    from tests.megatron.te_standin.quantized import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer

    from lagom_megatron.engine.knobs import CommConfig

    out = {}
    rank = dist.get_rank()
    cfg = CommConfig(n_channels=3)
    pool.prepare({"tp": {cfg}})
    for recipe in (MXFP8Quantizer, Float8BlockQuantizer, NVFP4Quantizer):
        name = recipe.__name__
        torch.manual_seed(0)
        holder = torch.nn.Module()
        holder.fc1 = Linear(128, 8, tp_group=tp, parallel_mode="column", sequence_parallel=True,
                            input_quantizer=recipe())
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
    return out


def worker(rank: int, store_path: str, out_dir: str) -> None:
    """One rank: installs the hooks with the TE stand-in and runs every part (module docstring)."""
    from lagom_megatron.megatron import patches
    from lagom_megatron.megatron.backends import make_pool_backend
    from lagom_megatron.megatron.comm_pool import CommPool
    from lagom_megatron.megatron.profiler import Profiler
    from lagom_megatron.megatron.router import SiteRouter
    from lagom_megatron.megatron.sites import GroupNames, SiteRegistry
    from lagom_megatron.megatron.te_targets import find_te_targets

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    groups = GroupNames(local_world_size=WORLD)
    named = {name: dist.new_group([0, 1]) for name in ("tp", "dp")}
    for name, group in named.items():
        groups.add(name, group)
    registry = SiteRegistry(groups, num_microbatches=1)
    router = SiteRouter(registry, Profiler(), CommPool(make_pool_backend("gloo"), groups))
    handle = patches.install(router, te=find_te_targets("tests.megatron.te_standin"))
    out = {"patched": handle.patched}
    try:
        out.update(_te_quantized_part(router, router.pool, groups, named["tp"]))
    finally:
        handle.remove()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, default=str)
    dist.destroy_process_group()
