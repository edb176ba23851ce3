"""The observed check on one rank (``megatron.observed``, ``Applier.check_observed``): NCCL's records
stand in through ``reader`` (the text the profiler half prints, ``nccl/plugin/observed.c``), the
gloo pool's record through ``GlooRecord``; a world of one all-gathers to itself. The two-rank gloo
run is ``test_observed_e2e.py``."""

import torch

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.megatron.control.apply import Applier
from lagom_megatron.megatron.control.observed import ObservedCheck, describe, observe_gloo_site
from lagom_megatron.megatron.hooks.sites import GroupInfo
from lagom_megatron.megatron.pool.gloo import GlooRecord, chunked_call
from lagom_megatron.nccl.plugin_status import parse_snapshot
from tests.timeouts import exit_after  # noqa: E402

RING8 = CommConfig(algorithm="Ring", protocol="Simple", n_channels=8)
SNAPSHOT = """\
comm 0 hash=ab rank=0 nranks=8 nnodes=1 abi=6 tag=dp/plugin_any_any_8_t name=dp/plugin_any_any_8_t dropped=0 overflow=0
coll 0 func=ReduceScatter count=131072 dtype=ncclFloat32 algo=RING proto=SIMPLE channels=8 warps=16 calls=3 chunk=0 kernel_ns=9000 kernel_calls=3
coll 0 func=AllGather count=65536 dtype=ncclBfloat16 algo=RING proto=SIMPLE channels=6 warps=16 calls=3 chunk=0 kernel_ns=0 kernel_calls=0
comm 1 hash=cd rank=0 nranks=8 nnodes=1 abi=6 tag=- name=- dropped=0 overflow=0
"""


def _entry(config, op, nbytes):
    return PlanEntry(
        config=config,
        predicted_t_comm_us=1.0,
        predicted_t_region_us=2.0,
        predicted_default_t_region_us=3.0,
        group="dp",
        op=op,
        nbytes=nbytes,
        group_size=8,
        n_nodes=1,
    )


PLAN = Plan(
    entries={
        "dp.rs[0]": _entry(RING8, "reduce_scatter", 4 << 20),
        "dp.ag[0]": _entry(RING8, "all_gather", 1 << 20),
        "dp.ar[0]": _entry(CommConfig(), "all_reduce", 1 << 20),
    }
)


class _Groups:
    def by_name(self, name):
        return GroupInfo(name=name, ranks=tuple(range(8))) if name == "dp" else None

    def names(self):
        return ["dp"]


class _Pool:
    entry = object()

    def __init__(self, name="nccl"):
        self.groups, self.backend = _Groups(), type("B", (), {"name": name})()
        self.stats, self.live, self.estimated_bytes, self.budget_bytes = {}, 0, 0, None

    def group_for(self, info, config):
        return None if config.is_default() else self.entry

    def comm_key(self, group):
        return "dp/plugin_any_any_8_t" if group is self.entry else None


class _Router:
    def __init__(self, assignment):
        self.assignment = dict(assignment)

    def set_assignment(self, a):
        self.assignment = dict(a)


def _check(recorded, state=("lagom", ""), nccl=(2, 30, 7)):
    return ObservedCheck(
        "nccl",
        reader=lambda: parse_snapshot(SNAPSHOT),
        state_reader=lambda: state,
        recorder=lambda on, reset=False: recorded.append((on, reset)) or True,
        version_reader=lambda: nccl,
    )


