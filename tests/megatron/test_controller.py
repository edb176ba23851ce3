"""Controller decisions and rank consensus that need no processes: plan reuse vs. re-search by
fingerprint, slowest-rank merge of measurements, digest check."""

import math

import pytest

from lagom_megatron.config.plan_files import load_plan
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.megatron import consensus
from lagom_megatron.megatron.control.controller import LagomController


def _plan(fingerprint):
    entry = PlanEntry(
        config=CommConfig(n_channels=1),
        predicted_t_comm_us=10.0,
        predicted_t_region_us=12.0,
        group="dp",
        op="reduce_scatter",
        nbytes=4096,
        group_size=2,
    )
    return Plan(
        entries={"dp.grad_reduce_scatter[chunk0.bucket0]": entry},
        fingerprint=fingerprint,
        backend="gloo",
        mechanism="gloo",
    )  # as the search writes a gloo plan; "tuner" would fail validation


FP = {"hidden_size": 128, "num_layers": 4, "tensor_model_parallel_size": 2, "world_size": 4, "backend": "gloo"}


def test_mismatched_fingerprint_means_re_search_with_a_warning_naming_the_field(tmp_path, capsys):
    path = tmp_path / "plan.json"
    other = _plan(dict(FP, hidden_size=256))
    other.save(path)
    ctl = LagomController(plan_path=str(path))
    ctl.fingerprint = dict(FP)
    assert ctl._try_reuse_plan() is False
    out = capsys.readouterr().out
    assert "fingerprint differs in hidden_size" in out and "plan 256 vs run 128" in out, out
    assert ctl.mode == "off" and ctl.plan is None
    # the other run's plan is moved aside under its digest, never overwritten by the new search
    kept = tmp_path / f"plan.{other.digest()[:12]}.json"
    assert not path.exists() and load_plan(kept).digest() == other.digest()
    assert f"the other plan is kept as {kept}" in out, out


def test_plan_rejected_by_its_verification_is_not_applied_again(tmp_path, capsys):
    path = tmp_path / "plan.json"
    _plan(dict(FP)).with_stats(verification="fell_back", verification_reason="gain 0.1% below noise 2%").save(path)
    ctl = LagomController(plan_path=str(path))
    ctl.fingerprint = dict(FP)
    assert ctl._try_reuse_plan() is True  # no new search either: the verdict stands
    out = capsys.readouterr().out
    assert "phase fell_back" in out and "gain 0.1% below noise 2%" in out, out
    summary = ctl.summary()  # one name for the state everywhere: the plan's own "fell_back"
    assert summary["phase"] == "fell_back" and summary["run_kind"] == "reused"
    assert "rejected by its own verification (gain 0.1% below noise 2%)" in summary["reason"]
    assert summary["plan_path"] == str(path) and summary["profile_path"] is None  # no profile.json exists


def test_never_verified_plan_is_verified_not_applied_blind(tmp_path, capsys, monkeypatch):
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.engine.steps import Phase

    path = tmp_path / "plan.json"
    _plan(dict(FP)).save(path)  # as `lagom search` writes it: no verification verdict
    ctl = LagomController(plan_path=str(path), verify_iters=2)
    ctl.fingerprint, ctl.cluster, ctl.backend = dict(FP), ClusterSpec.load("cpu-gloo"), "gloo"
    monkeypatch.setattr(ctl, "_prepare_pool_for_plan", lambda plan: True)
    assert ctl._try_reuse_plan() is True
    out = capsys.readouterr().out
    assert "phase verifying" in out and "never verified" in out and "5 iterations to verify it" in out, out
    assert ctl.mode == "tune" and ctl.tuner.phase is Phase.SEARCHED
    assert ctl.tuner.next_step().kind == "settle" and ctl.tuner.next_step().assignment == {
        "dp.grad_reduce_scatter[chunk0.bucket0]": CommConfig(n_channels=1)
    }


