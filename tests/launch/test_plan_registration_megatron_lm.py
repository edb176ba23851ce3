"""The Megatron-LM route's decision on a reused plan's registered buffers (``launch.megatron_lm.plan_registration``):
``args.nccl_ub`` on core_v0.18+, ``--use-nccl-ub`` in ``sys.argv`` where ``pretrain`` parses again (core_v0.16/0.17),
and Megatron-FSDP on core_v0.18+ refused with the flag as the way out."""

from __future__ import annotations

import argparse

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.launch.megatron_lm import plan_registration
from lagom_megatron.megatron.outputs.run_files import run_fingerprint

CHECKS = dict(on_gpu=True, torch_version="2.13.0", ddp_fields=("nccl_ub",), environ={})


def _args(tmp_path, **over):
    args = argparse.Namespace(
        lagom=True,
        lagom_warmup_iters=2,
        lagom_verify_iters=4,
        lagom_method="priority",
        lagom_plan=str(tmp_path / "plan.json"),
        lagom_report=None,
        lagom_cluster="h100-sxm-ib400",
        distributed_backend="nccl",
        num_layers=4,
        hidden_size=256,
        tensor_model_parallel_size=2,
        nccl_ub=False,
        use_megatron_fsdp=False,
    )
    vars(args).update(over)
    return args


def _save(args, monkeypatch, backend="nccl"):
    monkeypatch.setenv("WORLD_SIZE", "8")
    entries = {
        "dp.rs[0]": PlanEntry(
            config=CommConfig(), predicted_t_comm_us=40.0, predicted_t_region_us=50.0, group="dp", op="reduce_scatter"
        )
    }
    fp = run_fingerprint(args, backend=backend, cluster=args.lagom_cluster)
    mechanism = "gloo" if backend == "gloo" else "tuner"
    plan = Plan(entries=entries, fingerprint=fp, backend=backend, mechanism=mechanism, registered_groups=("dp",))
    plan.save(args.lagom_plan)
    return plan


def test_core_v018_sets_the_global_args(tmp_path, monkeypatch):
    args = _args(tmp_path)
    plan = _save(args, monkeypatch)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--lagom"])
    found = plan_registration(args, reparsed=False, **CHECKS)
    assert found.turns_on and args.nccl_ub is True
    import sys

    assert sys.argv == ["pretrain_gpt.py", "--lagom"]  # parse_and_validate_args' args are the ones pretrain reads
    assert (
        found.applied_line()
        == f"lagom: plan {plan.digest()[:12]} registers the buffers of dp (--use-nccl-ub) from this launch"
    )


def test_core_v016_adds_the_flag_to_the_command_line_pretrain_parses(tmp_path, monkeypatch):
    args = _args(tmp_path)
    _save(args, monkeypatch)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--lagom"])
    plan_registration(args, reparsed=True, **CHECKS)
    import sys

    assert sys.argv == ["pretrain_gpt.py", "--lagom", "--use-nccl-ub"]


def test_megatron_fsdp_after_validation_asks_for_the_flag(tmp_path, monkeypatch):
    args = _args(tmp_path, use_megatron_fsdp=True)
    plan = _save(args, monkeypatch)
    found = plan_registration(args, reparsed=False, **CHECKS)
    assert args.nccl_ub is False
    assert found.refusal() == (
        f"plan {args.lagom_plan} (digest {plan.digest()[:12]}) registers the buffers of dp (--use-nccl-ub), which "
        "this launch cannot: Megatron-LM derived Megatron-FSDP's buffer settings from --use-nccl-ub when it "
        "validated the arguments (megatron/training/arguments.py:1149-1154 @core_v0.19.0), before lagom's hook ran; "
        "add --use-nccl-ub to the command line"
    )
    # with the flag given there is nothing left for lagom to do
    args.nccl_ub = True
    found = plan_registration(args, reparsed=False, **CHECKS)
    assert (found.missing, found.turns_on) == (None, False)


def test_the_cpu_route_registers_nothing(tmp_path, monkeypatch):
    args = _args(tmp_path)
    _save(args, monkeypatch)
    # a GPU plan's fingerprint (backend nccl) is not this run's: the controller searches anew, nothing to register
    assert plan_registration(args, reparsed=False, **{**CHECKS, "on_gpu": False}) is None
    # a gloo plan that registers buffers is invalid wherever it is read (nccl.registration): never reused either
    args = _args(tmp_path, lagom_cluster="cpu-gloo")
    _save(args, monkeypatch, backend="gloo")
    assert plan_registration(args, reparsed=False, **{**CHECKS, "on_gpu": False}) is None
    assert args.nccl_ub is False
