"""Overlapped expert-parallel all-to-all (``overlap_moe_expert_parallel_comm``) in the simulated
iteration: Megatron-Core's combined 1F1B schedule without pipelining (megatron-core 0.16.1).

``forward_backward_no_pipelining`` hands the micro-batches to
``combined_1f1b_schedule_for_no_pipelining`` when the flag is set (pipeline_parallel/schedules.py:598-599).
That schedule runs the first micro-batch's forward alone, then, for each next micro-batch, its
forward together with the previous micro-batch's backward, then the last backward alone
(pipeline_parallel/combined_1f1b.py:51-108). Within one combined step, forward layer ``j`` is paired
with backward layer ``L-1-j`` (models/common/model_chunk_schedule_plan.py:473-484), and each pair
runs as ``TransformerLayerSchedulePlan.run`` orders it (same file, :215-254): on the communication
stream ``combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd``, on the compute stream
``attn_fwd | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | attn_bwd``. So:

* the backward combine all-to-all overlaps the forward attention,
* the forward dispatch overlaps the expert MLP's input-gradient GEMMs, the backward dispatch its
  weight-gradient GEMMs (both on the one expert-parallel communicator: they queue),
* the forward combine overlaps the backward attention.

The forward all-to-alls are the sites (``ep.dispatch_all_to_all[n]`` / ``ep.combine_all_to_all[n]``);
in the lone first forward and last backward they block as without the flag. Gradient buckets and
parameter gathers are those of the last backward and the first forward, as without the flag.

Refused (``WorkloadShape.from_preset``): the flag with pipeline or virtual stages (Megatron's
interleaved combined schedule is not modelled) or with FSDP.
"""

from __future__ import annotations

from typing import Any

from lagom_megatron.sim.program import Program, elementwise, gemm


def _kernels(w: Any, prog: Program, names: tuple[str, ...], mb: int) -> None:
    ks = {k.name: k for k in w._layer_fwd_kernels()}
    for n in names:
        prog.kernel(ks[n], mb)  # a backward GEMM costs its forward's (as ``Workload._layer_backward``)


def combined_step(w: Any, prog: Program, f_mb: int, b_mb: int) -> None:
    """Appends one combined step: micro-batch ``f_mb``'s forward with ``b_mb``'s backward (module
    docstring). Kernels and collectives are tagged with ``f_mb``, the step's micro-batch."""
    L = w.layers_per_chunk
    mb = f_mb
    prog.kernel(elementwise("embedding", w.tokens * w.hidden * 2 * 2), mb)
    T = w.tokens
    prog.kernel(gemm("output.dgrad", T, w.hidden, w.vocab / w.tp, w._sms()), mb)
    prog.kernel(gemm("output.wgrad", T, w.hidden, w.vocab / w.tp, w._sms()), mb)
    pending_cf = -1
    for j in range(L):
        bl = L - 1 - j
        cb = prog.launch(w.a2a_call(None, mb))             # combine backward of layer bl
        prog.wait(pending_cf)                              # forward layer j needs layer j-1's output
        w._attn_forward(prog, 0, j, mb)
        prog.wait(cb)
        df = prog.launch(w.a2a_call("dispatch_all_to_all", mb))
        _kernels(w, prog, ("fc2", "act", "fc1"), mb)     # expert MLP input gradients (mlp.backward)
        db = prog.launch(w.a2a_call(None, mb))             # dispatch backward, queued behind df
        _kernels(w, prog, ("fc2", "fc1"), mb)            # weight gradients (mlp.backward_dw)
        prog.wait(df)
        _kernels(w, prog, ("fc1", "act", "fc2"), mb)
        pending_cf = prog.launch(w.a2a_call("combine_all_to_all", mb))
        prog.wait(db)
        w._attn_backward(prog, 0, bl, mb)
        if bl == 0:
            prog.kernel(elementwise("embedding.bwd", w.tokens * w.hidden * 2 * 3), mb)
    prog.wait(pending_cf)
    prog.kernel(gemm("output", T, w.vocab / w.tp, w.hidden, w._sms()), mb)
    prog.kernel(elementwise("cross_entropy", T * w.vocab / w.tp * 8), mb)
