"""lagom doctor's rules: one case per rule with the input that triggers it and the level expected
(the command itself: test_doctor_command.py)."""

import argparse

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.launch.doctor import RULES, Finding, preflight, run_doctor

H100 = {"gpus_per_node": 8, "sm_arch": 90, "nccl_version": "2.27.5", "backend": "nccl"}
B200 = {"gpus_per_node": 8, "sm_arch": 100, "nccl_version": "2.27.5", "backend": "nccl"}
CPU = {"gpus_per_node": 4, "sm_arch": 0, "nccl_version": "none", "backend": "gloo"}


def base_args(**changes):
    """A valid layout: world 16 = TP 2 x PP 2 x CP 1 x DP 4; global batch 32 = 1 x 8 x 4."""
    args = dict(
        num_layers=8,
        hidden_size=512,
        num_attention_heads=16,
        num_query_groups=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        sequence_parallel=True,
        seq_length=1024,
        micro_batch_size=1,
        global_batch_size=32,
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        lagom=True,
    )
    args.update(changes)
    return args


BASE_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def findings_of(args=None, env=None, cluster=H100, world_size=16):
    return run_doctor(
        base_args() if args is None else args, BASE_ENV if env is None else env, cluster, world_size=world_size
    )


def test_base_layout_is_clean():
    assert findings_of() == []


