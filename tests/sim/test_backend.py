"""The simulated backend and the whole lifecycle on it, with the real engine (fit, search, plan)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lagom_megatron.engine.cost_model as cost_model_mod
import lagom_megatron.engine.fit as fit_mod
import lagom_megatron.engine.search as search_mod
from lagom_megatron.config.plan_files import load_plan
from lagom_megatron.config.presets import load_preset
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import DEFAULT, CommConfig
from lagom_megatron.engine.profile import CollectiveSite, Profile, Sample
from lagom_megatron.engine.steps import IterationMeasurement, Phase
from lagom_megatron.engine.tuner import Tuner
from lagom_megatron.nccl.rules import NcclRules
from lagom_megatron.sim.backend import SimulatedCluster, run_lifecycle
from lagom_megatron.sim.workload import Workload
from tests.timeouts import COMMAND_S

SITE_PATTERNS = [  # the real hooks' scheme (lagom_megatron.megatron.hooks.sites)
    r"dp\.grad_reduce_scatter\[chunk\d+\.bucket\d+\]",
    r"dp\.grad_all_reduce\[chunk\d+\.bucket\d+\]",
    r"dp\.param_all_gather\[chunk\d+\.bucket\d+\]",
    r"tp\.(sp_all_gather|sp_reduce_scatter|dgrad_all_reduce)\[\d+\]",
    r"pp\.send_recv",
    r"ep\.(dispatch|combine)_all_to_all\[\d+\]",
    r"cp\.ring_exchange\[layer\d+\]",
]


@pytest.fixture(scope="module")
def gpt13b():
    return SimulatedCluster(load_preset("gpt3-13b-h100x64"), seed=3)


def test_sites_follow_the_hooks_naming_and_shapes(gpt13b):
    sites = gpt13b.sites
    assert sites and len({s.site_id for s in sites}) == len(sites)
    for s in sites:
        assert any(re.fullmatch(p, s.site_id) for p in SITE_PATTERNS), s.site_id
        assert s.group == s.site_id.split(".")[0] or (s.group == "dp_cp" and s.site_id.startswith("dp."))
    w = gpt13b.workload
    # TP2 x PP2 x DP16 on 8-GPU nodes: the DP group (stride 2) spans 4 nodes, the TP pair one
    # backward call order within a micro-batch: the last layer's fc1 all-gather comes first
    tp = next(s for s in sites if s.site_id == "tp.sp_all_gather[0]")
    assert len([s for s in sites if s.site_id.startswith("tp.sp_all_gather")]) == 2 * w.layers_per_chunk
    assert (tp.op, tp.group_size, tp.n_nodes) == ("all_gather", 2, 1)
    # the representative rank is pipeline stage 0: layers 0..19 of 40 (PP2)
    assert tp.nbytes == 2 * 2048 * 5120 * 2, "micro-batch 2 x seq 2048 tokens x hidden 5120 x bf16"
    assert tp.calls_per_iter == w.microbatches == 512 // (2 * 16)
    rs = [s for s in sites if s.site_id.startswith("dp.grad_reduce_scatter")]
    assert rs and all(
        (s.op, s.group, s.group_size, s.n_nodes, s.dtype) == ("reduce_scatter", "dp", 16, 4, "float32") for s in rs
    )
    # every layer and the output layer are in exactly one bucket: bytes add up to the stage's grads
    params = w.layer_params() * w.layers_per_chunk + w.vocab * w.hidden / w.tp  # + embedding, no output layer
    assert sum(s.nbytes for s in rs) == pytest.approx(4 * params, rel=1e-6)
    (pp,) = [s for s in sites if s.group == "pp"]  # one site per pipeline, as the real hooks
    assert (pp.site_id, pp.op, pp.nbytes, pp.n_nodes) == ("pp.send_recv", "send", 2 * 2048 * 5120 * 2 // 2, 2)
    assert pp.calls_per_iter == 2 * w.microbatches  # stage 0: a send of activations, a receive of gradients


def test_layout_specific_sites():
    llama = SimulatedCluster(load_preset("llama3-8b-h100x8")).sites
    assert any(s.site_id.startswith("cp.ring_exchange") for s in llama)
    assert all(s.group == "dp_cp" for s in llama if s.site_id.startswith("dp."))
    mix = SimulatedCluster(load_preset("mixtral-8x7b-h100x32")).sites
    a2a = [s for s in mix if s.group == "ep"]
    assert a2a and all(s.op == "all_to_all" and s.group_size == 8 and s.calls_per_iter == 32 for s in a2a)
    assert {s.site_id for s in a2a} == {f"ep.{k}_all_to_all[{n}]" for k in ("dispatch", "combine") for n in range(8)}


def test_same_seed_same_timings_and_noise_exists(gpt13b):
    a = gpt13b.run_iteration(iteration=5)
    b = gpt13b.run_iteration(iteration=5)
    c = gpt13b.run_iteration(iteration=6)
    assert a.iteration_us == b.iteration_us
    assert a.iteration_us != c.iteration_us
    assert abs(a.iteration_us - c.iteration_us) / a.iteration_us < 0.1


def test_serialized_iteration_reports_compute_alone(gpt13b):
    m = gpt13b.run_iteration(iteration=1)
    s = gpt13b.run_iteration(iteration=1, serialize=True)
    assert all(math.isnan(x.t_comp_us) for x in m.samples)
    by = {x.site_id: x for x in s.samples}
    tp = by["tp.sp_all_gather[0]"]
    assert tp.t_comp_us > tp.t_comm_us > 0  # a dgrad GEMM hides the all-gather
    assert s.iteration_us > m.iteration_us  # nothing overlaps


def test_samples_time_each_call_and_their_sums_scale_to_the_site(gpt13b):
    for serialize in (False, True):
        m = gpt13b.run_iteration(iteration=1, serialize=serialize)
        sites = {x.site_id: x for x in m.sites}
        for smp in m.samples:
            scale = sites[smp.site_id].calls_per_iter / len(smp.calls)  # each timed call stands for this many
            assert smp.t_comm_us == pytest.approx(scale * sum(c[0] for c in smp.calls), rel=1e-9)
            assert smp.t_region_us == pytest.approx(scale * sum(c[2] for c in smp.calls), rel=1e-9)
            assert all(c[2] >= c[0] for c in smp.calls)
            if serialize:
                assert smp.t_comp_us == pytest.approx(scale * sum(c[1] for c in smp.calls), rel=1e-9)
            else:
                assert all(math.isnan(c[1]) for c in smp.calls)


def test_fewer_channels_slow_the_collective_and_samples_echo_the_assignment(gpt13b):
    sid = "tp.sp_all_gather[0]"
    d = {x.site_id: x for x in gpt13b.run_iteration(iteration=9).samples}[sid]
    few = {x.site_id: x for x in gpt13b.run_iteration(iteration=9, assignment={sid: CommConfig(n_channels=2)}).samples}[
        sid
    ]
    assert few.t_comm_us > 2 * d.t_comm_us
    assert few.config == CommConfig(n_channels=2) and d.config == DEFAULT


def test_unknown_site_and_cpu_cluster_rejected(gpt13b):
    with pytest.raises(ValueError, match="unknown site"):
        gpt13b.run_iteration(assignment={"tp.nope": CommConfig(n_channels=2)})
    with pytest.raises(ValueError, match="cpu-gloo.*gloo cluster"):
        SimulatedCluster(load_preset("cpu-tp2-dp2"))


def test_search_sees_only_profile_records(monkeypatch):
    """The fit and the search get a Profile of plain records and the ClusterSpec, nothing else;
    the tuner gets only IterationMeasurements."""
    seen: dict = {"fit": [], "search": [], "measure": []}
    real_fit, real_search, real_finish = fit_mod.fit_cost_model, search_mod.search, Tuner.finish_iteration

    def spy_fit(profile, cluster):
        seen["fit"].append((profile, cluster))
        return real_fit(profile, cluster)

    def spy_search(*args, **kwargs):
        seen["search"].append((args, kwargs))
        return real_search(*args, **kwargs)

    def spy_finish(self, measurement):
        seen["measure"].append(measurement)
        return real_finish(self, measurement)

    monkeypatch.setattr(fit_mod, "fit_cost_model", spy_fit)
    monkeypatch.setattr(search_mod, "search", spy_search)
    monkeypatch.setattr(Tuner, "finish_iteration", spy_finish)
    sim = SimulatedCluster(load_preset("llama3-8b-h100x8"), seed=1)
    run_lifecycle(sim, verify_iters=1, after_iters=0)

    ((args, kwargs),) = seen["search"]
    assert len(args) == 1 and set(kwargs) == {"rules", "method", "model"}
    (profile,), cluster = args, kwargs["rules"].cluster
    assert type(profile) is Profile and type(cluster) is ClusterSpec
    assert type(kwargs["rules"]) is NcclRules and kwargs["rules"].backend == "sim"
    assert type(kwargs["model"]) is cost_model_mod.CostModel
    assert seen["fit"] == [(profile, cluster)]
    # the profile is plain data: it survives a JSON round trip unchanged ...
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))).to_dict() == profile.to_dict()
    # ... and holds nothing but records of the engine's own types
    allowed = (str, int, float, bool, type(None), CollectiveSite, Sample, CommConfig)
    for obj in [*profile.sites, *profile.samples, *(s.config for s in profile.samples), *profile.fingerprint.values()]:
        assert isinstance(obj, allowed), type(obj)
    assert all(type(m) is IterationMeasurement for m in seen["measure"])
    for m in seen["measure"]:
        assert all(type(s) is Sample for s in m.samples) and all(type(s) is CollectiveSite for s in m.sites)
    # and the engine never imports the simulator
    engine_dir = Path(cost_model_mod.__file__).parent
    for src in engine_dir.glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+lagom_megatron\.sim", src.read_text(), re.M), src.name


def test_lifecycle_ends_applied_or_fell_back_with_a_reason():
    sim = SimulatedCluster(load_preset("llama3-8b-h100x8"), seed=2)
    r = run_lifecycle(sim, verify_iters=2, warmup_iters=1, after_iters=2)
    t = r.tuner
    assert t.phase in (Phase.APPLIED, Phase.FELL_BACK) and t.reason
    kinds = [s.kind for s, _ in r.steps]
    n_probes = len(t.probes)
    assert kinds[: 3 + n_probes] == ["warmup", "default", "serialized"] + ["probe"] * n_probes
    assert kinds.count("verify-plan") == kinds.count("verify-default") == 2
    after = [s for s, _ in r.steps][-2:]
    if t.phase is Phase.FELL_BACK:
        assert all(s.assignment == {} for s in after)
    else:
        assert all(s.assignment for s in after)
    assert t.profile is not None and t.profile.backend == "sim"
    assert t.model_mape is not None and t.search_stats["model_evaluations"] > 0


def test_lagom_simulate_64_gpu_preset_cli(tmp_path):
    """The 64-GPU preset end to end through the command (its speed is printed by the command itself,
    not asserted: the suite runs on shared, busy machines)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lagom_megatron",
            "simulate",
            "--preset",
            "gpt3-13b-h100x64",
            "--seed",
            "1",
            "--plan-out",
            str(tmp_path / "plan.json"),
        ],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert out.returncode == 0, out.stderr
    for phase in ("profiling", "probing", "searched", "verifying"):
        assert f"[{phase:>9}]" in out.stdout, out.stdout
    assert "SIMULATED" in out.stdout and "predicted, plan" in out.stdout and "measured, defaults" in out.stdout
    assert "largest predicted savings" in out.stdout and re.search(r"result: (applied|fell_back): ", out.stdout)
    verdict = re.search(r"result: (applied|fell_back): ", out.stdout).group(1)  # the plan's own state names
    assert load_plan(tmp_path / "plan.json").stats["verification"] == verdict  # saved with its verdict


