"""lagom doctor as a command: its exit codes, the pretrain_gpt.py parser it reuses, its own options'
checks, and the training script stopping on the doctor's errors."""

import argparse

import pytest

from lagom_megatron.cli.main import main
from tests.launch.test_doctor import BASE_ENV, base_args
from tests.timeouts import COMMAND_S


def test_command_line_exit_codes(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    bad = [
        "doctor",
        "--world-size",
        "8",
        "--",
        "--tensor-model-parallel-size",
        "3",
        "--num-attention-heads",
        "32",
        "--num-layers",
        "4",
    ]
    assert main(bad) == 1
    out = capsys.readouterr().out
    assert "[world-size]" in out and "[heads-tp]" in out and "2 error(s)" in out
    good = [
        "doctor",
        "--world-size",
        "8",
        "--",
        "--tensor-model-parallel-size",
        "2",
        "--num-attention-heads",
        "32",
        "--num-layers",
        "4",
    ]
    assert main(good) == 1  # pretrain_gpt.py would stop: no --hidden-size, ...
    assert "error: [pretrain-args] --hidden-size is required" in capsys.readouterr().out
    assert main(["doctor", "--megatron-lm", *good[1:], "--eval-interval", "10"]) == 0  # a Megatron-LM line
    capsys.readouterr()
    assert main(["doctor", "--megatron-lm", "--megatron-lm-release", "core_v0.18.2", *good[1:]]) == 1
    assert (
        "no --eval-interval: Megatron-LM core_v0.18.2 computes train_iters // eval_interval\n"
        "    why: megatron/training/training.py:4136 raises TypeError"
    ) in capsys.readouterr().out
    full = ["doctor", "--world-size", "8", "--", "--preset", "cpu-tp2-dp2", "--mock-data"]
    assert main(full) == 1  # training refuses 8 processes for a preset of 4
    assert "error: [preset-world-size] preset 'cpu-tp2-dp2' is for world size 4" in capsys.readouterr().out
    assert main(["doctor", "--world-size", "4", *full[3:]]) == 0


@pytest.mark.parametrize(
    "extra, what",
    [
        (
            ["--lagom-method", "foo"],
            "error: [command-line] argument --lagom-method: invalid choice: 'foo' "
            "(choose from 'priority', 'autoccl', 'nccl-default')",
        ),
        (
            ["--tensor-model-paralel-size", "2"],
            "error: [command-line] unrecognized arguments: --tensor-model-paralel-size "
            "(did you mean --tensor-model-parallel-size?) 2",
        ),
        (["--num-layers", "x"], "error: [command-line] argument --num-layers: invalid int value: 'x'"),
    ],
)
def test_command_line_is_parsed_by_pretrain_gpt(capsys, extra, what):
    assert main(["doctor", "--preset", "cpu-tp2-dp2", "--", *extra]) == 1
    out = capsys.readouterr().out
    assert what in out.splitlines()
    assert "1 error(s)" in out


def test_command_line_validate_args_and_data_warning(capsys):
    assert main(["doctor", "--preset", "cpu-tp2-dp2", "--", "--lr", "0.1", "--min-lr", "1"]) == 1
    out = capsys.readouterr().out
    assert "error: [pretrain-args] need --lr >= --min-lr >= 0; got --lr 0.1, --min-lr 1.0" in out
    assert main(["doctor", "--preset", "cpu-tp2-dp2"]) == 0
    out = capsys.readouterr().out
    assert "warning: [data] no training data: neither --mock-data nor --data-path is given" in out
    assert main(["doctor", "--preset", "cpu-tp2-dp2", "--", "--mock-data"]) == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "option, what",
    [
        (["--world-size", "0"], "argument --world-size: 0 is not an integer in 1..1048576"),
        (["--world-size", "-4"], "argument --world-size: -4 is not an integer in 1..1048576"),
        (["--gpus-per-node", "0"], "argument --gpus-per-node: 0 is not an integer in 1..1024"),
        # accepted before (rc 0, no error): twenty digits are no GPU count
        (
            ["--gpus-per-node", "99999999999999999999"],
            "argument --gpus-per-node: 99999999999999999999 is not an integer in 1..1024",
        ),
    ],
)
def test_command_refuses_bad_own_options_as_usage(capsys, option, what):
    # the doctor's own options are checked by argparse: a usage error (exit 2), nothing checked yet
    assert main(["doctor", "--preset", "gpt3-13b-h100x64", *option]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and what in captured.err


@pytest.mark.parametrize(
    "option, what",
    [
        (["--gpus-per-node", "3"], "error: [gpus-per-node] world size 64 is not a multiple of the 3 GPUs per node"),
        (
            ["--gpus-per-node", "3"],
            "error: [tp-node] --tensor-model-parallel-size 2 does not tile the 3 GPUs of a node",
        ),
    ],
)
def test_command_rejects_bad_node_shapes(capsys, option, what):
    assert main(["doctor", "--cluster", "h100-sxm-ib400", "--preset", "gpt3-13b-h100x64", *option]) == 1
    out = capsys.readouterr().out
    assert what in out.splitlines()
    assert "fix: " in out


def test_missing_tuner_plugin_file_is_an_error(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", "/nonexist.so")
    assert main(["doctor", "--cluster", "h100-sxm-ib400", "--preset", "llama3-70b-h100x64"]) == 1
    out = capsys.readouterr().out
    assert "error: [nccl-env] NCCL_TUNER_PLUGIN='/nonexist.so': the file does not exist" in out.splitlines()
    assert "not lagom's plugin" not in out and "1 error(s), 0 warning(s)" in out


def test_command_needs_input(capsys):
    assert main(["doctor"]) == 2
    assert "give --preset" in capsys.readouterr().err


def test_detect_cluster_and_preflight_pretrain(capsys):
    """Without CUDA the doctor checks against cpu-gloo; $LAGOM_CLUSTER wins when set."""
    import torch

    from lagom_megatron.launch.doctor import detect_cluster, preflight_pretrain

    assert detect_cluster(environ={"LAGOM_CLUSTER": "a100-ib100"}).name == "a100-ib100"
    if not torch.cuda.is_available():
        assert detect_cluster(environ={}).backend == "gloo"
    ns = argparse.Namespace(**base_args(), preset_name=None)
    env = {**BASE_ENV, "WORLD_SIZE": "16", "RANK": "0", "LAGOM_CLUSTER": "h100-sxm-ib400"}
    assert preflight_pretrain(ns, env) == []
    with pytest.raises(SystemExit):
        preflight_pretrain(argparse.Namespace(**base_args(num_layers=9)), env)
    assert "[layers-pp]" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # another rank: stops silently
        preflight_pretrain(argparse.Namespace(**base_args(num_layers=9)), {**env, "RANK": "3"})
    assert capsys.readouterr().out == ""


def test_pretrain_gpt_with_lagom_stops_on_doctor_errors():
    """scripts/pretrain_gpt.py --lagom runs the doctor before creating any process group."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_gpt.py"
    env = {**os.environ, "WORLD_SIZE": "4", "RANK": "0", "LAGOM_CLUSTER": "cpu-gloo"}
    proc = subprocess.run(
        [sys.executable, str(script), "--preset", "cpu-tp2-dp2", "--mock-data", "--lagom", "--tp-comm-overlap"],
        capture_output=True,
        text=True,
        env=env,
        timeout=COMMAND_S,
    )
    # the shared pre-flight (preflight/) refuses bad input with exit code 2, one line on stderr
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "pretrain_gpt.py: error: --tp-comm-overlap is set on a CPU (gloo) cluster; it needs CUDA"
    ]


def test_megatron_lm_doctor_in_a_newer_checkout_warns_once_and_runs_the_layout_rules(capsys, monkeypatch):
    """A checkout newer than the doctor knows (its megatron-core 0.21.0) is checked with main's rules after one
    warning, never refused naming --megatron-lm-release, which the user did not give; the layout rules still run."""
    from lagom_megatron.megatron.hooks import versions

    fake = versions.InstalledVersion("megatron-core", "0.21.0", "/checkout/megatron/core", True)
    monkeypatch.setattr(versions, "installed_megatron_core", lambda: fake)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    line = ["--world-size", "8", "--", "--tensor-model-parallel-size", "3", "--num-attention-heads", "32"]
    assert main(["doctor", "--megatron-lm", *line, "--num-layers", "4"]) == 1
    out = capsys.readouterr().out
    assert "--megatron-lm-release" not in out
    assert out.count("warning: [megatron-lm] Megatron-LM core_v0.21.0 is newer than the releases the doctor knows") == 1
    assert "[world-size]" in out and "[heads-tp]" in out  # layout rules
    assert "megatron/training/training.py:5436 raises TypeError" in out  # main's --eval-interval line


def test_a_bad_megatron_lm_release_given_is_named(capsys):
    assert main(["doctor", "--megatron-lm", "--megatron-lm-release", "core_v0.9", "--", "--num-layers", "4"]) == 2
    err = capsys.readouterr().err
    assert (
        "--megatron-lm-release 'core_v0.9' is not one of the Megatron-LM releases the doctor knows (core_v0.16.x" in err
    )


def test_megatron_lm_line_with_untested_versions_is_refused_only_with_lagom(capsys, monkeypatch):
    """As Megatron-LM's loop does (launch/megatron_lm.py): without --lagom a warning, with --lagom an error."""
    from lagom_megatron.megatron.hooks import versions

    line = "megatron-core 0.21.0 (checkout at /checkout/megatron/core) is outside the tested range >=0.16.1,<0.21"
    monkeypatch.setattr(versions, "untested_versions", lambda: [line])
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    good = ["doctor", "--megatron-lm", "--megatron-lm-release", "core_v0.19.1", "--world-size", "8", "--"]
    good += ["--tensor-model-parallel-size", "2", "--num-attention-heads", "32", "--eval-interval", "10"]
    assert main(good) == 0
    assert f"warning: [versions] {line}" in capsys.readouterr().out
    assert main([*good, "--lagom"]) == 1
    assert f"error: [versions] {line}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, env", [(["--world-size", "2"], {}), (["--", "--mock-data"], {"WORLD_SIZE": "2"})], ids=["option", "env"]
)
def test_a_preset_on_another_world_size_gets_training_s_refusal(capsys, monkeypatch, tmp_path, argv, env):
    import os

    from lagom_megatron.training.arguments import parse_args
    from lagom_megatron.training.pretrain_gpt import pretrain_preflight

    monkeypatch.chdir(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["doctor", "--preset", "cpu-tp2-dp2", *argv]) == 1
    out = capsys.readouterr().out.splitlines()
    said: list[str] = []
    args = parse_args(["--preset", "cpu-tp2-dp2", "--mock-data"])
    assert pretrain_preflight(args, {**os.environ, "WORLD_SIZE": "2", "RANK": "0"}, log=said.append) == 2
    refusal = said[0].removeprefix("pretrain_gpt.py: error: ")
    assert "is for world size 4 but this job has 2 processes" in refusal
    assert f"error: [preset-world-size] {refusal}" in out
    assert out[-1].startswith("lagom doctor: preset cpu-tp2-dp2: 1 error(s)")
    assert list(tmp_path.iterdir()) == []


def test_the_preset_s_own_world_size_has_no_preset_world_size_finding(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["doctor", "--preset", "cpu-tp2-dp2", "--", "--mock-data"]) == 0
    assert "preset-world-size" not in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["doctor", "--preset", "cpu-tp2-dp2", "--", "--mock-data"]) == 0


def test_cluster_option_and_lagom_cluster_flag_give_one_verdict_on_this_machine(capsys, monkeypatch, tmp_path):
    """``--cluster cpu-gloo`` on a CPU machine checks this machine's libraries as ``--lagom-cluster`` does."""
    from lagom_megatron.preflight.cluster import this_machine

    if this_machine().cuda:
        pytest.skip("a CUDA machine is not a cpu-gloo node")
    monkeypatch.chdir(tmp_path)
    verdicts = []
    for argv in (["--cluster", "cpu-gloo"], ["--", "--lagom-cluster", "cpu-gloo"]):
        code = main(["doctor", "--preset", "llama3-8b-h100x8", *argv])
        out = capsys.readouterr().out.splitlines()
        verdicts.append((code, [line for line in out if line.startswith(("error:", "warning:"))], out[-1]))
    assert verdicts[0] == verdicts[1]
    assert list(tmp_path.iterdir()) == []
    try:
        import transformer_engine  # noqa: F401
    except ImportError:  # context parallelism needs Transformer Engine: the preset has CP=2
        assert verdicts[0][0] == 1
        assert any("--context-parallel-size 2 needs Transformer Engine" in line for line in verdicts[0][1])
