"""Fully sharded data parallelism in the simulated iteration: Megatron-FSDP and torch FSDP2
(ZeRO-3 semantics), selected by a preset's ``use_megatron_fsdp`` or ``use_torch_fsdp2``.

Each transformer layer is one FSDP unit (the embedding joins the first, the output layer the last).
In **every micro-batch** (the parameters are freed after use, so gradient accumulation does not
save the gathers; torch ``fully_shard`` with ``reshard_after_forward=True``, Megatron-FSDP's
``optim_grads_params`` sharding):

* forward: the unit's parameters are all-gathered before its layer runs, and the next unit's
  gather is launched before the current layer's compute (prefetch of one unit);
* backward: the parameters are gathered again (re-gather, last unit first, same prefetch), and
  each unit's gradients are reduce-scattered as soon as its backward ends;
* the reduce-scatters are waited at the end of the micro-batch's backward.

Gathers and reduce-scatters go to one data-parallel communicator, so they queue on one stream
(a slow gather delays the reduce-scatter behind it). Sites: ``dp.param_all_gather[chunk0.bucket{u}]``
(forward and backward gathers of unit ``u``: same op, bytes and communicator, so NCCL cannot tell
them apart) and ``dp.grad_reduce_scatter[chunk0.bucket{u}]``; units are numbered in backward
order like DDP buckets.

Not modelled (refused in ``WorkloadShape.from_preset``): pipeline or virtual-pipeline stages with
FSDP, FSDP beside the distributed optimizer's own overlap (they are exclusive in Megatron).
"""

from __future__ import annotations

from typing import Any

from lagom_megatron.sim.program import Call, Program, elementwise, gemm


def unit_params(w: Any) -> list[float]:
    """Parameters of each FSDP unit on this rank before sharding, indexed by local layer."""
    L = w.layers_per_chunk
    out = [w.layer_params() for _ in range(L)]
    out[0] += w.embedding_params()
    out[-1] += w.output_params()
    return out


def fsdp_microbatch(w: Any, prog: Program, mb: int) -> None:
    """Appends one micro-batch's forward and backward with FSDP gathers and reduce-scatters."""
    L = w.layers_per_chunk
    g = w.dp_group()
    params = unit_params(w)

    def ag(li: int) -> int:
        u = L - 1 - li  # numbered in backward order, like DDP buckets
        return prog.launch(Call(f"dp.param_all_gather[chunk0.bucket{u}]", w._coll("all_gather", params[li] * 2, g), g, mb))

    pending = ag(0)
    prog.kernel(elementwise("embedding", w.tokens * w.hidden * 2 * 2), mb)
    for li in range(L):
        prog.wait(pending)
        if li + 1 < L:
            pending = ag(li + 1)
        w._layer_forward(prog, 0, li, mb)
    T = w.tokens
    prog.kernel(gemm("output", T, w.vocab / w.tp, w.hidden, w._sms()), mb)
    prog.kernel(elementwise("cross_entropy", T * w.vocab / w.tp * 8), mb)
    pending = ag(L - 1)
    prog.kernel(gemm("output.dgrad", T, w.hidden, w.vocab / w.tp, w._sms()), mb)
    prog.kernel(gemm("output.wgrad", T, w.hidden, w.vocab / w.tp, w._sms()), mb)
    rs: list[int] = []
    for li in range(L - 1, -1, -1):
        prog.wait(pending)
        if li > 0:
            pending = ag(li - 1)
        w._layer_backward(prog, 0, li, mb)
        if li == 0:
            prog.kernel(elementwise("embedding.bwd", w.tokens * w.hidden * 2 * 3), mb)
        u = L - 1 - li
        rs.append(prog.launch(Call(f"dp.grad_reduce_scatter[chunk0.bucket{u}]",
                                   w._coll("reduce_scatter", params[li] * 4, g), g, mb)))
    for idx in rs:
        prog.wait(idx)
