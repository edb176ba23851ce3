"""Pre-flight rules for MoE overlap and uneven pipelines; line numbers: megatron-core 0.16.1
``megatron/core/transformer/transformer_config.py``, Megatron-LM core_v0.16.1 ``megatron/training/arguments.py``."""

from __future__ import annotations

from lagom_megatron.training.preflight_types import Finding, RunShape


def _vpp(s: RunShape) -> bool:
    """An interleaved (virtual) pipeline is asked for (arguments.py:520-557)."""
    per = s.get("num_layers_per_virtual_pipeline_stage")
    n = s.get("num_virtual_stages_per_pipeline_rank")
    if n is not None:
        return int(n) > 1
    if per is not None and s.get("num_layers") is not None and s.pp > 0:
        return (int(s.get("num_layers")) // s.pp) // max(int(per), 1) > 1
    return bool(s.get("pipeline_model_parallel_layout"))


def rule_moe_overlap(s: RunShape) -> list[Finding]:
    """``--overlap-moe-expert-parallel-comm``: the asserts of transformer_config.py:1852-1892, before the
    process groups exist."""
    if not s.get("overlap_moe_expert_parallel_comm", False):
        return []
    flag = "--overlap-moe-expert-parallel-comm"
    why = "megatron-core 0.16.1 asserts it in TransformerConfig.__post_init__ (transformer_config.py:1852-1892)"
    problems = []
    if s.get("num_experts") is None:
        problems.append((f"{flag} is set but the model has no experts (--num-experts unset)",
                         "add --num-experts and --expert-model-parallel-size > 1, or drop the flag"))
    if s.ep <= 1:
        problems.append((f"{flag} needs --expert-model-parallel-size > 1; got {s.ep}",
                         "use expert parallelism (EP > 1) or drop the flag"))
    dispatcher = s.get("moe_token_dispatcher_type", "allgather")
    if dispatcher not in ("alltoall", "flex"):
        problems.append((f"{flag} needs --moe-token-dispatcher-type alltoall or flex; got {dispatcher!r}",
                         "pass --moe-token-dispatcher-type alltoall"))
    if s.get("moe_shared_expert_overlap", False):
        problems.append((f"{flag} cannot be combined with --moe-shared-expert-overlap",
                         "drop one of the two"))
    if not (s.get("bf16", False) or s.get("fp16", False)):
        problems.append((f"{flag} needs --bf16 or --fp16 (the model is fp32)", "add --bf16"))
    if s.get("recompute_granularity") == "full" or s.get("recompute_method") is not None \
            or s.get("recompute_num_layers") is not None:
        problems.append((f"{flag} cannot be combined with full recomputation (--recompute-granularity full, "
                         "--recompute-method, --recompute-num-layers)", "drop the recomputation flags"))
    if s.pp > 1 and not _vpp(s):
        problems.append((f"{flag} with --pipeline-model-parallel-size {s.pp} needs a virtual pipeline",
                         "add --num-virtual-stages-per-pipeline-rank N (N > 1)"))
    return [Finding("error", "moe-overlap", what, why, fix) for what, fix in problems]


def rule_uneven_pipeline(s: RunShape) -> list[Finding]:
    """``--decoder-first/last-pipeline-num-layers``: megatron-core's uneven split (transformer_config.py:1359-1430;
    arguments.py:530)."""
    first, last = s.get("decoder_first_pipeline_num_layers"), s.get("decoder_last_pipeline_num_layers")
    if first is None and last is None:
        return []
    layers = s.get("num_layers")
    why = "megatron-core splits the layers so (transformer_config.py:1359-1430)"
    out = []
    if s.get("num_layers_per_virtual_pipeline_stage") is not None:
        out.append(Finding("error", "uneven-pipeline",
                           "--decoder-first/last-pipeline-num-layers cannot be used with "
                           "--num-layers-per-virtual-pipeline-stage",
                           "Megatron-LM asserts it (arguments.py:530)",
                           "give the virtual pipeline as --num-virtual-stages-per-pipeline-rank"))
        return out
    if layers is None:
        return out
    remaining, stages = int(layers), s.pp
    vpp = s.get("num_virtual_stages_per_pipeline_rank")
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is None:
            continue
        if vpp is not None and int(vpp) > 1 and int(n) % int(vpp):
            out.append(Finding("error", "uneven-pipeline",
                               f"{flag} {n} is not divisible by --num-virtual-stages-per-pipeline-rank {vpp}",
                               why, f"use a multiple of {vpp}"))
        remaining -= int(n)
        stages -= 1
    if stages < 0 or remaining < 0 or bool(remaining) != bool(stages):
        out.append(Finding(
            "error", "uneven-pipeline",
            f"--num-layers {layers} with --pipeline-model-parallel-size {s.pp}, first stage {first}, last stage "
            f"{last} leaves {remaining} layers for {max(stages, 0)} middle stages",
            why, "the middle stages need layers if and only if there are middle stages: change the first/last "
                 "stage layers or PP"))
    elif stages and remaining % stages:
        out.append(Finding(
            "error", "uneven-pipeline",
            f"the {remaining} middle layers (--num-layers {layers} less first {first} and last {last}) are not "
            f"divisible by the {stages} middle pipeline stages", why,
            "change the first/last stage layers so the rest splits evenly"))
    return out
