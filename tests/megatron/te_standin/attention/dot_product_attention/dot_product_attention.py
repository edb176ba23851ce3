"""Stand-in of TE v2.18 ``dot_product_attention.py``: ``DotProductAttention`` reads ``self.cp_group``."""

import torch

from .context_parallel import AttnFuncWithCPAndKVP2P, AttnFuncWithCPAndQKVOA2A


class DotProductAttention(torch.nn.Module):
    """``cp_group`` / ``cp_global_ranks`` given at construction (mc0.16.1 passes ``pg_collection.cp``)."""

    def __init__(
        self, *, cp_group, cp_global_ranks, batch_p2p_comm=True, step_compute=lambda: None, cp_comm_type="p2p"
    ):
        super().__init__()
        self.cp_comm_type = cp_comm_type
        self.cp_group, self.cp_global_ranks = cp_group, list(cp_global_ranks)
        self.batch_p2p_comm, self.step_compute = batch_p2p_comm, step_compute
        self.seen_groups = []

    def forward(self, q, kv=None):
        self.seen_groups.append(self.cp_group)
        if self.cp_comm_type == "a2a":
            return AttnFuncWithCPAndQKVOA2A.apply(q, self.cp_group, self.step_compute)
        return AttnFuncWithCPAndKVP2P.apply(
            q, kv, self.cp_group, self.cp_global_ranks, self.batch_p2p_comm, self.step_compute
        )
