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


def flash_attn_a2a_communicate(a2a_inputs, cp_group, step_compute):
    """All-to-all of each input (``:387-536``): posted ``async_op=True`` one after the other, each
    waited after the next is posted (TE waits on ``cp_stream``); returns the outputs."""
    a2a_inputs = [a2a_inputs] if not isinstance(a2a_inputs, list) else a2a_inputs
    outputs, reqs = [None] * len(a2a_inputs), [None] * len(a2a_inputs)
    for i in range(len(a2a_inputs) + 2):
        if 0 < i < len(a2a_inputs) + 1:
            outputs[i - 1] = torch.empty_like(a2a_inputs[i - 1])
            reqs[i - 1] = torch.distributed.all_to_all_single(
                outputs[i - 1], a2a_inputs[i - 1], group=cp_group, async_op=True
            )
            step_compute()
        if i > 1:
            reqs[i - 2].wait()
    return outputs[0] if len(a2a_inputs) == 1 else outputs


class AttnFuncWithCPAndQKVOA2A(torch.autograd.Function):
    """All-to-all context parallelism (``:4168``): q to heads before attention, the output back after;
    the same two in backward on ``ctx.cp_group``. The stand-in's "attention" doubles its input, so
    with two ranks (all-to-all twice is the identity) ``out = 2 q`` and ``dq = 2 dout``."""

    @staticmethod
    def forward(ctx, q, cp_group, step_compute):
        ctx.cp_group, ctx.step_compute = cp_group, step_compute
        heads = flash_attn_a2a_communicate([q.contiguous()], cp_group, step_compute)
        return flash_attn_a2a_communicate([heads * 2.0], cp_group, step_compute)

    @staticmethod
    def backward(ctx, dout):
        heads = flash_attn_a2a_communicate([dout.contiguous()], ctx.cp_group, ctx.step_compute)
        return flash_attn_a2a_communicate([heads * 2.0], ctx.cp_group, ctx.step_compute), None, None
