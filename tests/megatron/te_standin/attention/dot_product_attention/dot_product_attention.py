"""Stand-in of TE v2.18 ``dot_product_attention.py``: ``DotProductAttention`` reads ``self.cp_group``."""

import torch

from .context_parallel import AttnFuncWithCPAndKVP2P


class DotProductAttention(torch.nn.Module):
    """``cp_group`` / ``cp_global_ranks`` given at construction (mc0.16.1 passes ``pg_collection.cp``)."""

    def __init__(self, *, cp_group, cp_global_ranks, batch_p2p_comm=True, step_compute=lambda: None):
        super().__init__()
        self.cp_group, self.cp_global_ranks = cp_group, list(cp_global_ranks)
        self.batch_p2p_comm, self.step_compute = batch_p2p_comm, step_compute
        self.seen_groups = []

    def forward(self, q, kv):
        self.seen_groups.append(self.cp_group)
        return AttnFuncWithCPAndKVP2P.apply(q, kv, self.cp_group, self.cp_global_ranks, self.batch_p2p_comm,
                                            self.step_compute)
