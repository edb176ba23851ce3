"""What a plan is valid for: a training run's fingerprint, and its micro-batches per iteration."""

from __future__ import annotations

import os
from typing import Any


def run_fingerprint(args: Any, *, backend: str, cluster: str) -> dict[str, Any]:
    """The model and layout values of ``args`` plus world size, backend, cluster, torch and megatron-core
    versions, as a JSON-ready dict."""
    import torch

    from lagom_megatron.megatron.versions import installed_megatron_core

    # the version Python imports, not pip's: a Megatron-LM checkout on PYTHONPATH shadows megatron-core
    found = installed_megatron_core()
    mcore = found.version if found is not None else "unknown"
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "padded_vocab_size", "seq_length", "micro_batch_size", "global_batch_size",
            "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
            "data_parallel_size", "sequence_parallel", "num_experts", "overlap_grad_reduce",
            "overlap_param_gather", "use_distributed_optimizer", "ddp_bucket_size", "bf16", "fp16")
    fp: dict[str, Any] = {k: getattr(args, k, None) for k in keys}
    # Megatron-FSDP's strategy decides its sites; None without Megatron-FSDP
    fp["data_parallel_sharding_strategy"] = (getattr(args, "data_parallel_sharding_strategy", None)
                                             if getattr(args, "use_megatron_fsdp", False) else None)
    fp.update(world_size=int(os.environ.get("WORLD_SIZE", "1")), backend=backend, cluster=cluster,
              torch=torch.__version__.split("+")[0], megatron_core=mcore)
    return fp


def num_microbatches(args: Any) -> int:
    """Micro-batches per iteration: ``args.num_microbatches``, else Megatron-Core's calculator, else 1."""
    n = getattr(args, "num_microbatches", None)
    if not n:
        try:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            n = get_num_microbatches()
        except (ImportError, AssertionError, AttributeError):
            n = 1
    return max(1, int(n))
