"""The iteration line carries Megatron-LM's fields, in its order, with its FLOPs count."""

import argparse
import math
import re

from lagom_megatron.training.loop import format_iteration_line, num_floating_point_operations, throughput_tflops_per_gpu


def _args(**kw):
    base = dict(
        num_layers=96,
        hidden_size=12288,
        ffn_hidden_size=4 * 12288,
        num_attention_heads=96,
        kv_channels=None,
        group_query_attention=False,
        num_query_groups=None,
        swiglu=False,
        num_experts=None,
        moe_router_topk=2,
        seq_length=2048,
        padded_vocab_size=51200,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_flops_match_the_closed_form_of_a_dense_gpt():
    # Megatron-LM's count for a dense GPT with causal attention: 72 B s l h^2 (1 + s/(12 h) + V/(12 l h))
    # (per layer 24 h^2 + 6 h s for attention, 48 h^2 for the MLP; 6 h V for the logits)
    a, b = _args(), 1536
    h, s, l, v = a.hidden_size, a.seq_length, a.num_layers, a.padded_vocab_size
    expected = 72 * b * s * l * h * h * (1 + s / (12 * h) + v / (12 * l * h))
    assert math.isclose(num_floating_point_operations(a, b), expected, rel_tol=1e-12)


def test_gqa_swiglu_and_experts_follow_megatron_terms():
    a = _args(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=8,
        seq_length=32,
        padded_vocab_size=128,
        group_query_attention=True,
        num_query_groups=2,
        swiglu=True,
    )
    h, s, kv, q, g = 64, 32, 8, 64, 16  # kv channels 64/8, query 8 x 8, key/value 2 x 8
    attn = 6 * (h * (q + 2 * g) + q * s + q * h)
    mlp = 6 * h * 256 * 3
    assert num_floating_point_operations(a, 4) == 4 * s * (2 * (attn + mlp) + 6 * h * 128)
    moe = _args(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=8,
        seq_length=32,
        padded_vocab_size=128,
        num_experts=8,
        moe_router_topk=2,
    )
    attn = 6 * (h * 3 * 64 + 64 * s + 64 * h)
    assert num_floating_point_operations(moe, 1) == s * (2 * (attn + 6 * h * 256 * 2 * 2) + 6 * h * 128)
    del kv


def test_line_has_megatron_fields_in_megatron_order():
    line = format_iteration_line(
        iteration=3,
        train_iters=10,
        consumed_samples=24,
        elapsed_ms=750.0,
        lr=3e-4,
        global_batch_size=8,
        loss=3.5,
        tokens_per_s=1000.0,
        grad_norm=0.5,
        tflops_per_gpu=throughput_tflops_per_gpu(3e12, 0.75, 4),
        loss_scale=1.0,
        skipped_iters=1,
        nan_iters=0,
    )
    fields = [f.split(":")[0].strip() for f in line.split("|")[1:-1]]
    assert fields == [
        "consumed samples",
        "elapsed time per iteration (ms)",
        "throughput per GPU (TFLOP/s/GPU)",
        "learning rate",
        "global batch size",
        "lm loss",
        "loss scale",
        "grad norm",
        "number of skipped iterations",
        "number of nan iterations",
        "tokens per second",
    ]
    assert "throughput per GPU (TFLOP/s/GPU): 1.0 |" in line  # 3e12 / (0.75 s x 1e12 x 4 GPUs)
    assert re.search(r"iteration +3/ +10 \|", line) and "number of skipped iterations:   1 |" in line