def test_nccl_records_against_the_plan():
    recorded = []
    check = _check(recorded)
    assert check.arm() is None
    assert check.armed and recorded == [(True, True)], "events on, records reset, when a plan is applied"
    bad = check.check(PLAN, _Pool())
    assert bad == {"dp.ag[0]"} and not check.armed and recorded[-1] == (False, False)
    rs, ag = check.results["dp.rs[0]"], check.results["dp.ag[0]"]
    assert (rs["status"], rs["calls"], rs["rank"]) == ("applied", 3, 0)
    assert (ag["status"], ag["knobs"], ag["observed"]["n_channels"], ag["planned"]["n_channels"]) == (
        "differs",
        ["n_channels"],
        6,
        8,
    )
    assert "dp.ar[0]" not in check.results, "a site the plan leaves at the defaults is not checked"
    assert describe(check.results, bad) == (
        "dp.ag[0] (n_channels planned 8 observed 6; rank 0; clamped: NCCL ran 6 "
        "of the 8 planned channels (NCCL's split of the call gives 8))"
    )


def test_under_an_unread_nccl_a_channel_count_alone_reverts_nothing_and_is_said_once(capsys):
    """The same records under NCCL 2.32.6, newer than the newest NCCL whose channel scheduling lagom read
    (2.31.2): dp.ag[0]'s 6 of 8 channels are reported, the site is not reverted, and the run's log says why
    once, however many checks run."""
    check = _check([], nccl=(2, 32, 6))
    for _ in range(2):
        check.arm()
        assert check.check(PLAN, _Pool()) == set()
    ag = check.results["dp.ag[0]"]
    assert (ag["status"], ag["observed"]["n_channels"]) == ("applied", 6)
    assert ag["note"] == "NCCL ran 6 of the 8 planned channels (not counted: this NCCL's channel rule is not read)"
    said = [line for line in capsys.readouterr().out.splitlines() if "channel scheduling" in line]
    assert said == [
        "lagom: note: the observed check runs on NCCL 2.32.6; the newest NCCL whose channel scheduling lagom has "
        "read is 2.31.2, so a site whose channel count differs is reported, never reverted for it (algorithm, "
        "protocol, threads and chunk size are still checked)"
    ]


def test_applier_reverts_the_differing_sites_after_an_iteration_that_ran_the_plan(monkeypatch):
    router = _Router({"dp.rs[0]": RING8, "dp.ag[0]": RING8})
    applier = Applier(pool=_Pool(), router=router, files=None, cluster=None)
    recorded = []
    applier.observed = _check(recorded)
    assert applier.check_observed(PLAN) == set(), "not armed: nothing to check, no collective"
    applier.observed.arm()
    saved, router.assignment = router.assignment, {}
    assert applier.check_observed(PLAN) == set() and applier.observed.armed, "waits for an iteration routing the plan"
    router.assignment = saved
    assert applier.check_observed(PLAN) == {"dp.ag[0]"}
    assert router.assignment == {"dp.rs[0]": RING8}, "the site goes to its own group, the other stays routed"
    assert applier.summary_part()["observed"]["dp.ag[0]"]["status"] == "differs"


def test_a_users_own_profiler_plugin_is_said_and_leaves_the_sites_unobserved():
    check = ObservedCheck(
        "nccl",
        reader=lambda: [],
        state_reader=lambda: ("foreign", "/opt/site/libnccl-profiler-x.so"),
        recorder=lambda on, reset=False: True,
    )
    note = check.arm()
    assert note == (
        "lagom: note: NCCL_PROFILER_PLUGIN='/opt/site/libnccl-profiler-x.so' is another profiler plugin; "
        "lagom leaves it in place and checks only the tuner's row hits, not what NCCL ran"
    )
    assert check.check(PLAN, _Pool()) == set()
    assert {r["status"] for r in check.results.values()} == {"unobserved"}


def test_a_failing_reader_leaves_every_site_unobserved_and_still_joins():
    def broken():
        raise OSError("mapped library vanished")

    check = ObservedCheck(
        "nccl", reader=broken, recorder=lambda on, reset=False: True, state_reader=lambda: ("lagom", "")
    )
    check.arm()
    assert check.check(PLAN, _Pool()) == set() and check.results == {}
    assert check.errors == ["rank 0: OSError: mapped library vanished"]