# (case id, args changes, env (None = BASE_ENV), cluster, world size, expected rule, expected level)
CASES = [
    ("world-not-divisible", {}, None, {**H100, "gpus_per_node": 2}, 10, "world-size", "error"),
    ("world-zero", {}, None, H100, 0, "world-size", "error"),
    ("world-negative", {}, None, H100, -4, "world-size", "error"),
    ("gpus-per-node-zero", {}, None, {**H100, "gpus_per_node": 0}, 16, "gpus-per-node", "error"),
    (
        "world-not-whole-nodes",
        dict(global_batch_size=48),
        None,
        {**H100, "gpus_per_node": 16},
        24,
        "gpus-per-node",
        "error",
    ),
    (
        "tp-straddles-nodes",
        dict(tensor_model_parallel_size=4, global_batch_size=48),
        None,
        {**H100, "gpus_per_node": 6},
        24,
        "tp-node",
        "error",
    ),
    (
        "expert-layout",
        dict(
            expert_model_parallel_size=8,
            num_experts=8,
            tensor_model_parallel_size=1,
            sequence_parallel=False,
            global_batch_size=48,
        ),
        {},
        H100,
        24,
        "world-size",
        "error",
    ),
    ("batch", dict(global_batch_size=30), None, H100, 16, "batch", "error"),
    (
        "heads-tp",
        dict(num_attention_heads=15, num_query_groups=None, hidden_size=480),
        None,
        H100,
        16,
        "heads-tp",
        "error",
    ),
    # megatron-core 0.16.1 accepts groups that divide TP (transformer_config.py:939-946): 12 vs TP 8 does neither
    (
        "query-groups-tp",
        dict(tensor_model_parallel_size=8, num_attention_heads=24, hidden_size=768, num_query_groups=12),
        None,
        H100,
        16,
        "query-groups-tp",
        "error",
    ),
    ("heads-vs-groups", dict(num_query_groups=6), None, H100, 16, "query-groups-tp", "error"),
    ("layers-pp", dict(num_layers=9), None, H100, 16, "layers-pp", "error"),
    (
        "vstages-both",
        dict(num_layers_per_virtual_pipeline_stage=2, num_virtual_stages_per_pipeline_rank=2),
        None,
        H100,
        16,
        "virtual-stages",
        "error",
    ),
    (
        "vstages-no-pp",
        dict(pipeline_model_parallel_size=1, num_virtual_stages_per_pipeline_rank=2, global_batch_size=64),
        None,
        H100,
        16,
        "virtual-stages",
        "error",
    ),
    ("layers-per-vstage", dict(num_layers_per_virtual_pipeline_stage=3), None, H100, 16, "virtual-stages", "error"),
    ("vstages-per-rank", dict(num_virtual_stages_per_pipeline_rank=3), None, H100, 16, "virtual-stages", "error"),
    ("ep-without-experts", dict(expert_model_parallel_size=2), None, H100, 16, "experts-ep", "error"),
    ("experts-vs-ep", dict(expert_model_parallel_size=4, num_experts=6), None, H100, 16, "experts-ep", "error"),
    (
        "sp-with-tp1",
        dict(tensor_model_parallel_size=1, num_query_groups=None, global_batch_size=64),
        {},
        H100,
        16,
        "sequence-parallel",
        "warning",
    ),
    ("sp-seq-vs-tp", dict(seq_length=1023), None, H100, 16, "sequence-parallel", "error"),
    (
        "cp-seq",
        dict(context_parallel_size=2, seq_length=1026, global_batch_size=16),
        None,
        H100,
        16,
        "context-parallel",
        "error",
    ),
    (
        "tp-overlap-without-sp",
        dict(tp_comm_overlap=True, sequence_parallel=False),
        None,
        H100,
        16,
        "tp-comm-overlap",
        "error",
    ),
    (
        "tp-overlap-across-nodes",
        dict(
            tp_comm_overlap=True,
            tensor_model_parallel_size=16,
            num_attention_heads=32,
            num_query_groups=16,
            pipeline_model_parallel_size=1,
            global_batch_size=2,
        ),
        None,
        H100,
        32,
        "tp-comm-overlap",
        "error",
    ),
    (
        "tp-overlap-tp1",
        dict(tp_comm_overlap=True, tensor_model_parallel_size=1, sequence_parallel=False, global_batch_size=64),
        {},
        H100,
        16,
        "tp-comm-overlap",
        "warning",
    ),
    ("tp-overlap-cpu", dict(tp_comm_overlap=True), {}, CPU, 16, "tp-comm-overlap", "error"),
    ("param-gather-no-distopt", dict(use_distributed_optimizer=False), None, H100, 16, "overlap-param-gather", "error"),
    ("param-gather-no-grad-reduce", dict(overlap_grad_reduce=False), None, H100, 16, "overlap-param-gather", "error"),
    (
        "param-gather-with-step",
        dict(overlap_param_gather_with_optimizer_step=True),
        None,
        H100,
        16,
        "overlap-param-gather",
        "error",
    ),
    # Megatron-FSDP sharding nothing (megatron-core 0.16.1 megatron_fsdp.py:425-426, 656-662) and a strategy
    # only Megatron-FSDP reads; Megatron-LM's choices (arguments.py:2307-2309)
    (
        "fsdp-no-shard",
        dict(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="no_shard",
            tensor_model_parallel_size=1,
            sequence_parallel=False,
        ),
        {},
        H100,
        16,
        "fsdp-sharding",
        "warning",
    ),
    (
        "fsdp-strategy-without-fsdp",
        dict(data_parallel_sharding_strategy="optim_grads_params"),
        None,
        H100,
        16,
        "fsdp-sharding",
        "warning",
    ),
    (
        "fsdp-strategy-unknown",
        dict(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="zero3",
            tensor_model_parallel_size=1,
            sequence_parallel=False,
        ),
        {},
        H100,
        16,
        "fsdp-sharding",
        "error",
    ),
    ("bucket-size-bool", dict(ddp_bucket_size=True), None, H100, 16, "ddp-bucket-size", "error"),
    (
        "bucket-size-unused",
        dict(ddp_bucket_size=40_000_000, overlap_grad_reduce=False, overlap_param_gather=False),
        None,
        H100,
        16,
        "ddp-bucket-size",
        "warning",
    ),
    ("cdmc-missing-tp", {}, {}, H100, 16, "cuda-device-max-connections", "error"),
    (
        "cdmc-missing-cp",
        dict(tensor_model_parallel_size=1, sequence_parallel=False, context_parallel_size=2, global_batch_size=32),
        {},
        H100,
        16,
        "cuda-device-max-connections",
        "error",
    ),
    # FSDP2 needs gradient accumulation fusion off (Megatron-LM core_v0.16.1 arguments.py:614; rule grad-reduce)
    (
        "cdmc-fsdp",
        dict(use_torch_fsdp2=True, gradient_accumulation_fusion=False),
        None,
        H100,
        16,
        "cuda-device-max-connections",
        "error",
    ),
    (
        "cdmc-serialises-dp",
        dict(tensor_model_parallel_size=1, sequence_parallel=False, global_batch_size=64),
        None,
        H100,
        16,
        "cuda-device-max-connections",
        "warning",
    ),
    # a MoE overlap megatron-core accepts (transformer_config.py:1852-1892); alone it is an error (issue example 11)
    (
        "cdmc-moe-overlap",
        dict(
            overlap_moe_expert_parallel_comm=True,
            num_experts=8,
            expert_model_parallel_size=2,
            moe_token_dispatcher_type="alltoall",
            bf16=True,
            num_virtual_stages_per_pipeline_rank=2,
        ),
        None,
        H100,
        16,
        "cuda-device-max-connections",
        "warning",
    ),
    (
        "nccl-algo-grammar",
        dict(lagom=False),
        {**BASE_ENV, "NCCL_ALGO": "allreduce:tree;ring"},
        H100,
        16,
        "nccl-env",
        "error",
    ),
    (
        "nccl-proto-ll128",
        dict(lagom=False),
        {**BASE_ENV, "NCCL_PROTO": "LL,LL128,Simple"},
        H100,
        16,
        "nccl-env",
        "error",
    ),
    ("nccl-nthreads", dict(lagom=False), {**BASE_ENV, "NCCL_NTHREADS": "480"}, H100, 16, "nccl-env", "error"),
    (
        "nccl-ctas-range",
        dict(lagom=False),
        {**BASE_ENV, "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "4"},
        H100,
        16,
        "nccl-env",
        "error",
    ),
    ("nccl-debug-typo", dict(lagom=False), {**BASE_ENV, "NCCL_DEBUG": "VERBOSE"}, H100, 16, "nccl-env", "error"),
    (
        "torch-nccl-bool",
        dict(lagom=False),
        {**BASE_ENV, "TORCH_NCCL_BLOCKING_WAIT": "on"},
        H100,
        16,
        "nccl-env",
        "error",
    ),
    ("nccl-buffsize", dict(lagom=False), {**BASE_ENV, "NCCL_BUFFSIZE": "1000000"}, H100, 16, "nccl-env", "error"),
    (
        "nccl-override-ctas",
        {},
        {**BASE_ENV, "NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "16"},
        H100,
        16,
        "nccl-override",
        "warning",
    ),
    ("nccl-override-algo", {}, {**BASE_ENV, "NCCL_ALGO": "ring,tree"}, H100, 16, "nccl-override", "warning"),
    # Megatron-LM parity flags on a Megatron-LM line (preflight/values.py megatron_flag_problems)
    ("init-method-std", dict(init_method_std=-0.01), None, H100, 16, "init-method-std", "error"),
    (
        "recompute-full-no-method",
        dict(recompute_granularity="full", recompute_num_layers=1),
        None,
        H100,
        16,
        "recompute",
        "error",
    ),
    (
        "recompute-activations-with-method",
        dict(recompute_activations=True, recompute_method="uniform"),
        None,
        H100,
        16,
        "recompute",
        "error",
    ),
    # 8 layers / PP 2 / 2 virtual stages = 2 layers per model chunk; uniform groups of 4 index past it
    (
        "recompute-uniform-vpp",
        dict(
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=4,
            num_virtual_stages_per_pipeline_rank=2,
        ),
        None,
        H100,
        16,
        "recompute",
        "error",
    ),
    (
        "distribute-saved-activations-sp",
        dict(
            distribute_saved_activations=True,
            recompute_granularity="full",
            recompute_method="block",
            recompute_num_layers=1,
        ),
        None,
        H100,
        16,
        "recompute",
        "error",
    ),
    (
        "attention-backend-env",
        dict(attention_backend="fused"),
        {**BASE_ENV, "NVTE_FLASH_ATTN": "1"},
        H100,
        16,
        "attention-backend",
        "error",
    ),
    (
        "wsd-past-decay",
        dict(lr_decay_style="WSD", lr_decay_iters=100, lr_wsd_decay_iters=200),
        None,
        H100,
        16,
        "lr-schedule",
        "error",
    ),
    (
        "main-grads-bf16",
        dict(bf16=True, accumulate_allreduce_grads_in_fp32=True, main_grads_dtype="bf16"),
        None,
        H100,
        16,
        "grad-reduce",
        "error",
    ),
    ("pool-budget-inf", dict(lagom_pool_budget_mib=float("inf")), None, H100, 16, "pool-budget", "error"),
    ("lagom-train-iters-too-short", dict(train_iters=10), None, "h100-sxm-ib400", 16, "lagom-iterations", "warning"),
    (
        "lagom-plan-without-lagom",
        dict(lagom=False, lagom_plan="runs/x/plan.json"),
        None,
        H100,
        16,
        "lagom-flags",
        "error",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rule_triggers(case):
    _, changes, env, cluster, world, rule, level = case
    found = findings_of(base_args(**changes), env, cluster, world)
    assert {(f.rule, f.level) for f in found} == {(rule, level)}, [str(f) for f in found]
    for f in found:
        assert f.what and f.why and f.fix


def test_every_rule_has_a_case():
    rule_ids = {c[5] for c in CASES}
    assert len(rule_ids) >= 14
    assert len(RULES) == 26  # a new rule needs a case here or in tests/training (output-names: test_run_folders.py)


def test_megatron_fsdp_sharding_findings_name_the_strategy_and_megatron_fsdps_lines():
    fsdp = dict(use_megatron_fsdp=True, tensor_model_parallel_size=1, sequence_parallel=False)
    (f,) = findings_of(base_args(**fsdp, data_parallel_sharding_strategy="no_shard"), {})
    assert f.what == "--use-megatron-fsdp with --data-parallel-sharding-strategy no_shard"
    assert "megatron_fsdp.py:425-426" in f.why and "optim_grads_params" in f.fix
    for strategy in ("optim", "optim_grads", "optim_grads_params"):  # sharded: nothing to say
        assert findings_of(base_args(**fsdp, data_parallel_sharding_strategy=strategy), {}) == []
    (f,) = findings_of(base_args(**fsdp, data_parallel_sharding_strategy="zero3"), {})
    assert f.what == (
        "--data-parallel-sharding-strategy 'zero3' is not one of no_shard, optim, optim_grads, optim_grads_params"
    )
    assert findings_of(base_args(data_parallel_sharding_strategy="no_shard")) == []  # plain DDP: its default


def test_query_groups_ignored_without_group_query_attention():
    """Megatron-LM's parse_args leaves num_query_groups at 1 unless --group-query-attention is given."""
    args = base_args(num_query_groups=1, group_query_attention=False)
    assert findings_of(args) == []
    assert findings_of(base_args(num_query_groups=1, group_query_attention=True)) == []  # 1 divides TP 2
    assert {f.rule for f in findings_of(base_args(num_query_groups=3, group_query_attention=True))} == {
        "query-groups-tp"
    }


def test_cdmc_not_required_on_blackwell():
    assert findings_of(env={}, cluster=B200) == []


def test_cdmc_error_names_values():
    (f,) = findings_of(env={"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert "'8'" in f.what and "TP 2" in f.what and "sm_90" in f.what
    (f,) = findings_of(env={})
    assert f.what == "CUDA_DEVICE_MAX_CONNECTIONS is unset with TP 2, CP 1 on sm_90"
    assert f.fix == "export CUDA_DEVICE_MAX_CONNECTIONS=1"  # no preset: nothing sets it


def test_cdmc_fix_names_the_preset_env_only_when_it_sets_it(capsys, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert main(["doctor", "--no-preset-env", "--cluster", "h100-sxm-ib400", "--preset", "gpt3-13b-h100x64"]) == 1
    assert "    fix: export CUDA_DEVICE_MAX_CONNECTIONS=1 (the preset's env does this)" in capsys.readouterr().out
    assert (
        main(
            [
                "doctor",
                "--no-preset-env",
                "--cluster",
                "h100-sxm-ib400",
                "--preset",
                "mixtral-8x7b-h100x32",
                "--",
                "--tensor-model-parallel-size",
                "2",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "CUDA_DEVICE_MAX_CONNECTIONS is unset with TP 2" in out
    assert "    fix: export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in out


def test_world_size_message_shows_arithmetic():
    (f,) = findings_of(cluster={**H100, "gpus_per_node": 2}, world_size=10)
    assert f.what == "world size 10 is not divisible by TP x PP x CP = 2 x 2 x 1 = 4"


def test_gloo_skips_node_shape_rules():
    """CPU ranks are processes on one host: no whole-node or TP-per-node requirement."""
    assert findings_of(base_args(global_batch_size=24), {}, CPU, 12) == []
    assert findings_of(base_args(global_batch_size=24), {}, {**CPU, "gpus_per_node": 3}, 12) == []
    assert [f.rule for f in findings_of(base_args(), {}, CPU, 0)] == ["world-size"]


def test_gloo_skips_cuda_and_nccl_rules():
    env = {"NCCL_NTHREADS": "480", "NCCL_MAX_CTAS": "4"}
    assert findings_of(env=env, cluster=CPU) == []


def test_overrides_only_with_lagom():
    env = {**BASE_ENV, "NCCL_MIN_CTAS": "2", "NCCL_MAX_CTAS": "16"}
    assert {f.rule for f in findings_of(base_args(), env)} == {"nccl-override"}
    assert findings_of(base_args(lagom=False), env) == []


def test_namespace_input_reads_world_size_from_environment():
    ns = argparse.Namespace(**base_args())
    found = run_doctor(ns, {**BASE_ENV, "WORLD_SIZE": "10"}, {**H100, "gpus_per_node": 2})
    assert [f.rule for f in found] == ["world-size"]


def test_preflight_stops_on_errors():
    lines = []
    with pytest.raises(SystemExit) as exc:
        preflight(base_args(num_layers=9), {**BASE_ENV, "WORLD_SIZE": "16"}, H100, log=lines.append)
    assert exc.value.code == 1
    assert "layers-pp" in lines[0] and "1 error(s)" in lines[-1]


def test_preflight_returns_warnings():
    env = {**BASE_ENV, "WORLD_SIZE": "16", "NCCL_ALGO": "ring,tree"}
    found = preflight(base_args(), env, H100, log=lambda line: None)
    assert [f.level for f in found] == ["warning"]


def test_bad_input_type():
    with pytest.raises(ValueError, match="Preset, a preset name"):
        run_doctor(42, {}, H100)


def test_finding_text():
    f = Finding("error", "x", "what happened", "because", "do this")
    assert str(f).splitlines() == ["error: [x] what happened", "    why: because", "    fix: do this"]
