"""Preset YAML values are typed strictly and errors point at file:line:col (PyYAML node marks)."""

import pytest

from lagom_megatron.config.presets import load_preset

HEAD = "model: tiny-gpt\nworld_size: 4\ncluster: cpu-gloo\n"


@pytest.mark.parametrize(
    "body, where, what",
    [
        (
            'overlap:\n  overlap_grad_reduce: "false"\n',
            "5:24",
            "overlap.overlap_grad_reduce: Input should be a valid boolean (got 'false'); allowed: true or false",
        ),
        (
            "parallel:\n  tensor_model_parallel_size: '2'\n",
            "5:31",
            "parallel.tensor_model_parallel_size: Input should be a valid integer (got '2')",
        ),
        (
            "training:\n  lr: 3e-3\n",
            "5:7",
            "training.lr: Input should be a valid number (got '3e-3')",
        ),  # YAML 1.1: a string
    ],
)
def test_quoted_values_are_not_coerced(tmp_path, body, where, what):
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + body)
    with pytest.raises(ValueError) as info:
        load_preset(path)
    assert str(info.value) == f"{path}:{where}: {what}"


def test_an_integer_may_stand_for_a_float(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + "training:\n  lr: 1\n")
    assert load_preset(path).training.lr == 1.0


@pytest.mark.parametrize(
    "body, where, key, word, read_as",
    [
        ("overlap:\n  overlap_grad_reduce: yes\n", "5:24", "overlap.overlap_grad_reduce", "yes", "true"),
        ("training:\n  bf16: Off\n", "5:9", "training.bf16", "Off", "false"),
        ("env:\n  NCCL_DEBUG: off\n", "5:15", "env.NCCL_DEBUG", "off", "false"),
        ("data:\n  data_path: [a, NO]\n", "5:18", "data.data_path.1", "NO", "false"),
        ("on: 1\n", "4:1", "on", "on", "true"),  # a key: {True: 1} would be refused as "unknown key True"
    ],
)
def test_yaml_1_1_words_that_become_booleans_are_refused(tmp_path, body, where, key, word, read_as):
    """PyYAML reads yes/no/on/off (any case) as booleans: ``bf16: Off`` was false and ``NCCL_DEBUG: off`` False,
    without a word."""
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + body)
    with pytest.raises(ValueError) as info:
        load_preset(path)
    assert str(info.value) == (
        f"{path}:{where}: {key}: {word!r} is a YAML 1.1 word that PyYAML reads as {read_as}; allowed: true or false "
        "for a boolean, or the word in quotes for a string"
    )
    assert path.read_text() == HEAD + body


@pytest.mark.parametrize("word", ["y", "n", "Y"])
def test_y_and_n_stay_words_that_a_boolean_refuses(tmp_path, word):
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + f"training:\n  bf16: {word}\n")
    with pytest.raises(ValueError) as info:
        load_preset(path)
    assert str(info.value) == (
        f"{path}:5:9: training.bf16: Input should be a valid boolean (got {word!r}); allowed: true or false"
    )


def test_quoted_words_and_true_false_load(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + "training:\n  bf16: True\noverlap:\n  overlap_grad_reduce: false\nenv:\n  NCCL_X: 'off'\n")
    preset = load_preset(path)
    assert (preset.training.bf16, preset.overlap.overlap_grad_reduce, preset.env) == (True, False, {"NCCL_X": "off"})


@pytest.mark.parametrize(
    "body, key, hint",
    [
        ("trainng:\n  lr: 1\n", "trainng", "did you mean 'training'?"),
        ("training:\n  train_iter: 5\n", "training.train_iter", "did you mean 'train_iters'?"),
        ("train_iters: 5\n", "train_iters", "did you mean 'training.train_iters'?"),  # a key of another section
        ("slurm:\n  node: 2\n", "slurm.node", "did you mean 'nodes'?"),
        ("lagom:\n  lagom_verfy_iters: 3\n", "lagom.lagom_verfy_iters", "did you mean 'lagom_verify_iters'?"),
        ("parallel:\n  tmp: 2\n", "parallel.tmp", "valid keys: context_parallel_size, expert_model_parallel_size"),
    ],
)
def test_a_misspelt_key_at_any_depth_gets_its_closest_match(tmp_path, body, key, hint):
    path = tmp_path / "p.yaml"
    path.write_text(HEAD + body)
    with pytest.raises(ValueError) as info:
        load_preset(path)
    assert str(info.value).startswith(f"{path}: unknown key {key!r}; {hint}")


def test_a_misspelt_key_of_an_inline_model(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model:\n  num_layer: 2\n  hidden_size: 64\n  num_attention_heads: 4\nworld_size: 1\n")
    with pytest.raises(ValueError) as info:
        load_preset(path)
    assert str(info.value) == f"{path}: unknown key 'model.num_layer'; did you mean 'num_layers'?"
