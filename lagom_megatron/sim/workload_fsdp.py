"""Fully sharded data parallelism in the simulated iteration: Megatron-FSDP (``use_megatron_fsdp``, under
its ``data_parallel_sharding_strategy``) and torch FSDP2 (``use_torch_fsdp2``, which always shards
parameters: ``fully_shard`` with ``reshard_after_forward=True``).

**optim_grads_params** (ZeRO-3; FSDP2). Each transformer layer is one FSDP unit (the embedding joins the
first, the output layer the last). In **every micro-batch** (the parameters are freed after use, so
gradient accumulation does not save the gathers):

* forward: the unit's parameters are all-gathered before its layer runs, and the next unit's
  gather is launched before the current layer's compute (prefetch of one unit);
* backward: the parameters are gathered again (re-gather, last unit first, same prefetch), and
  each unit's gradients are reduce-scattered as soon as its backward ends;
* the reduce-scatters are waited at the end of the micro-batch's backward.

Sites: ``dp.param_all_gather[chunk0.bucket{u}]`` (forward and backward gathers of unit ``u``: same op,
bytes and communicator, so NCCL cannot tell them apart) and ``dp.grad_reduce_scatter[chunk0.bucket{u}]``;
units are numbered in backward order like DDP buckets.

**no_shard, optim, optim_grads**: Megatron-Core's adapter makes no FSDP units then
(``distributed/fsdp/mcore_fsdp_adapter.py:96-99`` of megatron-core 0.16.1; the same in 0.17.1 and
0.18.2), so Megatron-FSDP keeps the whole model on every rank in buckets of at least the DDP bucket
size, cut in ``named_parameters`` order (``megatron_fsdp/param_and_grad_buffer.py:1271-1414``;
:func:`root_buckets`), whose site tags are ``chunk0.root_bucket{j}`` in that order
(``megatron.sites.SiteRegistry.fsdp_bucket_tags``). What it issues (``megatron_fsdp.py`` of 0.16.1):

* no_shard: no parameter gathers (``:425-426``); each bucket's gradients all-reduced
  (``dp.grad_all_reduce``, ``param_and_grad_buffer.py:3224-3230``) in the **last** micro-batch only
  (``megatron_fsdp.py:270-273, 656-662``), when its last gradient is ready;
* optim: the same reductions as reduce-scatters (``dp.grad_reduce_scatter``,
  ``param_and_grad_buffer.py:3231-3249``), last micro-batch only; each bucket's updated parameters
  all-gathered **once per iteration** (``dp.param_all_gather``), in the first micro-batch's forward:
  nothing frees a bucket without units until ``finish_grad_sync`` resets the gather pipeline
  (``megatron_fsdp.py:1183-1209``), and every module's pre-forward hook gathers its bucket plus the
  next ones up to :data:`PREFETCH_ELEMENTS` (``param_and_grad_buffer.py:3447-3560``); the first window
  is launched by ``start_param_sync`` after the optimizer step (``megatron_fsdp.py:1102-1121``), i.e.
  at the start of the iteration here;
* optim_grads: those gathers, and reduce-scatters in **every** micro-batch (``megatron_fsdp.py:656-662``).

These per-iteration calls are those megatron-core's own ``MegatronFSDP`` makes on two gloo ranks
(``tests/megatron/test_coalesced_sites.py``), and :func:`root_buckets` those of its
``_get_parameter_groups`` on both A40 FSDP presets' models (``tests/sim/test_workload_fsdp.py``). The
reductions are launched after the backward of the layer holding a bucket's first tensor and waited in
``finish_grad_sync`` (``Workload.program``). Gathers and reductions go to one data-parallel
communicator, so they queue on one stream (a slow gather delays the reduction behind it). Not
modelled: the 1e9-element reduction queue that can make the compute stream wait
(``GradReducePipeline.wait_for_previous_grad_reduce``), per-tensor hooks (a layer waits for all its
buckets before its first kernel, and a bucket is reduced only after its first tensor's whole layer),
the padding of sharded buckets to a multiple of DP x the tensors' row size, expert parameters (their
own buckets, synced by the expert data-parallel group); pipeline or virtual-pipeline stages with FSDP
(refused in ``WorkloadShape.from_preset``).
"""

from __future__ import annotations

from typing import Any

from lagom_megatron.sim.program import Call, Program, elementwise, gemm