def test_without_records_sites_are_unobserved_not_reverted():
    check = ObservedCheck("nccl", reader=lambda: None, recorder=lambda on, reset=False: False)
    assert "lagom's profiler half is not loaded by NCCL" in check.arm()
    assert check.check(PLAN, _Pool()) == set()
    assert {r["status"] for r in check.results.values()} == {"unobserved"}


def test_plan_with_defaults_keeps_the_rest():
    plan = PLAN.with_defaults({"dp.ag[0]"}, note="observed")
    assert plan.entries["dp.ag[0]"].config.is_default() and plan.entries["dp.ag[0]"].predicted_t_region_us == 3.0
    assert plan.entries["dp.rs[0]"].config == RING8 and plan.stats["sites_reverted"] == ["dp.ag[0]"]
    assert plan.with_defaults({"dp.rs[0]"}, note="x").stats["sites_reverted"] == ["dp.ag[0]", "dp.rs[0]"]


class _GlooGroup:
    def __init__(self, threads):
        self.threads = threads

    def _get_backend(self, device):
        return type("Backend", (), {"options": type("Options", (), {"_threads": self.threads})()})()


def test_gloo_record_threads_of_the_group_a_call_ran_on_and_its_pieces(monkeypatch):
    from lagom_megatron.megatron.pool import gloo

    monkeypatch.setattr(gloo, "in_coalescing", lambda group: False)  # no default group in this process
    rec, entry = GlooRecord(), _GlooGroup(4)
    rec.start()
    seen = []
    t = torch.zeros(16384)  # 64 KiB
    chunked_call("all_reduce", lambda *a, **k: None, (t,), {}, 16384, 2, observe=seen.append)
    chunked_call("all_reduce", lambda *a, **k: None, (torch.zeros(1024),), {}, 16384, 2, observe=seen.append)
    assert seen == [16384, 0], "the largest piece, or 0 when the tensor went out whole"
    for piece in seen:
        rec.note("dp", "LAGOM_POOL_DP_threads_4", entry, "all_reduce", 65536, piece)
    assert rec.calls[("dp", "LAGOM_POOL_DP_threads_4", "all_reduce", 65536)] == [2, {4}, {16384, 0}]
    ok = observe_gloo_site(
        "s",
        CommConfig(n_channels=4, chunk_size=16384),
        op="all_reduce",
        nbytes=65536,
        group_size=2,
        record=[1, {4}, {16384}],
    )
    assert ok.status == "applied" and ok.observed == {"n_channels": 4, "chunk_size": 16384}
    whole = observe_gloo_site(
        "s", CommConfig(chunk_size=16384), op="all_gather", nbytes=65536, group_size=8, record=[1, {2}, {0}]
    )
    assert whole.status == "applied", "one rank's 8 KiB share fits one piece: issued whole is as planned"
    bad = observe_gloo_site(
        "s", CommConfig(n_channels=4), op="all_reduce", nbytes=65536, group_size=2, record=[3, {2}, {0}]
    )
    assert bad.status == "differs" and bad.observed == {"n_channels": 2}
    assert (
        observe_gloo_site("s", CommConfig(n_channels=4), op="all_reduce", nbytes=1, group_size=2, record=None).status
        == "unobserved"
    )


def test_report_lists_planned_vs_observed_per_knob():
    from lagom_megatron.megatron.outputs.report import render_markdown

    check = _check([])
    check.arm()
    check.check(PLAN, _Pool())
    md = render_markdown([], {"phase": "applied", "observed": check.results})
    table = md[md.index("## Applied = observed") :].splitlines()
    assert (
        "| `dp.ag[0]` | differs: reverted to the defaults | n_channels (differs) | 8 | 6 | 0 | clamped: NCCL ran 6 of "
        "the 8 planned channels (NCCL's split of the call gives 8) |" in table
    )
    assert "| `dp.rs[0]` | applied | algorithm | Ring | Ring | 0 |  |" in table
    assert "## Applied = observed" not in render_markdown([], {"phase": "applied"}), "no check ran: no section"


