"""Our pretrain_gpt.py parser against Megatron-LM's: every flag we accept has Megatron-LM's name,
destination, kind and default for each supported release, unless it is one of ours or a listed,
explained difference; refused flags say what to use instead; Megatron-LM's derived defaults
(SwiGLU FFN size, fp32 gradient reduction with bf16) and --help showing every lagom flag.

tests/training/data/megatron_lm_flags.json holds Megatron-LM's values, read from its parser
(``add_megatron_arguments``) of each release by scripts/megatron_lm_flag_table.py; no Megatron-LM
code is in this repository.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lagom_megatron.megatron.hooks.versions import TESTED_MEGATRON_CORE, in_range
from lagom_megatron.training.argument_checks import validate_args
from lagom_megatron.training.arguments import (
    LAGOM_FLAGS,
    MEGATRON_LM_REFUSED,
    build_parser,
    default_ffn_hidden_size,
    parse_args,
)
from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[2]
TABLE = json.loads((ROOT / "tests" / "training" / "data" / "megatron_lm_flags.json").read_text())
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "3",
    "--lr",
    "1e-3",
    "--mock-data",
]

OURS_ONLY = LAGOM_FLAGS | {"--preset", "--local-rank", "--local_rank"}
"""Flags Megatron-LM does not have in every supported release: lagom's, the preset loader, and the
rank torch's launchers pass (``--local-rank``: Megatron-LM core_v0.16.1 arguments.py:2275, gone from
0.17.1 on; ``--local_rank``: torch.distributed.launch before torch 2.0). The rank is read from
``LOCAL_RANK`` either way."""

KNOWN_DIFFERENCES = {
    # flag: (field, ours, Megatron-LM's, why)
    "--transformer-impl": (
        "default",
        None,
        "transformer_engine",
        "None picks transformer_engine when TE and a GPU are present, else local: "
        "Transformer Engine does not run on CPU",
    ),
    "--num-query-groups": (
        "default",
        None,
        1,
        "None means one group per head; a value implies --group-query-attention, "
        "as the model presets expect (Megatron-LM ignores it without that flag)",
    ),
}
RELEASE_DIFFERENCES = {
    # (release, flag): (field, ours, that release's, why)
    ("core_v0.18.2", "--data-parallel-sharding-strategy"): (
        "default",
        "no_shard",
        "optim_grads_params",
        "core_v0.16.1 and core_v0.17.1 default to no_shard (as DistributedDataParallelConfig does in all three), "
        "core_v0.18.2's parser to optim_grads_params; ours keeps no_shard and lagom doctor warns when "
        "--use-megatron-fsdp meets no_shard",
    ),
}
"""Differences from one release only (a default Megatron-LM changed between releases)."""
EXTRA_CHOICES = {"--tokenizer-type": {"ByteLevel"}}
"""Choices we add: the byte-level tokenizer needs no vocabulary file."""


def ours():
    parser = build_parser()
    table = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and action.help != "==SUPPRESS==":
                kind = {"_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false"}.get(
                    type(action).__name__, "store"
                )
                table[option] = {
                    "dest": action.dest,
                    "default": action.default,
                    "kind": kind,
                    "choices": list(action.choices) if action.choices else None,
                }
    return table


def test_table_covers_the_supported_releases():
    releases = sorted(TABLE)
    assert releases == ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2"]
    assert all(in_range(r.removeprefix("core_v"), TESTED_MEGATRON_CORE) for r in releases)


@pytest.mark.parametrize("release", sorted(TABLE))
def test_every_flag_we_accept_matches_megatron_lm(release):
    mlm = TABLE[release]
    mine = ours()
    assert OURS_ONLY <= set(mine)
    unknown = sorted(set(mine) - OURS_ONLY - set(mlm))
    assert not unknown, f"flags Megatron-LM {release} does not have: {unknown}"
    mismatches = []
    for flag in sorted(set(mine) - OURS_ONLY):
        a, b = mine[flag], mlm[flag]
        for field in ("dest", "kind", "default"):
            if a[field] != b[field]:
                known = KNOWN_DIFFERENCES.get(flag) or RELEASE_DIFFERENCES.get((release, flag))
                if known and known[:3] == (field, a[field], b[field]):
                    continue
                mismatches.append(f"{flag} {field}: ours {a[field]!r}, Megatron-LM {b[field]!r}")
        if a["choices"] is not None:
            extra = set(a["choices"]) - set(b["choices"] or ()) - EXTRA_CHOICES.get(flag, set())
            if extra:
                mismatches.append(f"{flag} choices Megatron-LM lacks: {sorted(extra)}")
    assert not mismatches, "\n".join(mismatches)
    for flag, (field, mine_value, theirs, _why) in KNOWN_DIFFERENCES.items():  # each exception still real
        assert mine[flag][field] == mine_value and mlm[flag][field] == theirs
    for (where, flag), (field, mine_value, theirs, _why) in RELEASE_DIFFERENCES.items():
        if where == release:
            assert mine[flag][field] == mine_value and mlm[flag][field] == theirs


def test_sharding_strategy_is_megatron_lms_and_reaches_the_ddp_config():
    """--data-parallel-sharding-strategy: Megatron-LM's choices in every release, the default of
    core_v0.16.1 / core_v0.17.1, and passed to megatron-core's DistributedDataParallelConfig (whose own
    default is no_shard), as Megatron-LM passes every DDP-config field of the same name."""
    from lagom_megatron.training import model

    for release in TABLE:
        assert TABLE[release]["--data-parallel-sharding-strategy"]["choices"] == [
            "no_shard",
            "optim",
            "optim_grads",
            "optim_grads_params",
        ]
    assert [TABLE[r]["--data-parallel-sharding-strategy"]["default"] for r in sorted(TABLE)] == [
        "no_shard",
        "no_shard",
        "optim_grads_params",
    ]
    assert parse_args(SMALL).data_parallel_sharding_strategy == "no_shard"
    args = validate_args(parse_args(SMALL + ["--data-parallel-sharding-strategy", "optim_grads_params"]), 1)
    assert model.ddp_config(args).data_parallel_sharding_strategy == "optim_grads_params"
    assert model.ddp_config(validate_args(parse_args(SMALL), 1)).data_parallel_sharding_strategy == "no_shard"
    with pytest.raises(ValueError, match="invalid choice: 'zero3'.*optim_grads_params"):
        parse_args(SMALL + ["--data-parallel-sharding-strategy", "zero3"], exit_on_error=False)


@pytest.mark.parametrize("release", sorted(TABLE))
def test_refused_flags_are_not_megatron_lm_flags(release):
    assert not set(MEGATRON_LM_REFUSED) & set(TABLE[release])
    assert TABLE[release]["--no-overlap-p2p-communication"] == {
        "choices": None,
        "default": True,
        "dest": "overlap_p2p_comm",
        "kind": "store_false",
    }


def test_refused_flag_says_what_to_use_instead():
    with pytest.raises(
        ValueError, match="--overlap-p2p-communication is not accepted: .*--no-overlap-p2p-communication turns it off"
    ):
        parse_args(SMALL + ["--overlap-p2p-communication"], exit_on_error=False)


def test_p2p_overlap_is_on_by_default_with_the_interleaved_schedule():
    args = validate_args(
        parse_args(
            SMALL
            + [
                "--num-layers",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "2",
            ]
        ),
        2,
    )
    assert args.overlap_p2p_comm is True
    args = validate_args(
        parse_args(
            SMALL
            + [
                "--num-layers",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--global-batch-size",
                "2",
                "--no-overlap-p2p-communication",
            ]
        ),
        2,
    )
    assert args.overlap_p2p_comm is False
    assert validate_args(parse_args(SMALL + ["--pipeline-model-parallel-size", "2"]), 2).overlap_p2p_comm is False


def test_swiglu_ffn_size_is_megatron_lms():
    assert default_ffn_hidden_size(4096, True) == 10880 and default_ffn_hidden_size(4096, False) == 16384
    assert default_ffn_hidden_size(64, True) == 128  # int(170.67 / 64) * 64
    assert validate_args(parse_args(SMALL + ["--swiglu"]), 1).ffn_hidden_size == 128
    assert validate_args(parse_args(SMALL), 1).ffn_hidden_size == 256
    assert validate_args(parse_args(SMALL + ["--swiglu", "--ffn-hidden-size", "96"]), 1).ffn_hidden_size == 96


def test_grad_reduction_dtype_and_fusion_follow_megatron_lm():
    assert validate_args(parse_args(SMALL + ["--bf16"]), 1).accumulate_allreduce_grads_in_fp32 is True
    assert validate_args(parse_args(SMALL + ["--fp16"]), 1).accumulate_allreduce_grads_in_fp32 is False
    assert (
        validate_args(
            parse_args(SMALL + ["--fp16", "--accumulate-allreduce-grads-in-fp32"]), 1
        ).accumulate_allreduce_grads_in_fp32
        is True
    )
    assert parse_args(SMALL).gradient_accumulation_fusion is True
    assert parse_args(SMALL + ["--no-gradient-accumulation-fusion"]).gradient_accumulation_fusion is False


def test_model_configs_take_the_new_flags():
    from lagom_megatron.training import model

    args = validate_args(
        parse_args(
            SMALL
            + [
                "--init-method-std",
                "0.006",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
                "--attention-backend",
                "unfused",
                "--fp16",
            ]
        ),
        1,
    )
    cfg = model.transformer_config(args, on_gpu=False)
    assert cfg.init_method_std == 0.006
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)
    assert cfg.attention_backend.name == "unfused"
    assert cfg.gradient_accumulation_fusion is False  # no fused kernel on CPU
    assert model.ddp_config(args).grad_reduce_in_fp32 is False  # fp16 grads reduced in fp16, as Megatron-LM


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method"),
        (
            ["--recompute-granularity", "selective", "--recompute-method", "block"],
            "--recompute-granularity selective takes no --recompute-method",
        ),
        (
            ["--recompute-num-layers", "2"],
            "--recompute-method and --recompute-num-layers need --recompute-granularity full",
        ),
        (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters >= 1"),
        (
            ["--attention-backend", "local", "--transformer-impl", "transformer_engine"],
            "--attention-backend local needs --transformer-impl local",
        ),
    ],
)
def test_rejected_combinations(extra, message):
    with pytest.raises(ValueError, match=message):
        validate_args(parse_args(SMALL + extra), 1)


def test_wsd_schedule_reaches_megatron_cores_scheduler():
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = validate_args(
        parse_args(
            SMALL
            + [
                "--train-iters",
                "10",
                "--lr-decay-style",
                "WSD",
                "--lr-wsd-decay-iters",
                "4",
                "--lr-wsd-decay-style",
                "linear",
                "--min-lr",
                "1e-4",
            ]
        ),
        1,
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)

    class Wrapped:  # OptimizerParamScheduler reads optimizer.param_groups
        param_groups = opt.param_groups

    gbs = args.global_batch_size
    sched = OptimizerParamScheduler(
        Wrapped,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=0,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=args.lr_wsd_decay_iters * gbs,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
    lrs = []
    for _ in range(10):
        sched.step(gbs)
        lrs.append(sched.get_lr(opt.param_groups[0]))
    assert lrs[:6] == [pytest.approx(1e-3)] * 6  # stable phase
    assert lrs[6:] == pytest.approx([1e-3 - 0.9e-3 * k / 4 for k in (1, 2, 3, 4)])  # linear decay to min-lr


def test_help_lists_every_lagom_flag():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pretrain_gpt.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 0
    for flag in sorted(LAGOM_FLAGS):
        assert f"  {flag}" in proc.stdout, flag
    for flag in (
        "--init-method-std",
        "--recompute-granularity",
        "--no-overlap-p2p-communication",
        "--attention-backend",
        "--accumulate-allreduce-grads-in-fp32",
        "--lr-wsd-decay-iters",
    ):
        assert f"  {flag}" in proc.stdout, flag
    assert "--overlap-p2p-communication " not in proc.stdout.replace("--no-overlap-p2p-communication", "")


EXAMPLES = json.loads((ROOT / "tests" / "training" / "data" / "megatron_lm_example_flags.json").read_text())
NOT_IN_EVERY_RELEASE = {"--step-batch-size-schedule": "core_v0.18 only (not in core_v0.16.1 / core_v0.17.1's parser)"}


@pytest.mark.parametrize("release", sorted(TABLE))
def test_every_flag_of_megatron_lms_gpt_examples_is_accepted(release):
    """The Megatron-LM flags of its own GPT-3, Llama 3 and Mixtral example scripts: ours has each one
    (with its destination and default, by the test above) but those of one release only."""
    assert sorted(EXAMPLES) == sorted(TABLE) and len(EXAMPLES[release]) > 90
    missing = sorted(set(EXAMPLES[release]) - set(ours()) - set(NOT_IN_EVERY_RELEASE))
    assert not missing, f"flags of Megatron-LM {release}'s examples that pretrain_gpt.py refuses: {missing}"
    for flag in NOT_IN_EVERY_RELEASE:
        assert any(flag not in TABLE[r] for r in TABLE)


def test_flags_without_effect_are_named_and_those_that_would_differ_refused():
    from lagom_megatron.training.parity_flags import inactive_flags

    line = SMALL + [
        "--eval-interval",
        "2",
        "--save",
        "ckpt",
        "--no-persist-layer-norm",
        "--tensorboard-dir",
        "tb",
        "--distributed-backend",
        "gloo",
        "--cross-entropy-loss-fusion",
    ]
    args = parse_args(line)
    assert inactive_flags(args, build_parser(), on_gpu=True) == [
        "--tensorboard-dir (no TensorBoard writer)",
        "--save (this script writes no checkpoints)",
        "--no-persist-layer-norm (persistent layer-norm kernels are never used)",
    ]
    assert "--cross-entropy-loss-fusion (no fused kernels on CPU)" in inactive_flags(args, build_parser(), on_gpu=False)
    assert inactive_flags(parse_args(SMALL), build_parser(), on_gpu=False) == []
    for extra, message in (
        (
            ["--train-samples", "100"],
            "--train-samples 100 is not accepted by scripts/pretrain_gpt.py: "
            "sample-based training is not implemented here; give --train-iters",
        ),
        (["--no-position-embedding"], "--no-position-embedding is deprecated"),
        (
            ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"],
            "pass one of --lr-warmup-fraction and --lr-warmup-iters, not both",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            validate_args(parse_args(SMALL + extra), 1)
    assert validate_args(parse_args(SMALL + ["--lr-warmup-fraction", "0.5"]), 1).lr_warmup_iters == 1  # of 3
