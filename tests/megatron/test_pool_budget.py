"""Pool entries are bounded and destroyed: a memory budget refuses entries past it (counted with
NCCL's buffer estimate), ``destroy`` frees probe entries a plan does not use and every entry on
revert (live process groups counted in torch before and after), and a plan is trimmed to the
budget before it is agreed (sites of least predicted gain keep the defaults)."""

import json

import pytest
import torch.multiprocessing as mp

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.megatron.pool.gloo import GlooPoolBackend
from lagom_megatron.nccl.pool import RING_BUFFER_BYTES, NcclPoolBackend
from tests.timeouts import exit_after  # noqa: E402

C3, C4, C8 = CommConfig(n_channels=3), CommConfig(n_channels=4), CommConfig(n_channels=8)


class BudgetedGloo(GlooPoolBackend):
    """Gloo entries (real process groups) with the NCCL backend's memory estimate as a stand-in:
    gloo holds no device buffers, so the estimate of the same channel count is used."""

    def estimate_bytes(self, config, group=None):
        return NcclPoolBackend(use_tuner_plugin=False).estimate_bytes(config)


def _worker(rank, store_path, out_path):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from lagom_megatron.megatron.hooks.sites import GroupNames
    from lagom_megatron.megatron.pool.comm_pool import CommPool, PoolBudgetExceeded

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    groups = GroupNames(local_world_size=1)
    groups.add("dp", dist.new_group([0]))
    live = lambda: len(c10d._world.pg_map)  # noqa: E731 - every process group torch holds
    out = {"start": live()}
    pool = CommPool(BudgetedGloo(), groups, budget_bytes=12 * RING_BUFFER_BYTES)
    out["created"] = pool.prepare({"dp": {C3, C4}})
    out["after_prepare"], out["mib"] = live(), pool.estimated_bytes / 2**20
    try:
        pool.prepare({"dp": {C8}})  # 7 + 8 channels > 12
        out["refused"] = None
    except PoolBudgetExceeded as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = live()
    out["destroyed_unused"] = pool.destroy(keep={"dp": {C3}})
    out["after_keep"], out["live_keep"] = live(), pool.live
    out["destroyed_all"] = pool.destroy()
    out["after_revert"], out["live_end"], out["stats"] = live(), pool.live, pool.stats
    # an LL128 config without the plugin (what crashed at apply and on every reuse) fails in the
    # collective preflight, before any new_group
    from lagom_megatron.megatron import consensus

    nccl_pool = CommPool(NcclPoolBackend(use_tuner_plugin=False), groups)
    try:
        nccl_pool.prepare({"dp": {CommConfig(protocol="LL128", n_channels=4)}}, step=consensus.collective_step)
        out["ll128"] = None
    except consensus.ApplyFailed as exc:
        out["ll128"] = str(exc)
    out["after_ll128"] = live()
    with open(out_path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("budget")
    mp.spawn(exit_after, args=(_worker, str(tmp / "store"), str(tmp / "out.json")), nprocs=1, join=True)
    return json.loads((tmp / "out.json").read_text())


def test_budget_is_respected_and_entries_are_destroyed(result):
    r = result
    assert r["created"] == 2 and r["after_prepare"] == r["start"] + 2
    assert r["mib"] == pytest.approx(7 * RING_BUFFER_BYTES / 2**20)
    assert r["refused"] and "over the budget of" in r["refused"] and "--lagom-pool-budget-mib" in r["refused"]
    assert r["after_refusal"] == r["after_prepare"]  # nothing was created past the budget
    assert r["destroyed_unused"] == 1 and r["after_keep"] == r["start"] + 1 and r["live_keep"] == 1
    assert r["destroyed_all"] == 1 and r["after_revert"] == r["start"] and r["live_end"] == 0
    assert r["stats"] == {"created": 2, "destroyed": 2}
    assert r["ll128"].startswith("pool-preflight failed on rank 0") and "LL128 is never forced" in r["ll128"]
    assert r["after_ll128"] == r["start"]


def _entry(config, gain):
    return PlanEntry(
        config=config,
        predicted_t_comm_us=100.0,
        predicted_t_region_us=1000.0 - gain,
        predicted_default_t_region_us=1000.0,
        group="dp",
        op="reduce_scatter",
        nbytes=1 << 24,
        group_size=8,
        n_nodes=1,
    )


def test_plan_is_trimmed_to_the_budget_least_gain_first():
    from lagom_megatron.megatron.control.apply import Applier
    from lagom_megatron.megatron.hooks.sites import GroupNames
    from lagom_megatron.megatron.pool.comm_pool import CommPool

    plan = Plan(
        entries={
            "dp.a[0]": _entry(C8, 300.0),
            "dp.a[1]": _entry(C8, 200.0),
            "dp.b[0]": _entry(C4, 50.0),
            "dp.c[0]": _entry(CommConfig(), 0.0),
        },
        fingerprint={},
        backend="nccl",
        mechanism="communicator",
    )
    pool = CommPool(
        NcclPoolBackend(use_tuner_plugin=False), GroupNames(local_world_size=1), budget_bytes=10 * RING_BUFFER_BYTES
    )
    fitted = Applier(pool=pool, router=None, files=None, cluster=None).fit_plan_to_budget(plan)
    # the 8-channel entry (gain 500 us) fits; the 4-channel one (gain 50 us) would pass 10 channels' worth
    assert fitted.entries["dp.a[0]"].config == C8 and fitted.entries["dp.a[1]"].config == C8
    assert fitted.entries["dp.b[0]"].config.is_default()
    assert fitted.entries["dp.b[0]"].predicted_t_region_us == 1000.0  # predicts what is applied: the default
    assert fitted.stats["sites_dropped_for_budget"] == 1
    roomy = CommPool(
        NcclPoolBackend(use_tuner_plugin=False), GroupNames(local_world_size=1), budget_bytes=12 * RING_BUFFER_BYTES
    )
    assert Applier(pool=roomy, router=None, files=None, cluster=None).fit_plan_to_budget(plan) is plan
