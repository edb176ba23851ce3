"""Every shipped preset passes ``lagom doctor`` on its own cluster, both as our pretrain_gpt.py's line
(``--preset P``) and as the Megatron-LM line the SLURM scripts build from it (``--megatron-lm``)."""

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.config.presets import available, load_preset
from lagom_megatron.launch.megatron_args import preset_to_argv

PRESETS = available("presets")


def test_every_preset_is_checked():
    assert len(PRESETS) >= 12 and {"gpt3-2.7b-a40x8-fsdp", "llama2-7b-a40x16-fsdp"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_passes_the_doctor_on_its_cluster(name, capsys):
    cluster = load_preset(name).cluster
    assert main(["doctor", "--preset", name, "--cluster", cluster]) == 0, capsys.readouterr().out
    assert f"lagom doctor: preset {name}: 0 error(s)" in capsys.readouterr().out


@pytest.mark.parametrize("release", ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.1", "core_v0.20.0"])
@pytest.mark.parametrize("name", PRESETS)
def test_presets_megatron_lm_line_passes_the_doctor(name, release, capsys):
    preset = load_preset(name)
    argv = [
        "doctor",
        "--megatron-lm",
        "--megatron-lm-release",
        release,
        "--cluster",
        preset.cluster,
        "--preset",
        name,
        "--",
        *preset_to_argv(preset),
    ]  # the preset's env, as the SLURM scripts export it
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "--eval-interval" in preset_to_argv(preset)


@pytest.mark.parametrize("name", PRESETS)
def test_the_doctors_megatron_lm_preset_is_the_line_the_slurm_launch_runs(name, capsys, monkeypatch):
    """``lagom doctor --megatron-lm --preset P`` with no line after it failed on its own ``--eval-interval`` rule
    for shipped presets: the SLURM launch adds the flag (``megatron_args.preset_to_argv``), the doctor did not."""
    from lagom_megatron.launch import megatron_args
    from lagom_megatron.launch.slurm import train_command

    monkeypatch.delenv("LAGOM_CLUSTER", raising=False)
    preset = load_preset(name)
    seen = []
    real = megatron_args.argv_to_args
    monkeypatch.setattr(megatron_args, "argv_to_args", lambda argv: seen.append(list(argv)) or real(argv))
    code = main(["doctor", "--megatron-lm", "--preset", name, "--cluster", preset.cluster])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[-1] == f"lagom doctor: preset {name}: 0 error(s), 0 warning(s)"
    launched = train_command(preset, root="/lagom", plan=None, megatron_lm="/megatron-lm", extra=[])
    assert seen[-1] == launched[1:]  # the doctor checked the very line srun runs


def test_flags_after_the_preset_override_its_megatron_lm_line(capsys, monkeypatch):
    monkeypatch.delenv("LAGOM_CLUSTER", raising=False)
    argv = ["doctor", "--megatron-lm", "--preset", "llama3-8b-h100x8", "--cluster", "h100-sxm-ib400"]
    assert main([*argv, "--", "--tensor-model-parallel-size", "3"]) == 1
    out = capsys.readouterr().out
    assert "error: [heads-tp] --num-attention-heads 32 is not a multiple of --tensor-model-parallel-size 3" in out
    assert out.splitlines()[-1].startswith("lagom doctor: preset llama3-8b-h100x8: 4 error(s)")


FSDP_PRESETS = ["gpt3-2.7b-a40x8-fsdp", "llama2-7b-a40x16-fsdp"]


def _pairs(argv):
    return {(a, b) for a, b in zip(argv, argv[1:]) if a.startswith("--") and not b.startswith("--")}


@pytest.mark.parametrize("name", FSDP_PRESETS)
def test_fsdp_presets_megatron_lm_line_shards_parameters_gradients_and_optimizer_state(name, capsys):
    """Megatron-LM's default strategy is no_shard in core_v0.16/0.17 (arguments.py:2307 / :2722): the
    line must say optim_grads_params, with the distributed optimizer and checkpoint format Megatron-FSDP needs."""
    preset = load_preset(name)
    assert preset.overlap.use_megatron_fsdp and preset.overlap.data_parallel_sharding_strategy == "optim_grads_params"
    argv = preset_to_argv(preset)
    assert {("--data-parallel-sharding-strategy", "optim_grads_params"), ("--ckpt-format", "fsdp_dtensor")} <= _pairs(
        argv
    )
    assert argv.count("--data-parallel-sharding-strategy") == 1 and "--use-distributed-optimizer" in argv
    for release in ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.1", "core_v0.20.0"):
        assert (
            main(
                ["doctor", "--megatron-lm", "--megatron-lm-release", release, "--cluster", preset.cluster, "--", *argv]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert "fsdp-sharding" not in out and "--use-megatron-fsdp without" not in out, out


def test_a_megatron_fsdp_preset_without_sharding_says_no_shard_on_its_line_and_is_warned(capsys):
    preset = load_preset("gpt3-2.7b-a40x8-fsdp")
    plain = preset.model_copy(
        update={"overlap": preset.overlap.model_copy(update={"data_parallel_sharding_strategy": "no_shard"})}
    )
    argv = preset_to_argv(plain)
    assert ("--data-parallel-sharding-strategy", "no_shard") in _pairs(argv)  # core_v0.18 would shard otherwise
    assert (
        main(
            [
                "doctor",
                "--megatron-lm",
                "--megatron-lm-release",
                "core_v0.18.2",
                "--cluster",
                preset.cluster,
                "--",
                *argv,
            ]
        )
        == 0
    )
    assert (
        "warning: [fsdp-sharding] --use-megatron-fsdp with --data-parallel-sharding-strategy no_shard\n"
        in capsys.readouterr().out
    )
    assert "--data-parallel-sharding-strategy" not in preset_to_argv(load_preset("llama3-8b-h100x8"))  # not FSDP
