"""GPU presets and real-model files: every preset loads, passes lagom doctor on its declared cluster,
states correct arithmetic in its header, and the model files carry the published dimensions."""

import re

import pytest

from lagom_megatron.config.presets import CONFIGS_DIR, available, load_model, load_preset
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.launch.doctor import run_doctor
from lagom_megatron.launch.megatron_args import argv_to_args, preset_to_argv

GPU_PRESETS = [
    "llama3-8b-h100x8",
    "llama3-70b-h100x64",
    "gpt3-175b-h100x512",
    "mixtral-8x7b-h100x32",
    "llama2-7b-a100x32-ib100",
    "gpt3-13b-h100x64",
]

# name: (layers, hidden, ffn, heads, query groups or None, vocab) -- GPT-3 paper / gpt-neox configs,
# Llama-2/3 and Mixtral model cards as used by Megatron-Bridge
DIMENSIONS = {
    "gpt3-1.3b": (24, 2048, 8192, 16, None, 50257),
    "gpt3-2.7b": (32, 2560, 10240, 32, None, 50257),
    "gpt3-6.7b": (32, 4096, 16384, 32, None, 50257),
    "gpt3-13b": (40, 5120, 20480, 40, None, 50257),
    "gpt3-175b": (96, 12288, 49152, 96, None, 50257),
    "llama2-7b": (32, 4096, 11008, 32, 32, 32000),
    "llama2-13b": (40, 5120, 13824, 40, 40, 32000),
    "llama2-70b": (80, 8192, 28672, 64, 8, 32000),
    "llama3-8b": (32, 4096, 14336, 32, 8, 128256),
    "llama3-70b": (80, 8192, 28672, 64, 8, 128256),
    "mixtral-8x7b": (32, 4096, 14336, 32, 8, 32000),
}


@pytest.mark.parametrize("name", sorted(DIMENSIONS))
def test_model_dimensions(name):
    m = load_model(name)
    got = (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups, m.vocab_size)
    assert got == DIMENSIONS[name]


