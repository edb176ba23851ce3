"""Arguments of pretrain_gpt.py: presets as defaults, Megatron-LM's names, and one clear error per bad input."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lagom_megatron.training.argument_checks import check_installed, validate_args
from lagom_megatron.training.arguments import LAGOM_FLAGS, build_parser, parse_args
from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "3",
    "--lr",
    "1e-3",
    "--mock-data",
]


def validated(extra, world_size=4):
    return validate_args(parse_args(SMALL + list(extra)), world_size)


def test_lagom_flags_are_frozen():
    # Changing the public --lagom* surface must change this test on purpose.
    assert LAGOM_FLAGS == frozenset(
        {
            "--lagom",
            "--lagom-warmup-iters",
            "--lagom-verify-iters",
            "--lagom-verify-max-iters",
            "--lagom-plan",
            "--lagom-method",
            "--lagom-report",
            "--lagom-pool-budget-mib",
            "--lagom-allow-untested-versions",
            "--lagom-cluster",
        }
    )
    defined = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--lagom")}
    assert defined == LAGOM_FLAGS


def test_megatron_names_and_defaults():
    args = parse_args([])
    # Megatron-LM's defaults for the flags it shares with us.
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    assert args.seed == 1234 and args.clip_grad == 1.0 and args.weight_decay == 0.01
    assert args.make_vocab_size_divisible_by == 128 and args.log_interval == 100
    assert not args.overlap_grad_reduce and not args.use_distributed_optimizer and args.ddp_bucket_size is None
    assert args.lagom is False and args.lagom_method == "priority"


def test_preset_gives_defaults_and_flags_override():
    args = parse_args(["--preset", "cpu-tp2-dp2", "--train-iters", "7", "--lagom", "--lagom-method", "autoccl"])
    assert args.preset_name == "cpu-tp2-dp2"
    assert args.tensor_model_parallel_size == 2 and args.sequence_parallel and args.overlap_grad_reduce
    assert args.num_layers == 4 and args.hidden_size == 128  # from configs/models/tiny-gpt.yaml
    assert args.train_iters == 7  # explicit flag beats the preset's 40
    assert args.lagom and args.lagom_method == "autoccl"


def test_derived_values():
    args = validated(["--tensor-model-parallel-size", "2", "--global-batch-size", "8"], world_size=4)
    assert args.data_parallel_size == 2
    assert args.num_microbatches == 8 // (2 * 2)
    assert args.ffn_hidden_size == 4 * 64 and args.max_position_embeddings == 32
    assert args.num_query_groups == 4
    # 257 byte ids padded to a multiple of 128 x TP(2) = 256 -> 512.
    assert (args.orig_vocab_size, args.padded_vocab_size) == (257, 512)
    vpp = validated(
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "8",
        ],
        world_size=2,
    )
    assert vpp.virtual_pipeline_model_parallel_size == 2  # 4 layers / PP 2 / 1 per virtual stage
    chunks = validated(
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
            "--global-batch-size",
            "8",
        ],
        world_size=2,
    )
    assert chunks.virtual_pipeline_model_parallel_size == 2 and chunks.num_layers_per_virtual_pipeline_stage == 1
    assert validated(["--sequence-parallel"], world_size=1).sequence_parallel is False  # TP=1: off, as Megatron-LM


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        (
            ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
            6,
            "world size 6 is not divisible by tensor (2) x pipeline (2) x context (1) parallel size = 4",
        ),
        (
            ["--tensor-model-parallel-size", "8"],
            8,
            "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8",
        ),
        # megatron-core 0.16.1 accepts groups that are a multiple or a divisor of TP (transformer_config.py:939-946)
        (
            [
                "--tensor-model-parallel-size",
                "4",
                "--num-attention-heads",
                "12",
                "--hidden-size",
                "96",
                "--num-query-groups",
                "6",
            ],
            4,
            "--num-query-groups 6 is neither a multiple nor a divisor of --tensor-model-parallel-size 4",
        ),
        (
            ["--pipeline-model-parallel-size", "3"],
            3,
            "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
            2,
            "layers per pipeline stage 2 (--num-layers 4 / --pipeline-model-parallel-size 2) is not divisible by "
            "--num-layers-per-virtual-pipeline-stage 3",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"],
            2,
            "layers per pipeline stage 2 (--num-layers 4 / --pipeline-model-parallel-size 2) is not divisible by "
            "--num-virtual-stages-per-pipeline-rank 3",
        ),
        (
            ["--global-batch-size", "6"],
            4,
            "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 4 = 8",
        ),
        (
            ["--overlap-param-gather", "--overlap-grad-reduce"],
            1,
            "--overlap-param-gather needs --use-distributed-optimizer",
        ),
        (["--tokenizer-type", "ByteLevel", "--vocab-size", "200"], 1, "--vocab-size 200 must be >= 257"),
    ],
)
def test_bad_parallel_layouts(extra, world_size, message):
    with pytest.raises(ValueError) as info:
        validated(extra, world_size)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_data_path(tmp_path):
    prefix = tmp_path / "nothing"
    args = parse_args([a for a in SMALL if a != "--mock-data"] + ["--data-path", str(prefix)])
    with pytest.raises(ValueError, match=r"--data-path '.*nothing': .*nothing\.bin does not exist"):
        validate_args(args, 1)
    args = parse_args([a for a in SMALL if a != "--mock-data"])
    with pytest.raises(ValueError, match="no training data: pass --mock-data or --data-path"):
        validate_args(args, 1)


def test_unreadable_data_path(tmp_path, monkeypatch):
    for suffix in (".bin", ".idx"):
        (tmp_path / f"d{suffix}").write_bytes(b"x")
    (tmp_path / "d.idx").chmod(0)
    # root reads files whatever their mode, so ask os.access the way an ordinary user's call would answer
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).endswith("d.idx") else real_access(p, mode))
    args = parse_args([a for a in SMALL if a != "--mock-data"] + ["--data-path", str(tmp_path / "d")])
    with pytest.raises(ValueError, match=r"d\.idx is not readable"):
        validate_args(args, 1)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown preset 'cpu-tp2-dp3' \(did you mean 'cpu-tp2-dp2'\?\)"):
        parse_args(["--preset", "cpu-tp2-dp3"])


def test_malformed_preset_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny-gpt\nparallel:\n  tensor_model_parallel_size: [2\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: malformed YAML at line \d+ column \d+"):
        parse_args(["--preset", str(bad)])


def test_unknown_preset_key(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("model: tiny-gpt\nparallel:\n  tensor_model_paralel_size: 2\n")
    with pytest.raises(
        ValueError,
        match=r"unknown key 'parallel.tensor_model_paralel_size'; "
        r"did you mean 'tensor_model_parallel_size'\?",
    ):
        parse_args(["--preset", str(bad)])


def run_script(*argv, world_size="4", rank=None):
    """Runs pretrain_gpt.py as one rank of torchrun would (``world_size`` None: as plain ``python``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update({k: v for k, v in (("WORLD_SIZE", world_size), ("RANK", rank)) if v is not None})
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pretrain_gpt.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=COMMAND_S,
    )


