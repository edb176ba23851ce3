"""Every failure of applying a plan on one rank is caught by the collective abort path
(``consensus.collective_step``): the table export refusing the plan, the table write failing, the
unused probe entries failing to go, the pool budget. ``apply`` then returns False after a revert
(every entry destroyed, the router's assignment cleared) instead of raising into training.
Single process: ``collective_step`` all-gathers over a world of one. Also: the pool's mechanism
follows the agreed capabilities, not ``NCCL_TUNER_PLUGIN``'s text."""

import pytest

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.megatron import consensus
from lagom_megatron.megatron.control.apply import Applier
from lagom_megatron.megatron.hooks.sites import GroupNames
from lagom_megatron.megatron.pool.comm_pool import CommPool, PoolBudgetExceeded
from lagom_megatron.nccl.capabilities import gather_local
from lagom_megatron.nccl.plugin_status import PluginStatus
from lagom_megatron.nccl.pool import NcclPoolBackend


class _Pool:
    """A CommPool stand-in: ``prepare`` runs its three steps through ``step`` as CommPool does."""

    def __init__(self, backend, *, destroy_error=None, prepare_error=None):
        self.backend, self.groups = backend, GroupNames(local_world_size=1)
        self.destroy_error, self.prepare_error = destroy_error, prepare_error
        self.live, self.destroyed, self.stats, self.estimated_bytes, self.budget_bytes = 2, [], {}, 0, None
        self.keys_invalidated = 0

    def invalidate_keys(self):
        self.keys_invalidated += 1

    def destroy(self, keep=None):
        if keep is not None and self.destroy_error is not None:
            raise self.destroy_error
        self.destroyed.append(keep)
        n, self.live = self.live, 0 if keep is None else self.live
        return n if keep is None else 0

    def prepare(self, needs, *, step, ops=None):
        def preflight():
            if self.prepare_error is not None:
                raise self.prepare_error

        step("pool-preflight", preflight)
        step("pool-create", lambda: 0)
        step("first-use", lambda: None)
        return 0

    def describe(self):
        return f"{self.live} entries"

    def entries(self):
        return []


class _Router:
    def __init__(self):
        self.assignments = []

    def set_assignment(self, a):
        self.assignments.append(a)


class _Files:
    def __init__(self, tmp_path, error=None):
        self.tmp_path, self.error = tmp_path, error

    @property
    def tuner_table(self):
        if self.error is not None:
            raise self.error
        return self.tmp_path / "tuner_table.rank0.csv"


def _entry(config, nbytes=1 << 20, op="reduce_scatter"):
    return PlanEntry(
        config=config,
        predicted_t_comm_us=1.0,
        predicted_t_region_us=2.0,
        predicted_default_t_region_us=3.0,
        group="tp",
        op=op,
        nbytes=nbytes,
        group_size=8,
        n_nodes=1,
    )


def _plan(**entries):
    return Plan(entries=entries, backend="nccl", mechanism="tuner")


def _applier(tmp_path, *, plugin=True, files_error=None, **pool_kw):
    pool = _Pool(NcclPoolBackend(use_tuner_plugin=plugin), **pool_kw)
    a = Applier(pool=pool, router=_Router(), files=_Files(tmp_path, files_error), cluster=None)
    return a, pool


def test_a_plan_the_exporter_refuses_falls_back_instead_of_raising(tmp_path):
    # two sites NCCL's tuner sees as one call (tp, reduce-scatter, 1 MiB) with different configs
    plan = _plan(**{"tp.a[0]": _entry(CommConfig(n_channels=4)), "tp.a[1]": _entry(CommConfig(n_channels=8))})
    a, pool = _applier(tmp_path)
    assert a.apply_plan(plan) is False
    assert a.error.startswith("applying plan") and "table failed on rank 0" in a.error
    assert "same collective to a tuner plugin" in a.error
    assert pool.destroyed == [None] and a.router.assignments == [{}]


def test_a_table_that_cannot_be_written_falls_back(tmp_path):
    plan = _plan(**{"tp.a[0]": _entry(CommConfig(n_channels=4))})
    a, pool = _applier(tmp_path, files_error=PermissionError(13, "Permission denied", "tuner_table.rank0.csv"))
    assert a.apply_plan(plan) is False
    assert "table failed on rank 0" in a.error and "PermissionError" in a.error
    assert pool.destroyed == [None]


def test_probe_entries_that_cannot_be_destroyed_fall_back(tmp_path):
    plan = _plan(**{"tp.a[0]": _entry(CommConfig(n_channels=4))})
    a, pool = _applier(tmp_path, plugin=False, destroy_error=ValueError("n_channels must be an integer in 1..64"))
    assert a.apply_plan(plan) is False
    assert "table failed on rank 0 " in a.error and "n_channels must be" in a.error


