"""A preset names a layout and its world size: launched with another process count it is refused before
any rank starts, unless the command line names the layout itself (``training.pretrain_gpt.preset_world_problem``)."""

from __future__ import annotations

from lagom_megatron.training.arguments import parse_args
from lagom_megatron.training.pretrain_gpt import preset_world_problem
from tests.training.preflight_harness import train

CPU = ["--preset", "cpu-tp2-dp2", "--mock-data"]
LAYOUT = "(--tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size)"


def test_a_preset_on_too_few_processes_is_refused_with_the_launch_that_fits(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    t = train([*CPU, "--lagom"], monkeypatch, capsys, world=2)
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        "pretrain_gpt.py: error: preset 'cpu-tp2-dp2' is for world size 4 but this job has 2 processes "
        "(WORLD_SIZE=2), which would train TP=2 x PP=1 x CP=1 x DP=1 instead of the preset's DP=2: launch it with "
        f"torchrun --nproc-per-node 4, or give the layout on the command line {LAYOUT} to train another one on 2 "
        "processes"
    ]
    assert not (tmp_path / "lagom_out").exists()  # no world-size-2 plan in the preset's folder, no lock taken
    t = train(CPU, monkeypatch, capsys, world=8)  # too many is the same mistake (DP=4)
    assert (
        t.code == 2
        and "this job has 8 processes (WORLD_SIZE=8), which would train TP=2 x PP=1 x CP=1 x DP=4" in t.errors[0]
    )


def test_the_layout_on_the_command_line_overrides_the_preset_with_a_warning(monkeypatch, capsys):
    t = train([*CPU, "--tensor-model-parallel-size", "2"], monkeypatch, capsys, world=2)
    assert (t.code, t.started, t.errors) == (0, True, [])
    assert t.warnings == [
        "pretrain_gpt.py: warning: preset 'cpu-tp2-dp2' is for world size 4 but this job has 2 processes "
        "(WORLD_SIZE=2): training TP=2 x PP=1 x CP=1 x DP=1, the layout --tensor-model-parallel-size gives"
    ]
    t = train([*CPU, "--tensor-model-parallel-size=1"], monkeypatch, capsys, world=2)  # DP=2 on 2 processes
    assert (t.code, t.started) == (0, True) and "training TP=1 x PP=1 x CP=1 x DP=2" in t.warnings[0]
    t = train(CPU, monkeypatch, capsys, world=4)  # the preset's own world size: not a word
    assert (t.code, t.started, t.errors, t.warnings) == (0, True, [], [])


def test_a_multi_node_preset_names_its_nodes_and_a_preset_without_a_world_size_is_not_checked(tmp_path):
    args = parse_args(["--preset", "gpt3-13b-h100x64", "--mock-data"])
    problem = preset_world_problem(args, 8)
    assert (problem.level, problem.rule) == ("error", "preset-world-size")
    assert problem.fix == (
        "launch it on 8 nodes x 8 GPUs (scripts/slurm/lagom_pretrain.sbatch --preset gpt3-13b-h100x64)"
    )
    assert preset_world_problem(args, 64) is None
    own = tmp_path / "mine.yaml"
    own.write_text(
        "model: tiny-gpt\ntraining:\n  micro_batch_size: 2\n  seq_length: 64\n  train_iters: 4\n  lr: 1.0e-3\n"
    )
    assert parse_args(["--preset", str(own), "--mock-data"]).preset_world_size is None
    assert preset_world_problem(parse_args(["--preset", str(own), "--mock-data"]), 4) is None
