"""``overlap_moe_expert_parallel_comm``: Megatron-Core 0.16.1's combined 1F1B schedule without pipelining.

pipeline_parallel/schedules.py:598-599, combined_1f1b.py:51-108; forward layer j pairs with backward L-1-j
(models/common/model_chunk_schedule_plan.py:473-484), run as ``TransformerLayerSchedulePlan.run`` (:215-254):
comm ``combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd``, compute ``attn_fwd | mlp_bwd -> mlp_bwd_dw ->
mlp_fwd | attn_bwd``. The forward all-to-alls are the sites. Refused with PP, virtual stages or FSDP.
"""

from __future__ import annotations

from typing import Any

from lagom_megatron.sim.program import Program, elementwise, gemm


def _kernels(w: Any, prog: Program, names: tuple[str, ...], mb: int) -> None:
    ks = {k.name: k for k in w._layer_fwd_kernels()}
    for n in names:
        prog.kernel(ks[n], mb)  # a backward GEMM costs its forward's (as ``Workload._layer_backward``)


def combined_step(w: Any, prog: Program, f_mb: int, b_mb: int) -> None:
    """Appends micro-batch ``f_mb``'s forward combined with ``b_mb``'s backward, tagged ``f_mb``."""
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
