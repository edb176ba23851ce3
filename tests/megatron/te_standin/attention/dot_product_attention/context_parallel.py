"""Stand-in of TE v2.18 ``attention/dot_product_attention/context_parallel.py``: the KV ring."""

import torch


def flash_attn_p2p_communicate(rank, send_tensor, send_dst, recv_tensor, recv_src, cp_group, batch_p2p_comm):
    """One ring step: send to ``send_dst``, receive from ``recv_src`` (global ranks), ``:96-135``."""
    send_recv_ops = []
    if batch_p2p_comm:
        send_op = torch.distributed.P2POp(torch.distributed.isend, send_tensor, send_dst, cp_group)
        recv_op = torch.distributed.P2POp(torch.distributed.irecv, recv_tensor, recv_src, cp_group)
        send_recv_ops = [send_op, recv_op] if rank % 2 == 0 else [recv_op, send_op]
        return torch.distributed.batch_isend_irecv(send_recv_ops)
    if rank % 2 == 0:
        send_recv_ops.append(torch.distributed.isend(send_tensor, send_dst, cp_group))
        send_recv_ops.append(torch.distributed.irecv(recv_tensor, recv_src, cp_group))
    else:
        send_recv_ops.append(torch.distributed.irecv(recv_tensor, recv_src, cp_group))
        send_recv_ops.append(torch.distributed.isend(send_tensor, send_dst, cp_group))
    return send_recv_ops


def _ring(q, kv, cp_group, cp_global_ranks, batch_p2p_comm, step_compute):
    """``sum_j q * kv_j`` over the ring: step ``i`` posts the exchange of the next KV block, then
    computes on the current one, and waits the posted requests at the start of step ``i + 1``."""
    rank = torch.distributed.get_rank(cp_group)
    size = len(cp_global_ranks)
    send_dst = cp_global_ranks[(rank + 1) % size]
    recv_src = cp_global_ranks[(rank - 1) % size]
    out = torch.zeros_like(q)
    reqs = []
    current = kv.contiguous()
    for i in range(size):
        for req in reqs:
            req.wait()
        if i + 1 < size:
            nxt = torch.empty_like(current)
            reqs = flash_attn_p2p_communicate(rank, current, send_dst, nxt, recv_src, cp_group, batch_p2p_comm)
        else:
            nxt, reqs = None, []
        step_compute()
        out = out + q * current
        if nxt is not None:
            current = nxt
    return out


class AttnFuncWithCPAndKVP2P(torch.autograd.Function):
    """Ring attention (``:1356-2720``): ``cp_group`` kept on ``ctx`` for the backward ring."""

    @staticmethod
    def forward(ctx, q, kv, cp_group, cp_global_ranks, batch_p2p_comm, step_compute):
        ctx.cp_group, ctx.cp_global_ranks = cp_group, cp_global_ranks
        ctx.batch_p2p_comm, ctx.step_compute = batch_p2p_comm, step_compute
        ctx.save_for_backward(kv)
        return _ring(q, kv, cp_group, cp_global_ranks, batch_p2p_comm, step_compute)

    @staticmethod
    def backward(ctx, dout):
        (kv,) = ctx.saved_tensors
        # dq = sum_j kv_j * dout: the same ring over the KV blocks, on ctx.cp_group
        dq = _ring(dout, kv, ctx.cp_group, ctx.cp_global_ranks, ctx.batch_p2p_comm, ctx.step_compute)
        return dq, None, None, None, None, None