def test_parameter_counts_match_the_names():
    """Weights of attention + MLP + embeddings, worked out from the dimensions (biases and norms left out)."""

    def params(name):
        m = load_model(name)
        h, f, layers, heads = m.hidden_size, m.ffn_hidden_size, m.num_layers, m.num_attention_heads
        kv = (m.num_query_groups or heads) * (h // heads)
        attn = h * h * 2 + 2 * h * kv
        mlp = (3 if m.swiglu else 2) * h * f * (m.num_experts or 1)
        emb = m.vocab_size * h * (2 if m.untie_embeddings_and_output_weights else 1)
        return layers * (attn + mlp) + emb

    expected_billions = {
        "gpt3-1.3b": 1.3,
        "gpt3-2.7b": 2.7,
        "gpt3-6.7b": 6.7,
        "gpt3-13b": 13,
        "gpt3-175b": 175,
        "llama2-7b": 6.7,
        "llama2-13b": 13,
        "llama2-70b": 69,
        "llama3-8b": 8.0,
        "llama3-70b": 70.6,
        "mixtral-8x7b": 46.7,
    }
    for name, billions in expected_billions.items():
        assert params(name) / 1e9 == pytest.approx(billions, rel=0.05), name


@pytest.mark.parametrize("name", available("presets"))
def test_every_preset_passes_doctor_on_its_cluster(name):
    preset = load_preset(name)
    cluster = ClusterSpec.load(preset.cluster)
    findings = run_doctor(preset, {}, cluster)
    assert [f for f in findings if f.level == "error"] == [], [str(f) for f in findings]


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_preset_shape_and_header_arithmetic(name):
    preset = load_preset(name)
    cluster = ClusterSpec.load(preset.cluster)
    assert cluster.backend == "nccl"
    assert preset.slurm.nodes * preset.slurm.gpus_per_node == preset.world_size
    assert preset.slurm.gpus_per_node == cluster.gpus_per_node
    assert run_doctor(preset, {}, cluster) == []
    p, t = preset.parallel, preset.training
    dp = preset.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    header = (CONFIGS_DIR / "presets" / f"{name}.yaml").read_text().split("\ndescription:")[0]
    assert f"--preset {name}" in header
    world = re.search(r"world (\d+) = TP (\d+) x PP (\d+) x CP (\d+) x DP (\d+)", header).groups()
    assert tuple(map(int, world)) == (
        preset.world_size,
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
        dp,
    )
    batch = re.search(r"global batch (\d+) = micro-batch (\d+) x (\d+) accumulation steps x DP (\d+)", header).groups()
    gbs, mbs, acc, dp_h = map(int, batch)
    assert (gbs, mbs, dp_h) == (t.global_batch_size, t.micro_batch_size, dp) and mbs * acc * dp == gbs
    tokens = re.search(r"(\d+) x (\d+) = ([\d,]+) tokens/iteration", header).groups()
    assert (int(tokens[0]), int(tokens[1])) == (gbs, t.seq_length)
    assert int(tokens[2].replace(",", "")) == gbs * t.seq_length


def test_issue_layouts():
    def layout(name):
        p = load_preset(name)
        par = p.parallel
        return (
            p.world_size,
            par.tensor_model_parallel_size,
            par.pipeline_model_parallel_size,
            par.context_parallel_size,
            par.expert_model_parallel_size,
            par.sequence_parallel,
            p.cluster,
        )

    assert layout("llama3-8b-h100x8") == (8, 1, 1, 2, 1, False, "h100-sxm-ib400")
    assert layout("llama3-70b-h100x64") == (64, 4, 4, 2, 1, True, "h100-sxm-ib400")
    assert layout("gpt3-175b-h100x512") == (512, 4, 8, 1, 1, True, "h100-sxm-ib400")
    assert layout("mixtral-8x7b-h100x32") == (32, 1, 4, 1, 8, False, "h100-sxm-ib400")
    assert layout("llama2-7b-a100x32-ib100")[0] == 32 and load_preset("llama2-7b-a100x32-ib100").cluster == "a100-ib100"
    assert ClusterSpec.load("a100-ib100").net_gbps_per_gpu == pytest.approx(100 / 8)  # 100 Gb/s = 12.5 GB/s
    # virtual stages: 80 / (PP 4 x 4 layers) = 5, 96 / (PP 8 x 2 layers) = 6
    p70, p175 = load_preset("llama3-70b-h100x64"), load_preset("gpt3-175b-h100x512")
    assert 80 // (4 * p70.parallel.num_layers_per_virtual_pipeline_stage) == 5
    assert 96 // (8 * p175.parallel.num_layers_per_virtual_pipeline_stage) == 6


def test_unknown_key_names_the_closest(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: llama3-8b\nparallel:\n  tensor_model_paralel_size: 2\n")
    with pytest.raises(
        ValueError, match="unknown key 'parallel.tensor_model_paralel_size'; did you mean 'tensor_model_parallel_size'"
    ):
        load_preset(bad)


@pytest.mark.parametrize(
    "model",
    [
        "  num_layer: 2\n  hidden_size: 64\n  num_attention_heads: 4\n",  # the key misspelt
        "  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n  num_layer: 3\n",  # an extra misspelt key
    ],
)
def test_a_typo_key_inside_an_inline_model_is_named(tmp_path, model):
    """It was reported as ``model.str: Input should be a valid string``, the other branch of ``model:``."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n" + model + "parallel:\n  tensor_model_parallel_size: 1\n")
    with pytest.raises(ValueError) as info:
        load_preset(bad)
    assert str(info.value) == f"{bad}: unknown key 'model.num_layer'; did you mean 'num_layers'?"


def test_a_wrong_type_inside_an_inline_model_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: two\n  hidden_size: 64\n  num_attention_heads: 4\n")
    with pytest.raises(ValueError) as info:
        load_preset(bad)
    assert str(info.value) == f"{bad}:2:15: model.num_layers: Input should be a valid integer (got 'two')"


def test_command_line_overrides_the_preset():
    args = argv_to_args(
        [
            "pretrain_gpt.py",
            "--preset",
            "llama3-8b-h100x8",
            "--context-parallel-size",
            "4",
            "--no-overlap-p2p-communication",
            "--data-path",
            "1",
            "a",
            "--lr=1e-3",
        ]
    )
    assert args["context_parallel_size"] == 4 and args["tensor_model_parallel_size"] == 1
    assert args["overlap_p2p_comm"] is False and args["data_path"] == [1, "a"] and args["lr"] == 1e-3
    assert args["_preset"].name == "llama3-8b-h100x8" and args["num_layers"] == 32


def test_preset_to_megatron_lm_flags_round_trip():
    preset = load_preset("mixtral-8x7b-h100x32")
    argv = preset_to_argv(preset)
    assert "--group-query-attention" in argv and "--disable-bias-linear" in argv and "--moe-grouped-gemm" in argv
    parsed = argv_to_args(argv)
    expected = {k: v for k, v in preset.to_args().items() if v is not None and v is not False}
    for key, value in expected.items():
        assert parsed[key] == value, key
    assert parsed["add_bias_linear"] is False


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_our_pretrain_gpt_takes_every_gpu_preset(name):
    """scripts/pretrain_gpt.py --preset NAME: parsed and validated for the preset's world size."""
    from lagom_megatron.training.argument_checks import validate_args
    from lagom_megatron.training.arguments import parse_args

    preset = load_preset(name)
    args = validate_args(parse_args(["--preset", name]), preset.world_size)
    model = preset.model_spec()
    assert (args.num_layers, args.add_bias_linear) == (model.num_layers, model.add_bias_linear)
    assert args.rotary_base == (model.rotary_base or 10000)
    overridden = parse_args(["--preset", name, "--micro-batch-size", "7"])
    assert overridden.micro_batch_size == 7
