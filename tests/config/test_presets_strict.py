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
            "overlap.overlap_grad_reduce: Input should be a valid boolean (got 'false')",
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
