"""Every shipped preset loads, maps onto pretrain_gpt.py's flags and passes validate_args at its world size."""

import pytest

from lagom_megatron.config.presets import OMIT_WHEN_DEFAULT, available, load_model, load_preset
from lagom_megatron.training.argument_checks import validate_args
from lagom_megatron.training.arguments import build_parser, parse_args


@pytest.mark.parametrize("name", available("presets"))
def test_preset_is_runnable(name):
    preset = load_preset(name)
    dests = {a.dest for a in build_parser()._actions}
    megatron_lm_only = {k for k in set(preset.to_args()) - dests if k in OMIT_WHEN_DEFAULT}
    if megatron_lm_only:
        # e.g. use_megatron_fsdp: a Megatron-LM pretrain_gpt.py flag our CPU script does not take;
        # such a preset runs through a patched Megatron-LM checkout (launch/megatron_args.py)
        from lagom_megatron.launch.megatron_args import flag, preset_to_argv

        argv = preset_to_argv(preset)
        assert all(flag(k) in argv for k in megatron_lm_only), (name, megatron_lm_only)
        return
    assert set(preset.to_args()) <= dests, f"preset {name}: keys without a flag: {set(preset.to_args()) - dests}"
    extra = [] if preset.data.data_path or preset.data.mock_data else ["--mock-data"]
    args = validate_args(parse_args(["--preset", name, *extra]), preset.world_size)
    layout = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    assert args.data_parallel_size * layout == preset.world_size


def test_cpu_demo_presets_arithmetic():
    # The header comments' arithmetic: 8 samples = micro-batch x micro-batches x DP, 4 ranks.
    for name, mbs, n_mb in (("cpu-tp2-dp2", 2, 2), ("cpu-pp2-dp2", 1, 4)):
        args = validate_args(parse_args(["--preset", name, "--mock-data"]), 4)
        assert (args.micro_batch_size, args.num_microbatches, args.data_parallel_size) == (mbs, n_mb, 2)
        assert args.global_batch_size == mbs * n_mb * 2 == 8
        assert args.overlap_grad_reduce


def test_tiny_gpt_model():
    spec = load_model("tiny-gpt")
    assert spec.hidden_size % spec.num_attention_heads == 0
    assert spec.vocab_size >= 257 and spec.vocab_size % 2 == 0  # byte ids fit; divisible by TP 2
    assert spec.hidden_dropout == spec.attention_dropout == 0.0


@pytest.mark.parametrize("name", available("presets"))
def test_preset_header_names_no_other_preset(name):
    # a header word that starts with the preset's name is the name itself ("llama2-7b-a40x16-tp82"
    # named no preset)
    import re

    from lagom_megatron.config.presets import CONFIGS_DIR

    header = (CONFIGS_DIR / "presets" / f"{name}.yaml").read_text().split("\ndescription:")[0]
    words = re.findall(r"[\w.-]+", header)
    assert [w for w in words if w.startswith(name) and w.rstrip(".") != name] == []
