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


@pytest.mark.parametrize("release", ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2"])
@pytest.mark.parametrize("name", PRESETS)
def test_presets_megatron_lm_line_passes_the_doctor(name, release, capsys):
    preset = load_preset(name)
    argv = ["doctor", "--megatron-lm", "--megatron-lm-release", release, "--cluster", preset.cluster,
            "--preset", name, "--", *preset_to_argv(preset)]  # the preset's env, as the SLURM scripts export it
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "--eval-interval" in preset_to_argv(preset)
