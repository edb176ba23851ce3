"""Model FLOPs and TFLOP/s per GPU as Megatron-LM core_v0.16.1 ``megatron/training/training.py`` counts them
(``num_floating_point_operations``, lines 220-600, ``transformer_flops``: dense or MoE GPT, no MLA, MTP or Mamba;
throughput: lines 2019-2021)."""

from __future__ import annotations

import argparse


def num_floating_point_operations(args: argparse.Namespace, batch_size: int) -> float:
    """Forward + backward FLOPs of one iteration of ``batch_size`` sequences (Megatron-LM's count)."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    heads = args.num_attention_heads
    kv = getattr(args, "kv_channels", None) or h // heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) and args.num_query_groups else heads
    fwd_bwd, fma = 3, 2
    ffn_factor = 3 if getattr(args, "swiglu", False) else 2
    num_experts = getattr(args, "num_experts", None)
    if num_experts is None:
        dense_layers, moe_layers, routed_to = layers, 0, 0
    else:  # every layer is a MoE layer (our script has no --moe-layer-freq: Megatron's default 1)
        dense_layers, moe_layers, routed_to = 0, layers, args.moe_router_topk
    ffn = args.ffn_hidden_size
    moe_ffn = getattr(args, "moe_ffn_hidden_size", None) or ffn
    q_size, kv_size = kv * heads, kv * groups
    self_attn = fwd_bwd * fma * (
        h * (q_size + 2 * kv_size)       # QKV projection
        + q_size * s / 2 * 2             # QK^T and (QK^T)V, half of the causal mask
        + q_size * h                     # output projection
    )
    mlp = fwd_bwd * fma * h * (ffn * ffn_factor * dense_layers + moe_ffn * routed_to * ffn_factor * moe_layers)
    logits = fwd_bwd * fma * h * args.padded_vocab_size
    return float(batch_size * s * (mlp + self_attn * layers + logits))


def throughput_tflops_per_gpu(flops_per_iteration: float, seconds_per_iteration: float, world_size: int) -> float:
    """TFLOP/s per GPU (Megatron-LM's ``throughput per GPU (TFLOP/s/GPU)``); 0 for a zero time."""
    if seconds_per_iteration <= 0:
        return 0.0
    return flops_per_iteration / (seconds_per_iteration * 1e12 * world_size)