def test_unreadable_plan_means_re_search(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    ctl = LagomController(plan_path=str(path))
    ctl.fingerprint = dict(FP)
    assert ctl._try_reuse_plan() is False
    assert "cannot reuse plan" in capsys.readouterr().out


def test_run_directory_defaults():
    ctl = LagomController(plan_path="runs/a/plan.json")
    files = ctl.files
    assert (str(files.run_dir), str(files.profile_path), str(files.report_path)) == (
        "runs/a",
        "runs/a/profile.json",
        "runs/a/report.md",
    )
    assert str(LagomController().files.plan_path) == "lagom_out/run/plan.json"
    assert str(LagomController(preset_name="cpu-pp2-dp2").files.plan_path) == "lagom_out/cpu-pp2-dp2/plan.json"


def test_merge_keeps_the_slowest_rank_per_region(monkeypatch):
    site = {
        "site_id": "tp.sp_all_gather[0]",
        "op": "all_gather",
        "nbytes": 100,
        "dtype": "float32",
        "group": "tp",
        "group_size": 2,
        "n_nodes": 1,
        "calls_per_iter": 2,
    }
    sp, dp = "tp.sp_all_gather[0]", "dp.grad_reduce_scatter[0]"
    ranks = [
        (
            {sp: site},
            {sp: (50.0, math.nan, 70.0), dp: (8.0, math.nan, 8.0)},
            1000.0,
            {sp: [(20.0, math.nan, 30.0), (30.0, math.nan, 40.0)], dp: [(8.0, math.nan, 8.0)]},
        ),
        (
            {sp: dict(site, nbytes=120)},
            {sp: (40.0, 30.0, 90.0), "pp.send_recv": (5.0, 0.0, 5.0), dp: (9.0, 1.0, 9.0)},
            1200.0,
            {sp: [(25.0, 10.0, 50.0), (15.0, 20.0, 45.0)], dp: [(4.0, 0.0, 4.0), (5.0, 1.0, 5.0)]},
        ),
        ({}, {sp: (45.0, 35.0, 60.0)}, 900.0, {sp: [(22.0, 15.0, 20.0), (23.0, 20.0, 40.0)]}),
    ]
    monkeypatch.setattr(consensus, "all_gather", lambda obj: ranks)
    sites, timings, it_us, calls = consensus.merge_measurements({}, {}, 0.0)
    assert it_us == 1200.0
    assert sites["tp.sp_all_gather[0]"]["nbytes"] == 120
    assert timings["pp.send_recv"] == (5.0, 0.0, 5.0)
    assert timings[dp] == (9.0, 1.0, 9.0)  # the slowest rank per region (its ranks timed 1 and 2 calls: none kept)
    # call by call, the three times of the rank whose region was longest; the sums follow them
    assert calls == {sp: ((25.0, 10.0, 50.0), (15.0, 20.0, 45.0))}
    assert timings[sp] == (40.0, 30.0, 95.0)


def test_digest_mismatch_raises_naming_the_rank(monkeypatch):
    plan = _plan(FP)
    assert consensus.agree_plan(plan, from_dict=Plan.from_dict).digest() == plan.digest()  # one process
    # the first all-gather carries the "search failed" flags (none failed), the second the digests
    monkeypatch.setattr(consensus, "all_gather", lambda d: [d, d, d] if isinstance(d, bool) else [d, "0" * 64, d])
    with pytest.raises(
        consensus.PlanDisagreement, match=r"plan digest mismatch: rank 0 has \w{12}, rank 1 000000000000"
    ):
        consensus.agree_plan(plan, from_dict=Plan.from_dict)


def test_fault_injection_changes_the_digest_not_the_routing(monkeypatch):
    plan = _plan(FP)
    monkeypatch.setenv(consensus.FAULT_ENV, "0")
    perturbed = consensus.agree_plan(plan, from_dict=Plan.from_dict)  # rank 0 of 1: its own copy changes
    assert perturbed.digest() != plan.digest()
    assert {k: e.config for k, e in perturbed.entries.items()} == {k: e.config for k, e in plan.entries.items()}


def test_a_search_failure_on_one_rank_aborts_tuning_on_every_rank(monkeypatch):
    # rank 0 searched fine, rank 1 failed (plan None): every rank must raise, none may wait in the broadcast
    monkeypatch.setattr(consensus, "all_gather", lambda obj: [False, True])
    with pytest.raises(consensus.PlanDisagreement, match=r"search failed on rank\(s\) \[1\]"):
        consensus.agree_plan(_plan(dict(FP)), from_dict=Plan.from_dict)


def test_plan_table_is_written_before_the_plugin_entries_are_created(tmp_path):
    """The GPU path with lagom's tuner plugin, on stand-ins: NcclPoolBackend's attributes and a
    pool that records prepare(). The plan table must exist (this rank's copy) and be named in the
    backend before the entries are created, keyed by the plan digest, as ``NcclPoolBackend``
    passes it to the communicators it creates (LAGOM_TUNER_CONFIG)."""
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.nccl.export import parse_tuner_csv
    from lagom_megatron.nccl.pool import NcclPoolBackend

    backend = NcclPoolBackend(use_tuner_plugin=True)
    backend.plugin_active = False  # as during the warm-up probes
    events = []

    class Pool:
        def invalidate_keys(self):
            events.append(("invalidate", backend.plugin_active))

        def prepare(self, needs, *, step, ops=None):
            table = backend.tuner_table
            events.append(("prepare", needs, table, (tmp_path / "tuner_table.rank0.csv").is_file()))

        def destroy(self, keep=None):
            events.append(("destroy", keep))
            return 0

        def describe(self):
            return "1 entries"

        def entries(self):
            return []

    entry = PlanEntry(
        config=CommConfig(n_channels=4, algorithm="Ring", protocol="Simple"),
        predicted_t_comm_us=10.0,
        predicted_t_region_us=12.0,
        group="tp",
        op="all_gather",
        nbytes=1 << 20,
        group_size=8,
    )
    plan = Plan(entries={"tp.sp_all_gather[0]": entry}, fingerprint={"cluster": "h100-sxm-ib400"}, backend="nccl")
    ctl = LagomController(plan_path=str(tmp_path / "plan.json"))
    from lagom_megatron.megatron.control.apply import Applier

    ctl.pool, ctl.cluster = Pool(), ClusterSpec.load("h100-sxm-ib400")
    pool = ctl.pool
    pool.backend = backend
    ctl.applier = Applier(pool=pool, router=None, files=ctl.files, cluster=ctl.cluster)
    assert ctl._prepare_pool_for_plan(plan) is True
    table = tmp_path / "tuner_table.rank0.csv"
    assert events == [
        ("invalidate", True),
        ("destroy", {"tp": {entry.config}}),
        ("prepare", {"tp": {entry.config}}, str(table), True),
    ], events
    assert backend.cta_bound == 4  # plugin entries are created with CTA bounds = the plan's largest count
    assert backend.table_id == plan.digest()[:12]
    (row,) = parse_tuner_csv(table.read_text())
    assert (row["collective_type"], row["algorithm"], row["protocol"], row["channels"], row["commTag"]) == (
        "allgather",
        "ring",
        "simple",
        "4",
        "tp",
    )


def test_train_end_logs_the_plugin_hit_summary(tmp_path, capsys, monkeypatch):
    """With the plugin active, the controller's last lines say how many plan rows NCCL matched
    (here no plugin is loaded in the process, and the line says so instead of claiming success)."""
    from lagom_megatron.nccl import plugin_status
    from lagom_megatron.nccl.pool import NcclPoolBackend

    monkeypatch.setattr(plugin_status, "read_plugin_status", lambda: None)  # another test may have loaded it here
    entry = PlanEntry(
        config=CommConfig(n_channels=4, algorithm="Ring", protocol="Simple"),
        predicted_t_comm_us=10.0,
        predicted_t_region_us=12.0,
        group="tp",
        op="all_gather",
        nbytes=1 << 20,
        group_size=8,
    )
    ctl = LagomController(plan_path=str(tmp_path / "plan.json"))
    ctl.plan = Plan(entries={"tp.sp_all_gather[0]": entry}, backend="nccl")
    ctl.pool = type("Pool", (), {"backend": NcclPoolBackend(use_tuner_plugin=True)})()
    ctl.pool.backend.plugin_active = True
    ctl.mode, ctl.applier = "reuse", type("Applier", (), {"error": None})()
    ctl._reported = True  # the report is not what this test is about
    ctl.on_train_end()
    assert (
        "lagom: tuner plugin not loaded by NCCL in this process: none of the 1 planned rows can have been applied"
        in capsys.readouterr().out.splitlines()
    )
    # a plan whose application was reverted has no rows in NCCL: no hit summary claims otherwise
    ctl.mode, ctl.applier.error = "aborted", "applying plan x failed: table failed on rank 1"
    ctl.on_train_end()
    assert "tuner plugin" not in capsys.readouterr().out


def test_reused_plan_of_another_method_says_so_and_counts_only_changed_sites(tmp_path, capsys, monkeypatch):
    path = tmp_path / "plan.json"
    plan = _plan(dict(FP))
    plan.entries["dp.other"] = PlanEntry(
        config=CommConfig(n_channels=2),
        predicted_t_comm_us=1.0,
        predicted_t_region_us=1.0,
        group="dp",
        op="all_reduce",
        nbytes=8,
    )
    plan.with_stats(verification="applied", verification_reason="gain 5%").save(path)
    ctl = LagomController(plan_path=str(path), method="autoccl")
    ctl.fingerprint, ctl.backend = dict(FP), "gloo"

    class Router:
        def set_assignment(self, a):
            self.assignment = a

    ctl.router = Router()
    monkeypatch.setattr(ctl, "_prepare_pool_for_plan", lambda plan: True)
    assert ctl._try_reuse_plan() is True
    out = capsys.readouterr().out
    # n_channels=2 is gloo's default thread count: routed, but no change, so not "tuned"
    assert "1/2 sites tuned" in out, out
    assert "--lagom-method autoccl not used" in out and "searched with priority" in out, out


@pytest.mark.parametrize("verification", [None, "fell_back"])
def test_another_method_is_named_for_a_never_verified_or_rejected_plan_too(tmp_path, capsys, monkeypatch, verification):
    """The warning was printed only when a verified plan was applied: silent for the two other branches."""
    path = tmp_path / "plan.json"
    plan = _plan(dict(FP))
    (
        plan.with_stats(verification=verification, verification_reason="gain 0.1% below noise 2%")
        if verification
        else plan
    ).save(path)
    ctl = LagomController(plan_path=str(path), method="autoccl", verify_iters=2)
    from lagom_megatron.engine.cluster import ClusterSpec

    ctl.fingerprint, ctl.cluster, ctl.backend = dict(FP), ClusterSpec.load("cpu-gloo"), "gloo"
    monkeypatch.setattr(ctl, "_prepare_pool_for_plan", lambda plan: True)
    assert ctl._try_reuse_plan() is True
    lines = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert lines == [
        f"lagom: WARNING: --lagom-method autoccl not used: plan {path} was searched with priority; "
        "delete it or pass another --lagom-plan to search with autoccl"
    ]


def test_run_too_short_or_interrupted_is_named_with_its_reason(tmp_path):
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.megatron.pool.comm_pool import rules_for

    ctl = LagomController(plan_path=str(tmp_path / "plan.json"), warmup_iters=1, verify_iters=2)
    ctl.fingerprint, ctl.cluster, ctl.backend = dict(FP), ClusterSpec.load("cpu-gloo"), "gloo"
    ctl.pool = None
    ctl._start_tuner()
    assert rules_for("gloo", ctl.cluster).backend == "gloo"
    ctl.train_iters, ctl.last_iteration = 8, 8
    s = ctl.summary()
    assert s["run_kind"] == "unfinished" and s["plan_path"] is None and s["profile_path"] is None
    assert (
        f"--train-iters 8 ended while lagom was profiling: tuning needs {ctl.tuner.total_iters} iterations"
        in s["reason"]
    )
    ctl.last_iteration = 3
    s = ctl.summary()
    assert s["run_kind"] == "interrupted" and "training stopped at iteration 3 of 8" in s["reason"]


def test_a_reused_plan_is_fitted_to_the_pool_budget_before_it_is_applied(tmp_path, monkeypatch, capsys):
    """A plan searched elsewhere (``lagom search``) never met this run's budget: reuse trims it as
    the tuning path does, and applies the trimmed plan; a fit that fails keeps the defaults."""
    path = tmp_path / "plan.json"
    _plan(dict(FP)).with_stats(verification="applied", verification_reason="gain 5%").save(path)
    ctl = LagomController(plan_path=str(path))
    ctl.fingerprint, ctl.backend = dict(FP), "gloo"
    ctl.router = type("Router", (), {"set_assignment": lambda self, a: None})()
    trimmed = _plan(dict(FP)).with_stats(
        verification="applied", verification_reason="gain 5%", sites_dropped_for_budget=1
    )
    ctl.applier = type("Applier", (), {"fit_plan_to_budget": staticmethod(lambda plan: trimmed)})()
    applied = []
    monkeypatch.setattr(ctl, "_prepare_pool_for_plan", lambda plan: applied.append(plan) or True)
    assert ctl._try_reuse_plan() is True
    assert applied == [trimmed] and ctl.plan is trimmed and ctl.mode == "reuse"

    def refuse(plan):
        raise ValueError("n_channels must be an integer in 1..32; got 48")

    ctl = LagomController(plan_path=str(path))
    ctl.fingerprint, ctl.backend, ctl.applier = (
        dict(FP),
        "gloo",
        type("Applier", (), {"fit_plan_to_budget": staticmethod(refuse)})(),
    )
    assert ctl._try_reuse_plan() is True and ctl.mode == "aborted"
    assert "cannot be fitted to the pool budget: n_channels must be" in capsys.readouterr().out


def _registering_plan(config):
    entry = PlanEntry(
        config=config,
        predicted_t_comm_us=10.0,
        predicted_t_region_us=12.0,
        group="dp",
        op="all_gather",
        nbytes=256 * 2**20,
        group_size=8,
    )
    fp = dict(FP, backend="nccl")
    plan = Plan(entries={"dp.param_all_gather[chunk0.bucket0]": entry}, fingerprint=fp, registered_groups=("dp",))
    return plan, fp


def _nccl_controller(path, fp, registered_now):
    import types

    from lagom_megatron.engine.cluster import ClusterSpec

    ctl = LagomController(plan_path=str(path), verify_iters=2)
    ctl.fingerprint, ctl.cluster, ctl.backend = fp, ClusterSpec.load("h100-sxm-ib400"), "nccl"
    ctl.applier = types.SimpleNamespace(capabilities=None, fit_plan_to_budget=lambda plan: plan)
    ctl.pool = types.SimpleNamespace(budget_bytes=None)
    ctl.registered_now = frozenset(registered_now)
    return ctl


def test_a_plan_of_registered_buffers_only_is_applied_where_they_are_registered(tmp_path, capsys):
    # every entry on NCCL's defaults: on the registered window NCCL runs its own symmetric kernels, nothing to verify
    path = tmp_path / "plan.json"
    plan, fp = _registering_plan(CommConfig())
    plan.save(path)
    ctl = _nccl_controller(path, fp, {"dp"})
    assert ctl._try_reuse_plan() is True
    out = capsys.readouterr().out
    assert "phase applied" in out and "registered buffers of dp: NCCL's own choice, no verify" in out, out
    assert load_plan(path).stats["verification"] == "applied"


def test_a_copy_engine_plan_is_verified_whole_where_its_buffers_are_registered(tmp_path, capsys, monkeypatch):
    from lagom_megatron.engine.steps import Phase

    path = tmp_path / "plan.json"
    plan, fp = _registering_plan(CommConfig(cta_policy="ZERO"))
    plan.save(path)
    ctl = _nccl_controller(path, fp, {"dp"})
    monkeypatch.setattr(ctl, "_prepare_pool_for_plan", lambda plan: True)
    assert ctl._try_reuse_plan() is True
    assert "phase verifying" in capsys.readouterr().out
    assert ctl.tuner.phase is Phase.SEARCHED
    assert ctl.tuner.next_step().assignment == {"dp.param_all_gather[chunk0.bucket0]": CommConfig(cta_policy="ZERO")}
    # a launch without the registration could run none of it: the copy-engine site stays on NCCL's defaults
    other = _nccl_controller(path, fp, ())
    assert other._try_reuse_plan() is True and other.tuner is None
    out = capsys.readouterr().out
    assert "registers the buffers of dp (--use-nccl-ub), which this launch did not register" in out, out
    assert "phase fell_back | nothing else in the plan to apply" in out
