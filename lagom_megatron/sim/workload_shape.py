"""``WorkloadShape``: a preset's per-rank dimensions, layout, groups, overlap flags and DDP buckets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from lagom_megatron.sim.device import Gpu
from lagom_megatron.sim.program import group_nodes


@dataclass(kw_only=True)
class WorkloadShape:
    """A preset's per-rank quantities; ``from_preset``: ValueError for a bad layout or an unmodelled flag."""

    name: str
    gpu: Gpu
    layers_per_chunk: int
    chunks: int
    pp: int
    tp: int
    cp: int
    dp: int
    ep: int
    sp: bool
    microbatches: int
    tokens: int
    """Per micro-batch on this rank's sequence shard."""
    seq: int
    hidden: int
    ffn: int
    q_dim: int
    kv_dim: int
    vocab: int
    swiglu: bool
    experts: int
    topk: int
    dist_opt: bool
    overlap_grad: bool
    overlap_param: bool
    overlap_p2p: bool
    tp_comm_overlap: bool
    fsdp: bool
    fsdp_sharding: str = "optim_grads_params"
    """FSDP2: always optim_grads_params."""
    tied_embeddings: bool = False
    position_params: float = 0.0
    """Elements of a learned absolute position embedding (not split over TP)."""
    linear_bias: bool = True
    norm_bias: bool = True
    ep_overlap: bool = False
    cdmc1: bool
    bucket_params: int
    nodes: dict[str, int]
    sizes: dict[str, int]
    strides: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_preset(cls, preset: Any, gpu: Gpu) -> Self:
        m = preset.model_spec()
        p, t, o = preset.parallel, preset.training, preset.overlap
        tp, pp, cp, ep = (
            p.tensor_model_parallel_size,
            p.pipeline_model_parallel_size,
            p.context_parallel_size,
            p.expert_model_parallel_size,
        )
        world = preset.world_size
        if world % (tp * pp * cp):
            raise ValueError(f"world_size ({world}) must be a multiple of TP*PP*CP ({tp}*{pp}*{cp})")
        dp = world // (tp * pp * cp)
        chunks = getattr(p, "num_virtual_stages_per_pipeline_rank", None) or 1
        if p.num_layers_per_virtual_pipeline_stage:
            chunks = m.num_layers // (pp * p.num_layers_per_virtual_pipeline_stage)
        if m.num_layers % (pp * chunks):
            raise ValueError(f"num_layers ({m.num_layers}) must divide into PP*virtual stages ({pp}*{chunks})")
        gbs = t.global_batch_size or t.micro_batch_size * dp
        if gbs % (t.micro_batch_size * dp):
            raise ValueError(
                f"global_batch_size ({gbs}) must be a multiple of micro_batch_size*DP ({t.micro_batch_size}*{dp})"
            )
        heads = m.num_attention_heads
        head_dim = getattr(m, "kv_channels", None) or m.hidden_size // heads
        groups = m.num_query_groups or heads
        experts = m.num_experts or 0
        ffn = (
            (getattr(m, "moe_ffn_hidden_size", None) or m.ffn_hidden_size or 4 * m.hidden_size)
            if experts
            else (m.ffn_hidden_size or 4 * m.hidden_size)
        )
        gpn = gpu.gpus_per_node
        sizes = {"tp": tp, "cp": cp, "dp": dp, "dp_cp": dp * cp, "pp": pp, "ep": ep}
        strides = {"tp": 1, "cp": tp, "dp": tp * cp, "dp_cp": tp, "pp": tp * cp * dp, "ep": tp * cp}
        nodes = {
            "tp": group_nodes(stride=1, size=tp, gpus_per_node=gpn),
            "cp": group_nodes(stride=tp, size=cp, gpus_per_node=gpn),
            "dp": group_nodes(stride=tp * cp, size=dp, gpus_per_node=gpn),
            "dp_cp": group_nodes(stride=tp, size=dp * cp, gpus_per_node=gpn),
            "pp": group_nodes(stride=tp * cp * dp, size=min(pp, 2), gpus_per_node=gpn),
            "ep": group_nodes(stride=tp * cp, size=ep, gpus_per_node=gpn),
        }
        fsdp = bool(o.use_megatron_fsdp or o.use_torch_fsdp2)
        refused = {
            "overlap_moe_expert_parallel_comm with PP, virtual stages or FSDP": (
                o.overlap_moe_expert_parallel_comm and (pp > 1 or chunks > 1 or fsdp),
                "the combined 1F1B all-to-all overlap is modelled without pipelining only",
            ),
            "overlap_moe_expert_parallel_comm without experts and EP > 1": (
                o.overlap_moe_expert_parallel_comm and (experts == 0 or ep < 2),
                "Megatron-Core asserts expert_model_parallel_size > 1 for it",
            ),
            "overlap_param_gather_with_optimizer_step": (
                o.overlap_param_gather_with_optimizer_step,
                "the simulator does not model the gather inside the optimizer step",
            ),
            "use_megatron_fsdp / use_torch_fsdp2 with PP or virtual stages": (
                fsdp and (pp > 1 or chunks > 1),
                "FSDP is modelled with one pipeline stage only",
            ),
            "use_torch_fsdp2 with use_distributed_optimizer": (
                o.use_torch_fsdp2 and o.use_distributed_optimizer,
                "Megatron-LM asserts it (core_v0.16.1 megatron/training/arguments.py:612-613)",
            ),
            "moe_token_dispatcher_type other than alltoall": (
                experts > 0 and (getattr(m, "moe_token_dispatcher_type", None) or "alltoall") != "alltoall",
                "only the all-to-all dispatcher is modelled",
            ),
            "expert_tensor_parallel_size > 1": (
                (getattr(p, "expert_tensor_parallel_size", None) or 1) > 1 and experts > 0,
                "expert tensor parallelism is not modelled",
            ),
        }
        bad = [f"{k} ({why})" for k, (on, why) in refused.items() if on]
        if bad:
            raise ValueError(f"preset {preset.name!r} sets what the simulator cannot model: {'; '.join(bad)}")
        bucket = o.ddp_bucket_size or max(40_000_000, 1_000_000 * dp * cp)
        return cls(
            name=preset.name or "preset",
            gpu=gpu,
            layers_per_chunk=m.num_layers // (pp * chunks),
            chunks=chunks,
            pp=pp,
            tp=tp,
            cp=cp,
            dp=dp,
            ep=ep,
            sp=bool(p.sequence_parallel and tp > 1),
            microbatches=gbs // (t.micro_batch_size * dp),
            tokens=t.micro_batch_size * t.seq_length // cp,
            seq=t.seq_length,
            hidden=m.hidden_size,
            ffn=ffn,
            q_dim=heads * head_dim,
            kv_dim=groups * head_dim,
            vocab=m.vocab_size or 50304,
            swiglu=m.swiglu,
            experts=experts,
            topk=m.moe_router_topk or 1,
            # Megatron-FSDP issues the dist. optimizer's collectives (distrib_optimizer.py:2440-2443, 2609-2611 @0.16.1)
            dist_opt=o.use_distributed_optimizer and not fsdp,
            overlap_grad=o.overlap_grad_reduce,
            overlap_param=o.overlap_param_gather,
            fsdp_sharding=o.data_parallel_sharding_strategy if o.use_megatron_fsdp else "optim_grads_params",
            tied_embeddings=not m.untie_embeddings_and_output_weights,
            position_params=float((m.max_position_embeddings or t.seq_length) * m.hidden_size)
            if m.position_embedding_type == "learned_absolute"
            else 0.0,
            linear_bias=m.add_bias_linear,
            norm_bias=m.normalization == "LayerNorm",
            overlap_p2p=o.overlap_p2p_comm,
            tp_comm_overlap=o.tp_comm_overlap and tp > 1,
            fsdp=fsdp,
            ep_overlap=bool(o.overlap_moe_expert_parallel_comm),
            cdmc1=str(preset.env.get("CUDA_DEVICE_MAX_CONNECTIONS", "")) == "1",
            bucket_params=int(bucket),
            nodes=nodes,
            sizes=sizes,
            strides=strides,
        )

    def layer_params(self) -> float:
        h, tp = self.hidden, self.tp
        attn = h * (self.q_dim + 2 * self.kv_dim) / tp + self.q_dim * h / tp
        up = 2 if self.swiglu else 1
        mlp = (up + 1) * h * self.ffn / tp
        if self.experts:
            return attn + h * self.experts  # expert weights are synced by the expert-DP group (1 here)
        return attn + mlp

    def output_params(self) -> float:
        """Output-layer parameters here (PP 1 only: else on the last stage)."""
        return self.vocab * self.hidden / self.tp if self.pp == 1 else 0.0

    def embedding_params(self) -> float:
        return self.vocab * self.hidden / self.tp

    def global_layer(self, chunk: int, i: int) -> int:
        """Megatron's layer numbering (0-based) on the first pipeline stage."""
        return chunk * self.pp * self.layers_per_chunk + i

    def buckets(self) -> list[list[tuple[int, list[int], float]]]:
        """Per chunk: (bucket id, local layer indices, params) in backward order; past chunk 0 one bucket each
        (Megatron-LM ``disable_bucketing=(model_chunk_idx > 0)``)."""
        out = []
        for c in range(self.chunks):
            order = list(range(self.layers_per_chunk - 1, -1, -1))
            acc = self.output_params() if c == self.chunks - 1 else 0.0
            limit = self.bucket_params if (c == 0 and self.overlap_grad) else float("inf")
            cur: list[int] = []
            bks = []
            for li in order:
                cur.append(li)
                acc += self.layer_params() + (self.embedding_params() if (c == 0 and li == 0) else 0.0)
                if acc >= limit:
                    bks.append((len(bks), cur, acc))
                    cur, acc = [], 0.0
            if cur:
                bks.append((len(bks), cur, acc))
            out.append(bks)
        return out

    def dp_group(self) -> str:
        return "dp_cp" if self.cp > 1 else "dp"