def test_pool_budget_falls_back(tmp_path):
    plan = _plan(**{"tp.a[0]": _entry(CommConfig(n_channels=4))})
    a, pool = _applier(tmp_path, prepare_error=PoolBudgetExceeded("2 new communicator-pool entries need ~300 MiB"))
    assert a.apply_plan(plan) is False
    assert "pool-preflight failed on rank 0" in a.error and "PoolBudgetExceeded" in a.error


def test_a_plan_that_applies_writes_the_rows_plan_hit_summary_reads(tmp_path):
    from lagom_megatron.nccl.export import parse_tuner_csv, tuner_rows

    plan = _plan(
        **{
            "tp.a[0]": _entry(CommConfig(n_channels=4)),
            "tp.a[1]": _entry(CommConfig(n_channels=4)),
            "tp.b[0]": _entry(CommConfig(algorithm="Ring", protocol="LL128"), nbytes=4096, op="all_gather"),
        }
    )
    a, pool = _applier(tmp_path)
    assert a.apply_plan(plan) is True and a.error is None
    table = pool.backend.tuner_table
    rows = parse_tuner_csv(open(table).read())
    assert [tuple(r.values()) for r in rows] == [r.cells for r in tuner_rows(plan, extended=True)]
    assert [r["commTag"] for r in rows] == ["tp", "tp"]  # what the entries' tags "tp/<key>" match
    assert pool.backend.table_id == plan.digest()[:12] and pool.backend.cta_bound == 4


def _caps(status):
    return gather_local(
        environ={"NCCL_TUNER_PLUGIN": "/opt/lagom/libnccl-tuner-lagom.so"},
        status_reader=lambda: status,
        nccl_version=(2, 30, 3),
        config_fields=("max_ctas", "min_ctas"),
        multicast=False,
        torch_version="2.9.1",
    )


@pytest.mark.parametrize(
    "status, mechanism",
    [
        (None, "communicator"),  # the variable is set but NCCL did not load the plugin (wrong path, none, NCCL < 2.22)
        (PluginStatus(path="x", abi_version=6, init_count=1, row_hits=(), table_loaded=False), "tuner"),
    ],
)
def test_pool_mechanism_follows_the_agreed_capabilities(status, mechanism):
    pool = CommPool(NcclPoolBackend(), GroupNames(local_world_size=1))
    a = Applier(pool=pool, router=_Router(), files=None, cluster=None)
    caps = a.agree_capabilities(on_gpu=False, gather=lambda: _caps(status))
    assert caps.mechanism() == mechanism
    assert pool.backend.use_tuner_plugin is (mechanism == "tuner") and pool.backend.plugin_active is (
        mechanism == "tuner"
    )


def test_collective_step_names_the_step_and_rank():
    with pytest.raises(consensus.ApplyFailed, match=r"table failed on rank 0 \(.*\): OSError: disk full"):
        consensus.collective_step("table", lambda: (_ for _ in ()).throw(OSError("disk full")))


def test_a_budget_fit_failure_on_one_rank_reaches_every_rank_through_the_agreement(capsys):
    """The budget fit runs before the agreement; a rank where it fails must still enter
    ``agree_plan`` (with None), or the others wait there for it forever."""
    from lagom_megatron.megatron.control.controller import LagomController

    def refuse(plan):
        raise ValueError("n_channels must be an integer in 1..32 for NCCL 2.21.5; got 48")

    ctl = LagomController()
    ctl.applier = type("Applier", (), {"fit_plan_to_budget": staticmethod(refuse)})()
    with pytest.raises(consensus.PlanDisagreement, match=r"the search failed on rank\(s\) \[0\]"):
        ctl._agree(_plan(**{"tp.a[0]": _entry(CommConfig(n_channels=48))}))
    assert "fitting the plan to the pool budget failed: n_channels must be" in capsys.readouterr().out


def test_a_plan_of_another_mechanism_falls_back(tmp_path):
    """A plan searched for the tuner plugin, applied where NCCL did not load it (its chunk size and
    LL128 would be dropped or refused), is refused in the table step on every rank."""
    a, pool = _applier(tmp_path, plugin=False)
    a.capabilities = _caps(None)
    plan = _plan(**{"tp.a[0]": _entry(CommConfig(protocol="LL128", chunk_size=262144))})
    assert a.apply_plan(plan) is False
    assert "searched for mechanism 'tuner' but this run applies 'communicator'" in a.error
    assert pool.destroyed == [None]


def test_capabilities_that_cannot_be_gathered_leave_tuning_off(capsys):
    def broken():
        raise PermissionError(13, "Permission denied", "/etc/nccl.conf")

    pool = CommPool(NcclPoolBackend(), GroupNames(local_world_size=1))
    a = Applier(pool=pool, router=_Router(), files=None, cluster=None)
    assert a.agree_capabilities(on_gpu=False, gather=broken) is None
    assert "capabilities failed on rank 0" in a.error and "/etc/nccl.conf" in a.error
    assert pool.backend.use_tuner_plugin is False