def test_workload_rejects_bad_layout():
    p = load_preset("gpt3-13b-h100x64").model_copy(update={"world_size": 62})
    with pytest.raises(ValueError, match=r"world_size \(62\) must be a multiple of TP\*PP\*CP \(2\*2\*1\)"):
        Workload.from_preset(p, SimulatedCluster(load_preset("gpt3-13b-h100x64")).gpu)


def test_ddp_buckets_only_on_the_first_virtual_chunk():
    # megatron-core DDP: one bucket when pp_rank > 0; Megatron-LM: disable_bucketing for chunks > 0
    w = SimulatedCluster(load_preset("llama3-70b-h100x64")).workload
    b = w.buckets()
    assert len(b) == w.chunks == 5
    assert all(len(chunk) == 1 for chunk in b[1:])
    per_layer = w.layer_params()
    expected = max(1, round(w.layers_per_chunk * per_layer / w.bucket_params))
    assert len(b[0]) >= min(expected, w.layers_per_chunk) - 1 and len(b[0]) > 1
    assert sorted(li for _, lis, _ in b[0] for li in lis) == list(range(w.layers_per_chunk))


def test_without_overlapped_grad_reduce_one_blocking_bucket_per_chunk():
    p = load_preset("gpt3-13b-h100x64")
    p = p.model_copy(
        update={"overlap": p.overlap.model_copy(update={"overlap_grad_reduce": False, "overlap_param_gather": False})}
    )
    sim = SimulatedCluster(p)
    rs = [s for s in sim.sites if s.site_id.startswith("dp.grad_reduce_scatter")]
    assert [s.site_id for s in rs] == ["dp.grad_reduce_scatter[chunk0.bucket0]"]
    m = sim.run_iteration(iteration=1)
    (sample,) = [x for x in m.samples if x.site_id == rs[0].site_id]
    assert sample.t_region_us == pytest.approx(sample.t_comm_us)  # nothing overlaps a blocking call


def test_a_plans_high_priority_stream_reaches_the_simulated_streams():
    """Sites whose config sets ``high_priority_stream`` run on a high-priority pool entry: every
    dp site with it is the same iteration as the job's ``--high-priority-stream-groups dp``, and on
    Llama-2 7B FSDP over A40 PCIe nodes both are faster than NCCL's normal-priority stream, whose
    gathers wait for the running GEMM's last wave."""
    from lagom_megatron.sim.bench.row import with_microbatches

    sim = SimulatedCluster(with_microbatches(load_preset("llama2-7b-a40x16-fsdp"), 2), "a40-pcie-ib200")
    fast = {s.site_id: CommConfig(high_priority_stream=True) for s in sim.sites if s.group == "dp"}
    default = sim.run_iteration(iteration=0, noise=False).iteration_us
    planned = sim.run_iteration(iteration=0, noise=False, assignment=fast).iteration_us
    job = sim.run_iteration(iteration=0, noise=False, high_priority=frozenset({"dp"})).iteration_us
    assert planned == pytest.approx(job) and planned < 0.99 * default
