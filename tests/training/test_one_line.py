"""One command line for both ``pretrain_gpt.py`` scripts: every refused flag named in one run, what the chosen layers
cannot run refused before any rank starts, FP8 acting in Transformer Engine's layers, Megatron-LM's NCCL flags
passed to megatron-core, and a refused run's line the last one torchrun's user sees."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time

import pytest

from lagom_megatron.training import argument_checks, model
from lagom_megatron.training.argument_checks import validate_args
from lagom_megatron.training.arguments import build_parser, parse_args
from lagom_megatron.training.parity_flags import GPT2_BPE_HINT, inactive_flags
from lagom_megatron.training.pretrain_gpt import repeat_after_exit
from tests.timeouts import LAUNCH_S, run
from tests.training.preflight_harness import CLEAN, ROOT, train

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
    "--lr",
    "1e-3",
    "--mock-data",
    "--tensor-model-parallel-size",
    "1",
]
NOT_HERE = "is not accepted by scripts/pretrain_gpt.py"

needs_cpu = pytest.mark.skipif(
    not __import__("lagom_megatron.preflight.cluster", fromlist=["x"]).cuda_certainly_absent(),
    reason="asserts what a machine without a CUDA GPU refuses",
)


def test_every_refused_flag_is_named_in_one_run(monkeypatch, capsys):
    """Megatron-LM's sample-based schedules, ramp-up, decoupled LR and per-token loss (no --train-iters: the line
    of a sample-based run) were refused one per run, --train-samples first as "--train-iters is required"."""
    argv = SMALL + [
        "--train-samples",
        "1000",
        "--lr-decay-samples",
        "900",
        "--lr-warmup-samples",
        "10",
        "--rampup-batch-size",
        "1",
        "1",
        "100",
        "--decoupled-lr",
        "0.1",
        "--decoupled-min-lr",
        "0.01",
        "--calculate-per-token-loss",
    ]
    t = train(argv, monkeypatch, capsys, world=1)
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        "pretrain_gpt.py: error: 6 problems with this line: "
        f"(1) --train-samples 1000 {NOT_HERE}: sample-based training is not implemented here; give --train-iters; "
        f"(2) --lr-warmup-samples 10 {NOT_HERE}: sample-based schedules are not implemented here; give "
        "--lr-warmup-iters; "
        f"(3) --lr-decay-samples 900 {NOT_HERE}: sample-based schedules are not implemented here; give "
        "--lr-decay-iters; "
        f"(4) --rampup-batch-size 1 1 100 {NOT_HERE}: batch-size ramp-up is not implemented here; "
        f"(5) --calculate-per-token-loss {NOT_HERE}: the loss is averaged per micro-batch here; "
        "(6) --decoupled-lr 0.1, --decoupled-min-lr 0.01 are not accepted by scripts/pretrain_gpt.py: one learning "
        "rate for all parameters here"
    ]


def test_the_tokenizer_files_are_refused_in_one_sentence(monkeypatch, capsys):
    """megatron-core 0.16.1 builds GPT-2 BPE through HuggingFace ``transformers`` (``tokenizers/text/libraries/
    megatron_hf_tokenizer.py``), which this script does not use: the flags no longer pass silently."""
    t = train(
        SMALL + ["--train-iters", "3", "--vocab-file", "gpt2-vocab.json", "--merge-file", "gpt2-merges.txt"],
        monkeypatch,
        capsys,
        world=1,
    )
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        f"pretrain_gpt.py: error: --vocab-file 'gpt2-vocab.json', --merge-file 'gpt2-merges.txt' are not accepted "
        f"by scripts/pretrain_gpt.py: {GPT2_BPE_HINT}"
    ]


@needs_cpu
def test_what_the_local_layers_cannot_run_is_refused_on_cpu_with_the_rest(monkeypatch, capsys):
    """--apply-layernorm-1p passed the pre-flight on CPU (its check read ``transformer_impl`` before the default
    resolved) and died in megatron-core's ``torch_norm.py:26``; FP8 flags were accepted without effect."""
    argv = SMALL + [
        "--train-iters",
        "3",
        "--apply-layernorm-1p",
        "--fp8-format",
        "hybrid",
        "--fp8-amax-history-len",
        "1024",
        "--decoupled-lr",
        "0.1",
    ]
    t = train(argv, monkeypatch, capsys, world=1)
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        "pretrain_gpt.py: error: 3 problems with this line: "
        f"(1) --decoupled-lr 0.1 {NOT_HERE}: one learning rate for all parameters here; "
        "(2) --apply-layernorm-1p needs Transformer Engine layers (megatron-core's local LayerNorm has no "
        "zero-centred weights) but this machine has no CUDA GPU, so the local layers run: drop it to run on CPU; "
        "(3) --fp8-format 'hybrid', --fp8-amax-history-len 1024: FP8 runs in Transformer Engine's layers only but "
        "this machine has no CUDA GPU, so the local layers run: drop the FP8 flags to run on CPU"
    ]