PREFETCH_ELEMENTS = 500_000_000
"""Elements Megatron-FSDP prefetches beyond the gathered buckets: ``suggested_AG_prefetch_size``, half of
``max(1e9, ...)`` without ``--suggested-communication-unit-size`` (megatron-core 0.16.1
``megatron_fsdp.py:374-399``; the same in 0.17.1 and 0.18.2)."""


def unit_params(w: Any) -> list[float]:
    """Parameters of each FSDP unit on this rank before sharding, indexed by local layer."""
    L = w.layers_per_chunk
    out = [w.layer_params() for _ in range(L)]
    out[0] += w.embedding_params()
    out[-1] += w.output_params()
    return out


def every_microbatch(w: Any, site_id: str) -> bool:
    """True when the FSDP site ``site_id`` is called in every micro-batch (module docstring), False
    when once per iteration (the gathers of optim / optim_grads, the reductions of no_shard / optim)."""
    if w.fsdp_sharding == "optim_grads_params":
        return True
    return w.fsdp_sharding == "optim_grads" and "grad_" in site_id


def fsdp_microbatch(w: Any, prog: Program, mb: int, last: bool = False) -> None:
    """Appends one micro-batch's forward and backward with the FSDP collectives of ``w.fsdp_sharding``
    (``last``: the iteration's last micro-batch, where no_shard and optim reduce)."""
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


def layer_tensors(w: Any) -> list[float]:
    """Elements of one layer's parameter tensors on this rank, in ``named_parameters`` order of
    megatron-core's GPT layer (the local spec; ``Attention.__init__`` builds ``linear_proj`` before
    ``SelfAttention`` builds ``linear_qkv``): input norm, output projection, QKV, pre-MLP norm, FC1, FC2,
    each weight followed by its bias when the model has them (norms: LayerNorm's). With experts the MLP
    is the router alone (expert weights are in buckets of their own, synced by the expert data-parallel
    group). Transformer Engine's layers put the input norm after the projection (fused into QKV): a cut
    can move by one norm (``hidden`` elements)."""
    h, tp, lb = w.hidden, w.tp, w.linear_bias
    norm = [h, h] if w.norm_bias else [h]
    qkv = (w.q_dim + 2 * w.kv_dim) / tp
    out = norm + [w.q_dim * h / tp] + ([h] if lb else []) + [h * qkv] + ([qkv] if lb else []) + norm
    if w.experts:
        return out + [h * w.experts]
    fc1 = (2 if w.swiglu else 1) * w.ffn / tp
    return out + [h * fc1] + ([fc1] if lb else []) + [h * w.ffn / tp] + ([h] if lb else [])


def root_buckets(w: Any) -> list[tuple[int, int, float]]:
    """Megatron-FSDP's buckets without FSDP units, by bucket id: (layer of the first tensor, layer of the
    last, elements).

    The tensors in ``named_parameters`` order (word and learned position embeddings as layer -1, each
    layer's :func:`layer_tensors`, the final norm and, untied, the output layer as layer ``L``) go into
    one bucket until it holds at least ``w.bucket_params``, and the rest into a last one (every tensor
    in one bucket without overlapped gradient reduction, where Megatron-LM sets no bucket size,
    ``training.py:1312-1322``); megatron-core 0.16.1 ``param_and_grad_buffer.py:1367-1414``. With
    ``--bf16`` every parameter is bf16 (Megatron-LM's ``Float16Module``), so one dtype group holds them all.
    """
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
        """The pre-forward hooks of ``layer``'s modules: gather its buckets and the prefetch window, wait."""
        mine = [j for j, (first, end, _) in enumerate(buckets) if first <= layer <= end]
        if w.fsdp_sharding == "no_shard" or mb > 0 or not mine:
            return
        window, j = 0.0, mine[-1] + 1
        while j < len(buckets) and window < PREFETCH_ELEMENTS:
            window += buckets[j][2]
            j += 1
        for b in range(mine[0], j):
            if b not in gathers:
                gathers[b] = prog.launch(Call(f"dp.param_all_gather[chunk0.root_bucket{b}]",
                                              w._coll("all_gather", buckets[b][2] * 2, g), g, mb))
        for b in mine:
            prog.wait(gathers[b])

    reduce_now = w.fsdp_sharding == "optim_grads" or last
    op, name = ("all_reduce", "grad_all_reduce") if w.fsdp_sharding == "no_shard" else ("reduce_scatter", "grad_reduce_scatter")

    def reduce(layer: int) -> None:
        """``layer``'s gradients are ready: reduce every bucket whose first tensor is there (it is complete)."""
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