def silent_rank(argv, rank, monkeypatch, capsys, world="4"):
    """``main(ARGV)`` in-process as rank ``rank`` of ``world`` with no wait before exiting (a rank other than
    0 waits ``REFUSAL_GRACE_S`` for torchrun to stop it once rank 0 has printed): (code, stdout, stderr)."""
    from lagom_megatron.training import pretrain_gpt

    monkeypatch.setattr(pretrain_gpt, "REFUSAL_GRACE_S", 0.0)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    capsys.readouterr()
    try:
        code = pretrain_gpt.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_script_reports_bad_layout_on_one_line_before_any_process_group():
    # No torchrun, no MASTER_ADDR: had a process group been created, this would fail differently.
    proc = run_script("--preset", "cpu-tp2-dp2", "--mock-data", "--tensor-model-parallel-size", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [  # the shared pre-flight's first error (the doctor's rule)
        "pretrain_gpt.py: error: world size 4 is not divisible by TP x PP x CP = 3 x 1 x 1 = 3 "
        "(and 2 more error(s): lagom doctor lists them)"
    ]


def test_script_reports_unknown_preset():
    proc = run_script("--preset", "no-such-preset")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: unknown preset 'no-such-preset'")


def test_bad_lagom_values_fail_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    cases = [
        (["--lagom-verify-iters", "0"], "--lagom-verify-iters 0 is out of range; allowed: an integer in 1..200"),
        (["--lagom-report", str(tmp_path)], f"--lagom-report {str(tmp_path)!r} is a folder; give a file name"),
        (["--lagom-plan", str(tmp_path)], f"--lagom-plan {str(tmp_path)!r} is a folder; give a file name"),
        (["--lagom-report", str(tmp_path / "file" / "r.md")], "is not a folder"),
        (["--lagom-report", str(tmp_path / "r.txt")], "--lagom-report must end in .md, .csv or .json"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError) as info:
            validated(["--lagom", *extra], 1)
        assert message in str(info.value), f"{extra}: got {info.value}"
    assert validated(["--lagom", "--lagom-report", str(tmp_path / "new" / "r.csv")], 1).lagom_report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lagom-method", "foo"], "argument --lagom-method: invalid choice: 'foo'"),
        (["--train-iters", "abc"], "argument --train-iters: invalid int value: 'abc'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_script_usage_errors_are_printed_by_rank_0_only(argv, message, monkeypatch, capsys):
    first = run_script("--preset", "cpu-tp2-dp2", *argv, rank="0")
    assert first.returncode == 2 and first.stderr.count("usage:") == 1
    assert first.stderr.strip().splitlines()[-1].startswith(f"pretrain_gpt.py: error: {message}")
    assert silent_rank(["--preset", "cpu-tp2-dp2", *argv], "3", monkeypatch, capsys) == (2, "", "")


def test_script_without_torchrun_suggests_the_launch_command():
    proc = run_script("--preset", "cpu-tp2-dp2", "--mock-data", world_size=None)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: world size 1 is not divisible by TP x PP x CP = 2 x 1 x 1 = 2"
        "; launch 4 processes with: torchrun --standalone --nproc-per-node 4 "
        "scripts/pretrain_gpt.py ..."
    ]
    # No preset: TP x PP x CP processes.
    proc = run_script(*SMALL, "--pipeline-model-parallel-size", "2", world_size=None)
    assert "torchrun --standalone --nproc-per-node 2 scripts/pretrain_gpt.py" in proc.stderr


def test_context_parallel_needs_transformer_engine(monkeypatch):
    import importlib.util

    args = validated(["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real_find_spec(name, *a)
    )
    with pytest.raises(ValueError) as info:
        check_installed(args)
    assert str(info.value) == (
        "--context-parallel-size 2 needs Transformer Engine (megatron-core runs context-parallel "
        "attention in TEDotProductAttention), which is not installed; install "
        "transformer_engine or use --context-parallel-size 1"
    )
    check_installed(validated([]))  # CP 1: nothing needed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    check_installed(args)  # Transformer Engine found


@pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("transformer_engine") is not None,
    reason="Transformer Engine is installed here",
)
def test_script_reports_context_parallel_without_transformer_engine_once(monkeypatch, capsys):
    proc = run_script("--preset", "llama3-8b-h100x8", "--lagom-cluster", "cpu-gloo", world_size="8", rank="0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --context-parallel-size 2 needs Transformer Engine (megatron-core runs "
        "context-parallel attention in TEDotProductAttention), which is not installed; install transformer_engine "
        "or use --context-parallel-size 1"
    ]
    assert silent_rank(["--preset", "llama3-8b-h100x8"], "5", monkeypatch, capsys, "8")[2] == ""
