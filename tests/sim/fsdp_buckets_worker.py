"""Prints the buckets megatron-core's own Megatron-FSDP makes for GPT models without FSDP units
(``--data-parallel-sharding-strategy`` no_shard / optim / optim_grads), for ``test_workload_fsdp``.

    python -m tests.sim.fsdp_buckets_worker STORE_FILE '[{"num_layers": 2, ...}, ...]'

Each model is megatron-core's ``GPTModel`` (local layer spec, TP 1) built on the meta device in bf16
(Megatron-LM's ``Float16Module`` with ``--bf16``), grouped by ``_get_parameter_groups`` with the
``BucketingPolicy`` Megatron-FSDP uses without units (``megatron_fsdp.py:340-349``). Prints one JSON
list per model: the elements of each bucket, by bucket id.
"""

import json
import sys

import torch
import torch.distributed as dist


def main(store: str, models: list[dict]) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        BucketingPolicy,
        _get_parameter_groups,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    out = []
    for m in models:
        config = TransformerConfig(
            num_layers=m["num_layers"],
            hidden_size=m["hidden_size"],
            ffn_hidden_size=m["ffn_hidden_size"],
            num_attention_heads=m["num_attention_heads"],
            num_query_groups=m["num_query_groups"],
            gated_linear_unit=m["swiglu"],
            add_bias_linear=m["add_bias_linear"],
            normalization=m["normalization"],
            params_dtype=torch.bfloat16,
            bf16=True,
            use_cpu_initialization=True,
            perform_initialization=False,
        )
        with torch.device("meta"):
            model = GPTModel(
                config,
                get_gpt_layer_local_spec(normalization=m["normalization"]),
                vocab_size=m["vocab_size"],
                max_sequence_length=m["max_position_embeddings"],
                position_embedding_type=m["position_embedding_type"],
                share_embeddings_and_output_weights=m["tied"],
            ).bfloat16()
        policy = BucketingPolicy(
            suggested_bucket_size=m["bucket_size"], fsdp_unit_modules=[], data_parallel_sharding_strategy="optim"
        )
        groups, _, _ = _get_parameter_groups(model, policy, {})
        out.append([sum(p.numel() for p in g.params) for g in groups])
    print(json.dumps(out))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
