"""What a plan is valid for: the fingerprint of a training run (model dimensions, parallel layout,
batch, overlap flags, cluster, world size, torch and megatron-core versions of the code actually
imported) and the run's number
of micro-batches per iteration, read from our arguments or from Megatron-Core's calculator.

A saved plan is reused only by a run with the same fingerprint (``engine.plan.Plan.fingerprint_mismatch``).
"""

from __future__ import annotations

import os
from typing import Any


def run_fingerprint(args: Any, *, backend: str, cluster: str) -> dict[str, Any]:
    """What a plan is valid for (module docstring), as a JSON-ready dict.

    Args:
        args: the run's parsed arguments (our ``pretrain_gpt.py``'s or Megatron-LM's).
        backend: ``nccl`` or ``gloo``.
        cluster: the cluster name the cost model uses.

    Returns:
        The model and layout values of ``args`` (``padded_vocab_size`` included, as the model was
        built; ``data_parallel_sharding_strategy`` with Megatron-FSDP, else None), plus ``world_size``, ``backend``, ``cluster``, ``torch`` (release, without a local
        suffix) and ``megatron_core`` (``lagom_megatron.megatron.versions.installed_megatron_core``).
    """
    import torch

    from lagom_megatron.megatron.versions import installed_megatron_core

    # the version of the megatron/core/package_info.py Python imports, not pip's metadata: a
    # Megatron-LM checkout on PYTHONPATH shadows a pip-installed megatron-core
    found = installed_megatron_core()
    mcore = found.version if found is not None else "unknown"
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "padded_vocab_size", "seq_length", "micro_batch_size", "global_batch_size",
            "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
            "data_parallel_size", "sequence_parallel", "num_experts", "overlap_grad_reduce",
            "overlap_param_gather", "use_distributed_optimizer", "ddp_bucket_size", "bf16", "fp16")
    fp: dict[str, Any] = {k: getattr(args, k, None) for k in keys}
    # Megatron-FSDP's strategy decides its sites (per-unit gathers, or per-bucket reductions only);
    # None (not stated) without Megatron-FSDP, where nothing reads it
    fp["data_parallel_sharding_strategy"] = (getattr(args, "data_parallel_sharding_strategy", None)
                                             if getattr(args, "use_megatron_fsdp", False) else None)
    fp.update(world_size=int(os.environ.get("WORLD_SIZE", "1")), backend=backend, cluster=cluster,
              torch=torch.__version__.split("+")[0], megatron_core=mcore)
    return fp


def num_microbatches(args: Any) -> int:
    """Micro-batches per iteration: ``args.num_microbatches`` (our pretrain_gpt.py), else Megatron-Core's
    calculator (a Megatron-LM checkout), else 1 (call streams are then not folded per micro-batch)."""
    n = getattr(args, "num_microbatches", None)
    if not n:
        try:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            n = get_num_microbatches()
        except (ImportError, AssertionError, AttributeError):
            n = 1
    return max(1, int(n))