UNMATCHED = Plan(
    entries={
        "dp.rs[0]": _entry(RING8, "reduce_scatter", 4 << 20),
        "dp.ar[1]": _entry(RING8, "all_reduce", 2 << 20),  # changed, and no record of 2 MiB all-reduces
        "dp.ar[0]": _entry(CommConfig(), "all_reduce", 1 << 20),  # NCCL's defaults: not checked
    }
)


def test_a_changed_site_no_record_matched_did_not_run_as_planned():
    check = _check([])
    check.arm()
    assert check.check(UNMATCHED, _Pool()) == {"dp.ar[1]"}
    r = check.results["dp.ar[1]"]
    assert (r["status"], r["knobs"], r["observed"]) == ("differs", ["calls"], {"calls": 0})
    assert describe(check.results, {"dp.ar[1]"}).startswith(
        "dp.ar[1] (calls planned >= 1 observed 0; rank 0; no record"
    )
    assert "dp.ar[0]" not in check.results


def test_no_record_is_unobserved_only_where_nothing_could_be_seen():
    """Profiler half absent (the arm note says so, once) or its communicator's name unknown: unobserved."""
    absent = ObservedCheck("nccl", reader=lambda: [], recorder=lambda on, reset=False: False)
    assert "not loaded by NCCL" in absent.arm()
    assert absent.check(UNMATCHED, _Pool()) == set()
    assert absent.results["dp.ar[1]"]["status"] == "unobserved"
    nameless = _check([])
    nameless.arm()
    pool = _Pool()
    pool.comm_key = lambda group: None
    assert nameless.check(UNMATCHED, pool) == set()
    assert {r["status"] for r in nameless.results.values()} == {"unobserved"}


def _unmatched_worker(rank, store_path, out_path):
    """Rank 0's records hold dp.ar[1]'s 2 MiB all-reduce as planned, rank 1's none: both ranks revert it."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mine = SNAPSHOT + (
            "comm 2 hash=ef rank=0 nranks=8 nnodes=1 abi=6 tag=dp/plugin_any_any_8_t name=- dropped=0 overflow=0\n"
            "coll 2 func=AllReduce count=524288 dtype=ncclFloat32 algo=RING proto=SIMPLE channels=8 warps=16 calls=1 "
            "chunk=0 kernel_ns=0 kernel_calls=0\n"
            if rank == 0
            else ""
        )
        router = _Router({"dp.rs[0]": RING8, "dp.ar[1]": RING8})
        applier = Applier(pool=_Pool(), router=router, files=None, cluster=None)
        applier.observed = ObservedCheck(
            "nccl",
            reader=lambda: parse_snapshot(mine),
            state_reader=lambda: ("lagom", ""),
            recorder=lambda on, reset=False: True,
            version_reader=lambda: (2, 30, 7),
        )
        applier.observed.arm()
        own = applier.observed.local(UNMATCHED, _Pool())  # this rank's verdict, before the collective check
        bad = applier.check_observed(UNMATCHED)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(
                {
                    "bad": sorted(bad),
                    "routed": sorted(router.assignment),
                    "own": {o.site_id: o.status for o in own},
                    "rank": applier.observed.results["dp.ar[1]"]["rank"],
                },
                f,
            )
    finally:
        dist.destroy_process_group()


def test_a_changed_site_that_never_matched_on_one_rank_is_reverted_on_every_rank(tmp_path):
    import json

    import torch.multiprocessing as mp

    mp.spawn(exit_after, args=(_unmatched_worker, str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert got[0]["own"]["dp.ar[1]"] == "applied" and got[1]["own"]["dp.ar[1]"] == "differs"
    for g in got:
        assert g["bad"] == ["dp.ar[1]"] and g["routed"] == ["dp.rs[0]"] and g["rank"] == 1, g
