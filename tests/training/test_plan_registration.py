"""A reused plan's registered buffers (``Plan.registered_groups``) at launch: ``--use-nccl-ub`` turned on before the
model is built, or one refusal line where this launch cannot register (``preflight.registration``)."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.megatron.outputs.run_files import run_fingerprint
from lagom_megatron.preflight.registration import ddp_config_fields, plan_registration, registration_missing
from lagom_megatron.training import model
from lagom_megatron.training.argument_checks import validate_args
from lagom_megatron.training.arguments import parse_args
from tests.training.preflight_harness import train

CPU = ["--preset", "cpu-tp2-dp2", "--mock-data", "--lagom"]
GROUPS = ("dp", "dp_cp")


def _args(argv, monkeypatch, world=4):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(list(argv)), world)


def _save_plan(path, args, *, backend, cluster, groups=GROUPS, **fingerprint):
    """A plan saved by ``Plan.save`` with the run's own fingerprint (``run_fingerprint``, as the controller)."""
    fp = run_fingerprint(args, backend=backend, cluster=cluster)
    fp.update(fingerprint)
    entries = {
        f"{g}.rs[0]": PlanEntry(
            config=CommConfig(), predicted_t_comm_us=40.0, predicted_t_region_us=50.0, group=g, op="reduce_scatter"
        )
        for g in GROUPS
    }
    mechanism = "gloo" if backend == "gloo" else "tuner"
    plan = Plan(entries=entries, fingerprint=fp, backend=backend, mechanism=mechanism, registered_groups=groups)
    plan.save(path)
    return plan


def test_the_cpu_run_never_reuses_a_plan_that_registers_buffers(tmp_path, monkeypatch, capsys):
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.megatron.outputs.run_files import plan_problem

    path = tmp_path / "plan.json"
    argv = [*CPU, "--lagom-cluster", "cpu-gloo", "--lagom-plan", str(path)]
    plan = _save_plan(path, _args(argv, monkeypatch), backend="gloo", cluster="cpu-gloo")
    # the one check every reader of a plan makes: gloo registers nothing, so such a plan is never reused on it
    assert plan_problem(plan, ClusterSpec.load("cpu-gloo")) == (
        "registered_groups ['dp', 'dp_cp']: gloo cluster 'cpu-gloo' registers no NCCL buffers; allowed: none"
    )
    t = train(argv, monkeypatch, capsys)
    assert (t.code, t.started, t.errors) == (0, True, [])  # nothing to register: the run searches its own plan
    assert path.is_file()  # nothing moved, nothing deleted before the run


def test_a_plan_for_another_run_registers_nothing_here(tmp_path, monkeypatch, capsys):
    path = tmp_path / "plan.json"
    argv = [*CPU, "--lagom-cluster", "cpu-gloo", "--lagom-plan", str(path)]
    _save_plan(path, _args(argv, monkeypatch), backend="gloo", cluster="cpu-gloo", num_layers=99)
    t = train(argv, monkeypatch, capsys)
    assert (t.code, t.started, t.errors) == (0, True, [])


def test_a_reused_plan_turns_nccl_ub_on_for_this_launch(tmp_path, monkeypatch, capsys):
    path = tmp_path / "plan.json"
    argv = [*CPU, "--lagom-cluster", "h100-sxm-ib400", "--lagom-plan", str(path)]
    args = _args(argv, monkeypatch)
    plan = _save_plan(path, args, backend="nccl", cluster="h100-sxm-ib400")
    assert (args.nccl_ub, model.ddp_config(args, on_gpu=True).nccl_ub) == (False, False)
    found = plan_registration(
        args, on_gpu=True, torch_version="2.9.0a0+nv25.08", ddp_fields=ddp_config_fields(), environ={}
    )
    assert found.missing is None and found.turns_on
    assert (args.nccl_ub, model.ddp_config(args, on_gpu=True).nccl_ub) == (True, True)
    assert found.applied_line() == (
        f"lagom: plan {plan.digest()[:12]} registers the buffers of dp, dp_cp (--use-nccl-ub) from this launch"
    )


def test_the_users_flag_is_left_as_given(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    args = _args([*CPU, "--lagom-cluster", "h100-sxm-ib400", "--lagom-plan", str(path), "--use-nccl-ub"], monkeypatch)
    _save_plan(path, args, backend="nccl", cluster="h100-sxm-ib400")
    found = plan_registration(args, on_gpu=True, torch_version="2.13.0", ddp_fields=("nccl_ub",), environ={})
    assert (found.user_flag, found.turns_on, found.missing, args.nccl_ub) == (True, False, None, True)


def test_without_lagom_or_without_groups_nothing_is_read(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    args = _args([*CPU, "--lagom-cluster", "h100-sxm-ib400", "--lagom-plan", str(path)], monkeypatch)
    _save_plan(path, args, backend="nccl", cluster="h100-sxm-ib400", groups=())
    assert plan_registration(args, on_gpu=True, torch_version="2.13.0", ddp_fields=("nccl_ub",), environ={}) is None
    args.lagom = False
    assert plan_registration(args, on_gpu=True) is None
    assert args.nccl_ub is False


@pytest.mark.parametrize(
    "kwargs, missing",
    [
        (dict(backend="gloo"), "it runs on gloo, which has no NCCL memory pool"),
        (
            dict(ddp_fields=("overlap_grad_reduce",)),
            "the installed megatron-core's DistributedDataParallelConfig has no",
        ),
        # megatron-core 0.16.1 nccl_allocator.py:116: symmetric needs is_torch_min_version("2.9.0a0")
        (dict(torch_version="2.8.0+cu128"), "torch 2.8.0+cu128 is older than 2.9"),
        (
            dict(environ={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}),
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True",
        ),
        (dict(torch_fsdp2=True), "--use-torch-fsdp2's data-parallel config has no nccl_ub"),
        # core_v0.19.0 param_and_grad_buffer.py:1132-1140: the pool is then created and registered without windows
        (dict(no_symmetric=True), "--disable-symmetric-registration keeps the buffers out of symmetric windows"),
        (dict(torch_version="2.9.0a0+nv25.08"), None),
        (dict(environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}), None),
    ],
)
def test_what_registration_needs(kwargs, missing):
    given = dict(backend="nccl", ddp_fields=("nccl_ub",), torch_version="2.13.0", environ={})
    got = registration_missing(**{**given, **kwargs})
    assert (got is None) if missing is None else got.startswith(missing)


def test_ranks_that_disagree_on_registration_are_named_before_any_buffer_is_built():
    from lagom_megatron.preflight.registration import registration_disagreement

    assert registration_disagreement([True, True, True, True]) is None
    assert registration_disagreement([False, False]) is None
    assert registration_disagreement([True, True, False, True]) == (
        "--use-nccl-ub is on for 3 of 4 ranks (off on rank 2): every rank must read the same --lagom-plan file "
        "(a folder all nodes share), or pass --use-nccl-ub on every rank"
    )
