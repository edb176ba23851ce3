"""Simulated FSDP (megatron-core 0.16.1; same in 0.17.1, 0.18.2). optim_grads_params (ZeRO-3; FSDP2): a unit
per layer gathered before forward and backward (one-unit prefetch), reduce-scattered after backward each micro-batch.
Others: no units (``mcore_fsdp_adapter.py:96-99``), ``root_buckets`` (``param_and_grad_buffer.py:1271-1414``); no_shard:
no gathers (``megatron_fsdp.py:425-426``), all-reduce (``param_and_grad_buffer.py:3224-3230``) in the last micro-batch
(``megatron_fsdp.py:270-273, 656-662``); optim: reduce-scatter (``:3231-3249``) likewise, gathers once in the first
forward (``megatron_fsdp.py:1183-1209, 1102-1121``; prefetch ``param_and_grad_buffer.py:3447-3560``); optim_grads: RS
every micro-batch. Not modelled: wait_for_previous_grad_reduce, per-tensor hooks, shard padding, expert parameters."""

from __future__ import annotations

from typing import Any

from lagom_megatron.sim.program import Call, Program, elementwise, gemm

PREFETCH_ELEMENTS = 500_000_000
"""``suggested_AG_prefetch_size`` default (megatron-core 0.16.1 ``megatron_fsdp.py:374-399``; also 0.17.1, 0.18.2)."""


def unit_params(w: Any) -> list[float]:
    """Parameters of each FSDP unit on this rank before sharding, by local layer."""
    L = w.layers_per_chunk
    out = [w.layer_params() for _ in range(L)]
    out[0] += w.embedding_params()
    out[-1] += w.output_params()
    return out


def every_microbatch(w: Any, site_id: str) -> bool:
    """Whether FSDP site ``site_id`` runs every micro-batch (else once per iteration)."""
    if w.fsdp_sharding == "optim_grads_params":
        return True
    return w.fsdp_sharding == "optim_grads" and "grad_" in site_id


def fsdp_microbatch(w: Any, prog: Program, mb: int, last: bool = False) -> None:
    """Appends one micro-batch with the FSDP collectives of ``w.fsdp_sharding`` (``last``: the iteration's last)."""
    if w.fsdp_sharding == "optim_grads_params":
        _sharded_params_microbatch(w, prog, mb)
    else:
        _unsharded_params_microbatch(w, prog, mb, last)


def _sharded_params_microbatch(w: Any, prog: Program, mb: int) -> None:
    L = w.layers_per_chunk
    g = w.dp_group()
    params = unit_params(w)

    def ag(li: int) -> int:
        u = L - 1 - li  # numbered in backward order, like DDP buckets
        return prog.launch(
            Call(f"dp.param_all_gather[chunk0.bucket{u}]", w._coll("all_gather", params[li] * 2, g), g, mb)
        )

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
        rs.append(
            prog.launch(
                Call(f"dp.grad_reduce_scatter[chunk0.bucket{u}]", w._coll("reduce_scatter", params[li] * 4, g), g, mb)
            )
        )
    for idx in rs:
        prog.wait(idx)


def layer_tensors(w: Any) -> list[float]:
    """Elements of one layer's tensors here in ``named_parameters`` order (local spec; experts: router only; with
    TE a cut can shift by one norm)."""
    h, tp, lb = w.hidden, w.tp, w.linear_bias
    norm = [h, h] if w.norm_bias else [h]
    qkv = (w.q_dim + 2 * w.kv_dim) / tp
    out = norm + [w.q_dim * h / tp] + ([h] if lb else []) + [h * qkv] + ([qkv] if lb else []) + norm
    if w.experts:
        return out + [h * w.experts]
    fc1 = (2 if w.swiglu else 1) * w.ffn / tp
    return out + [h * fc1] + ([fc1] if lb else []) + [h * w.ffn / tp] + ([h] if lb else [])


def root_buckets(w: Any) -> list[tuple[int, int, float]]:
    """Megatron-FSDP's buckets without units, (first layer, last layer, elements), filled to ``w.bucket_params``
    (``param_and_grad_buffer.py:1367-1414``); one without overlapped grad reduce (Megatron-LM training.py:1312-1322)."""
    L, h = w.layers_per_chunk, w.hidden
    tensors = [(-1, w.embedding_params())] + ([(-1, w.position_params)] if w.position_params else [])
    tensors += [(li, n) for li in range(L) for n in layer_tensors(w)]
    tensors += [(L, n) for n in ([h, h] if w.norm_bias else [h])]
    if not w.tied_embeddings:
        tensors.append((L, w.output_params()))
    limit = w.bucket_params if w.overlap_grad else float("inf")
    out: list[tuple[int, int, float]] = []
    first, acc = None, 0.0
    for layer, n in tensors:
        first = layer if first is None else first
        acc += n
        if acc >= limit:
            out.append((first, layer, acc))
            first, acc = None, 0.0
    if first is not None:
        out.append((first, tensors[-1][0], acc))
    return out


def _unsharded_params_microbatch(w: Any, prog: Program, mb: int, last: bool) -> None:
    L, g, T = w.layers_per_chunk, w.dp_group(), w.tokens
    buckets = root_buckets(w)
    gathers: dict[int, int] = {}

    def need(layer: int) -> None:
        mine = [j for j, (first, end, _) in enumerate(buckets) if first <= layer <= end]
        if w.fsdp_sharding == "no_shard" or mb > 0 or not mine:
            return
        window, j = 0.0, mine[-1] + 1
        while j < len(buckets) and window < PREFETCH_ELEMENTS:
            window += buckets[j][2]
            j += 1
        for b in range(mine[0], j):
            if b not in gathers:
                gathers[b] = prog.launch(
                    Call(
                        f"dp.param_all_gather[chunk0.root_bucket{b}]",
                        w._coll("all_gather", buckets[b][2] * 2, g),
                        g,
                        mb,
                    )
                )
        for b in mine:
            prog.wait(gathers[b])

    reduce_now = w.fsdp_sharding == "optim_grads" or last
    op, name = (
        ("all_reduce", "grad_all_reduce")
        if w.fsdp_sharding == "no_shard"
        else ("reduce_scatter", "grad_reduce_scatter")
    )

    def reduce(layer: int) -> None:
        for j, (first, _, n) in enumerate(buckets):
            if reduce_now and first == layer:
                prog.launch(Call(f"dp.{name}[chunk0.root_bucket{j}]", w._coll(op, n * 4, g), g, mb))

    need(-1)
    prog.kernel(elementwise("embedding", T * w.hidden * 2 * 2), mb)
    for li in range(L):
        need(li)
        w._layer_forward(prog, 0, li, mb)
    need(L)
    prog.kernel(gemm("output", T, w.vocab / w.tp, w.hidden, w._sms()), mb)
    prog.kernel(elementwise("cross_entropy", T * w.vocab / w.tp * 8), mb)
    prog.kernel(gemm("output.dgrad", T, w.hidden, w.vocab / w.tp, w._sms()), mb)
    prog.kernel(gemm("output.wgrad", T, w.hidden, w.vocab / w.tp, w._sms()), mb)
    reduce(L)
    for li in range(L - 1, -1, -1):
        w._layer_backward(prog, 0, li, mb)
        reduce(li)
    prog.kernel(elementwise("embedding.bwd", T * w.hidden * 2 * 3), mb)
    reduce(-1)