def test_fp8_acts_in_transformer_engine_layers_and_is_refused_without_them(monkeypatch):
    argv = SMALL + ["--train-iters", "3", "--fp8-format", "e4m3", "--fp8-param-gather", "--use-distributed-optimizer"]
    monkeypatch.setattr(argument_checks, "_installed", lambda name: name != "fused_weight_gradient_mlp_cuda")
    args = validate_args(parse_args(argv + ["--no-gradient-accumulation-fusion"]), 1, on_gpu=True)  # TE installed
    fields = model._megatron_lm_fields(args, on_gpu=True)
    # Megatron-LM core_v0.16.1 arguments.py:1331: fp8_param from --fp8-param-gather; the rest by their names
    assert (fields["fp8"], fields["fp8_param"], fields["fp8_amax_history_len"]) == ("e4m3", True, 1)
    assert model.ddp_config(args).fp8_param_gather is True
    monkeypatch.setattr(argument_checks, "_installed", lambda name: False)
    with pytest.raises(ValueError) as info:
        validate_args(parse_args(argv + ["--no-gradient-accumulation-fusion"]), 1, on_gpu=True)
    assert str(info.value) == (
        "--fp8-format 'e4m3', --fp8-param-gather: FP8 runs in Transformer Engine's layers only but Transformer "
        "Engine is not installed, so the local layers run: install it, or drop the FP8 flags"
    )
    with pytest.raises(ValueError, match="--fp8-param-gather needs --use-distributed-optimizer or --use-megatron"):
        validate_args(parse_args(SMALL + ["--train-iters", "3", "--fp8-format", "e4m3", "--fp8-param-gather"]), 1)


def test_nccl_flags_reach_megatron_core_as_megatron_lm_passes_them():
    """``--high-priority-stream-groups`` goes to ``initialize_model_parallel`` (Megatron-LM core_v0.19.0
    ``training/initialize.py:392``), ``--use-nccl-ub`` to the DDP config's ``nccl_ub`` (its fields by name)."""
    from megatron.core import parallel_state

    assert "high_priority_stream_groups" in inspect.signature(parallel_state.initialize_model_parallel).parameters
    args = validate_args(
        parse_args(SMALL + ["--train-iters", "3", "--high-priority-stream-groups", "tp", "--use-nccl-ub"]), 1
    )
    assert model.high_priority_stream_groups(args, arch_major=9) == ["tp"]
    assert (model.ddp_config(args, on_gpu=True).nccl_ub, model.ddp_config(args, on_gpu=False).nccl_ub) == (True, False)
    assert inactive_flags(args, build_parser(), on_gpu=False) == [
        "--high-priority-stream-groups (gloo has no NCCL streams)",
        "--use-nccl-ub (gloo has no NCCL user buffers)",
    ]
    assert inactive_flags(args, build_parser(), on_gpu=True) == []
    # Megatron-LM core_v0.16.1 arguments.py:958-962: FSDP2 always, Megatron-FSDP from compute capability 10
    fsdp = parse_args(SMALL + ["--train-iters", "3", "--use-megatron-fsdp", "--expert-model-parallel-size", "2"])
    assert model.high_priority_stream_groups(fsdp, arch_major=9) == []
    assert model.high_priority_stream_groups(fsdp, arch_major=10) == ["dp_cp", "ep_dp"]
    fsdp2 = parse_args(SMALL + ["--train-iters", "3", "--use-torch-fsdp2", "--high-priority-stream-groups", "dp_cp"])
    assert model.high_priority_stream_groups(fsdp2, arch_major=8) == ["dp_cp"]
    assert parse_args(SMALL).high_priority_stream_groups == []  # the default list is not shared with a run's


def test_the_line_is_repeated_once_the_launcher_has_exited(capfd):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        started = time.monotonic()
        assert repeat_after_exit(proc.pid, "too early", 0.2) is False
        assert repeat_after_exit(proc.pid, "pretrain_gpt.py: error: X", 60) is True
        assert time.monotonic() - started >= 1.0 and proc.poll() is not None  # reaped or a zombie: it had exited
    finally:
        proc.kill()
        proc.wait()
    assert capfd.readouterr().err == "pretrain_gpt.py: error: X\n"


def test_under_torchrun_the_refusal_is_the_last_line(tmp_path):
    """A real 2-rank torchrun on CPU: rank 0's line, torchrun's ~40-line ChildFailedError summary, then the line
    again; rank 0 exits 2 (the summary's root cause), torchrun 1; nothing written in the working folder."""
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    proc = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "scripts" / "pretrain_gpt.py"),
            *SMALL,
            "--train-iters",
            "3",
            "--lagom",
            "--rampup-batch-size",
            "1",
            "1",
            "8",
            "--decoupled-lr",
            "0.1",
        ],
        cwd=tmp_path,
        env=env,
        text=True,
        timeout=LAUNCH_S,
    )
    line = (
        "pretrain_gpt.py: error: 2 problems with this line: "
        f"(1) --rampup-batch-size 1 1 8 {NOT_HERE}: batch-size ramp-up is not implemented here; "
        f"(2) --decoupled-lr 0.1 {NOT_HERE}: one learning rate for all parameters here"
    )
    lines = [text for text in proc.stderr.splitlines() if text.strip()]
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr and "exitcode  : 2" in proc.stderr
    assert lines[-1] == line and lines.count(line) == 2
    assert list(tmp_path.iterdir()) == []
