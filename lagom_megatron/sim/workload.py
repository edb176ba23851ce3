"""Workload model: one training iteration of a Megatron GPT on one representative rank, as the
kernels and collectives Megatron-Core issues, in issue order.

The per-rank quantities it starts from (dimensions, layout, groups, parameter counts, DDP buckets)
are ``WorkloadShape`` (``lagom_megatron.sim.workload_shape``); this module builds the program.

What is simulated (and what is not):

* **One representative rank**: the first tensor-parallel rank of the first pipeline stage. It
  finishes its backward last, so its data-parallel communication sets the end of the iteration,
  and it is the only stage where Megatron's DDP splits gradients into buckets (``pp_rank > 0``
  and virtual chunks after the first use one bucket; megatron-core ``DistributedDataParallel``
  and Megatron-LM's ``disable_bucketing=(model_chunk_idx > 0)``). Every stage runs the same
  layers (the output layer's cost is added when PP is 1 only), so its timeline stands for the
  iteration; the 1F1B / interleaved pipeline bubble is added as idle time
  ``(pp - 1) * (t_fwd + t_bwd) / v`` per iteration, from the kernels' standalone times (Megatron's
  schedule analysis; Narayanan et al. 2021). A 64-GPU preset is therefore one rank's timeline, not
  64, which is what makes ``lagom simulate`` fast.
* **Micro-batches**: the first ``MICROBATCH_CAP`` are simulated; the steady micro-batches beyond
  them are added as copies of the second one (their kernels and tensor/pipeline/context-parallel
  collectives are identical), so that a 128-micro-batch iteration costs 4 micro-batches.
* **Order**: forward then backward per micro-batch, chunks in order (virtual stages), backward in
  reverse; gradient reduce-scatter (or all-reduce) of a DDP bucket is launched when the last layer
  of the bucket finishes its backward in the last micro-batch; parameter all-gathers run in the
  first micro-batch's forward, each bucket prefetching the next, as Megatron's DDP does.
* **Streams**: one compute stream and one communication stream per process group.
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (the preset's env) makes kernels start in issue order
  (``lagom_megatron.sim.timeline``).

Sites carry the ids, ops, bytes, dtypes and groups the real hooks report
(``lagom_megatron.megatron.sites``): ``dp.grad_reduce_scatter[chunk{c}.bucket{b}]``
(``dp.grad_all_reduce`` without the distributed optimizer; fp32 gradient buffer),
``dp.param_all_gather[chunk{c}.bucket{b}]`` (bf16 parameters), the backward tensor-parallel
streams ``tp.sp_all_gather[n]`` / ``tp.sp_reduce_scatter[n]`` / ``tp.dgrad_all_reduce[n]``
(n = call order within a micro-batch), one ``pp.send_recv`` site per pipeline (op ``send``),
the MoE dispatcher's forward ``ep.dispatch_all_to_all[n]`` / ``ep.combine_all_to_all[n]``, and
``cp.ring_exchange[layer{l}]`` (context-parallel ring attention, which the real hooks do not
report yet). Group names dp, dp_cp, tp, pp, ep, cp; ``dp_cp`` only with context parallelism.
Collectives the hooks do not see (the forward sequence-parallel all-gather / reduce-scatter, the
MoE all-to-alls of the backward pass) run under NCCL defaults and are not sites.

Not modelled: expert-parameter gradient sync when the expert data-parallel size exceeds 1,
Transformer Engine userbuffers beyond a fixed SM reservation (``tp_comm_overlap``), activation
recomputation, FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.sim.device import Collective, ComputeKernel, compute_time_us
from lagom_megatron.sim.program import Call, Program, elementwise, gemm
from lagom_megatron.sim.workload_ep_overlap import combined_step
from lagom_megatron.sim.workload_fsdp import every_microbatch, fsdp_microbatch
from lagom_megatron.sim.workload_shape import WorkloadShape

MICROBATCH_CAP = 4
"""Micro-batches simulated explicitly; the rest are copies of the steady one (module docstring)."""
UB_SMS = 16
"""SMs that userbuffers' TP overlap keeps for itself when ``tp_comm_overlap`` is on."""
ADAM_BYTES_PER_PARAM = 28.0
"""HBM bytes per parameter of a distributed-optimizer Adam step (fp32 param, grad, m, v read and
written, bf16 param written)."""


@dataclass(kw_only=True)
class Workload(WorkloadShape):
    """A preset turned into per-rank quantities; ``program()`` builds one iteration.

    Raises (``from_preset``):
        ValueError: a layout that does not divide (names the sizes), or a CPU cluster.
    """

    _counters: dict = field(default_factory=dict, repr=False)

    def _stream_id(self, group: str, kind: str) -> str:
        """``{group}.{kind}[n]``: the n-th call of this stream in the current micro-batch, the way the
        real hooks number call streams without a structural index (megatron/sites.py)."""
        key = (group, kind)
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        return f"{group}.{kind}[{n}]"

    def _coll(self, op: str, nbytes: float, group: str) -> Collective:
        return Collective(op=op, nbytes=int(nbytes), group_size=self.sizes[group], n_nodes=self.nodes[group],
                          stride=self.strides.get(group, 1))

    # ------------------------------------------------------------------ sites

    def sites(self) -> list[CollectiveSite]:
        """The collective sites of one iteration, with their calls per iteration."""
        prog = self.program()
        counts: dict[str, int] = {}
        first: dict[str, Call] = {}
        for c in prog.calls:
            if c.site_id is None:
                continue
            counts[c.site_id] = counts.get(c.site_id, 0) + 1
            first.setdefault(c.site_id, c)
        scale = self.microbatches / prog_microbatches(self)
        out = []
        for sid, call in first.items():
            n = counts[sid]
            if not sid.startswith("dp.") or (self.fsdp and every_microbatch(self, sid)):
                n = int(round(n * scale))
            dtype = "float32" if "grad_" in sid and sid.startswith("dp.") else "bfloat16"
            # Megatron-Core sums (ReduceOp.SUM) unless --ddp-average-in-collective, which no preset sets
            reduce_op = "sum" if call.coll.op in ("all_reduce", "reduce_scatter") else None
            out.append(CollectiveSite(site_id=sid, op=call.coll.op, nbytes=call.coll.nbytes, dtype=dtype,
                                      group=call.stream, group_size=call.coll.group_size,
                                      n_nodes=call.coll.n_nodes, calls_per_iter=max(1, n), reduce_op=reduce_op))
        return out

    # ------------------------------------------------------------------ program

    def program(self) -> Program:
        """One iteration of the representative rank (module docstring), ``prog_microbatches`` of them."""
        prog = Program()
        mbs = prog_microbatches(self)
        buckets = self.buckets()
        ag_done: set[tuple[int, int]] = set()
        ag_idx: dict[tuple[int, int], int] = {}
        pending_send: dict[str, int] = {}
        for mb in range(mbs):
            self._counters = {}
            prog.mb_start_op[mb] = len(prog.ops)
            if mb == mbs - 1 and self.pp > 1:
                prog.ops.append(("I", self.bubble_us(), mb))
            if self.fsdp:
                fsdp_microbatch(self, prog, mb, mb == mbs - 1)
                continue
            if self.ep_overlap and mb > 0:  # forward mb with backward mb-1 (sim.workload_ep_overlap)
                combined_step(self, prog, mb, mb - 1)
                if mb == mbs - 1:
                    self._backward_chunk(prog, 0, mb, buckets[0], pending_send)
                continue
            for c in range(self.chunks):
                if mb == 0 and self.dist_opt and self.overlap_param:
                    self._forward_chunk(prog, c, mb, buckets[c], ag_idx, ag_done, pending_send)
                else:
                    self._forward_chunk(prog, c, mb, None, ag_idx, ag_done, pending_send)
            if self.ep_overlap and mb < mbs - 1:
                continue  # its backward runs in the next combined step
            for c in reversed(range(self.chunks)):
                self._backward_chunk(prog, c, mb, buckets[c] if mb == mbs - 1 else None, pending_send)
        for idx in pending_send.values():
            prog.wait(idx)
        # finish_grad_sync: wait for every bucket, then the optimizer step
        for i, call in enumerate(prog.calls):
            if call.stream in ("dp", "dp_cp") and "grad" in (call.site_id or ""):
                prog.wait(i)
        params = self.layer_params() * self.layers_per_chunk * self.chunks + self.output_params() + self.embedding_params()
        shard = params / (self.dp * self.cp) if (self.dist_opt or (self.fsdp and self.fsdp_sharding != "no_shard")) else params
        prog.kernel(elementwise("optimizer.adam", shard * ADAM_BYTES_PER_PARAM), mbs - 1)
        if not (self.dist_opt and self.overlap_param) and self.dist_opt:
            for c in range(self.chunks):
                for b, _, p in buckets[c]:
                    prog.blocking(Call(f"dp.param_all_gather[chunk{c}.bucket{b}]", self._coll("all_gather", p * 2, self.dp_group()), self.dp_group(), mbs - 1))
        return prog

    def bubble_us(self) -> float:
        """Pipeline bubble per iteration: (pp - 1) * (t_fwd + t_bwd) of one chunk, standalone times."""
        f = sum(compute_time_us(self.gpu, k) for k in self._layer_fwd_kernels()) * self.layers_per_chunk
        return (self.pp - 1) * 3.0 * f

    def _sms(self) -> int | None:
        return self.gpu.sms - UB_SMS if self.tp_comm_overlap else None

    def _layer_fwd_kernels(self) -> list[ComputeKernel]:
        T, h, tp, q, kv = self.tokens, self.hidden, self.tp, self.q_dim, self.kv_dim
        sms = self._sms()
        ks = [
            elementwise("norm1", 4 * T * h / (tp if self.sp else 1), "norm"),
            gemm("qkv", T, (q + 2 * kv) / tp, h, sms),
            ComputeKernel("attention", "attention", 2.0 * T * self.seq * q / tp, 2.0 * T * (2 * q + 2 * kv) / tp),
            gemm("proj", T, h, q / tp, sms),
            elementwise("norm2", 6 * T * h / (tp if self.sp else 1), "norm"),
        ]
        if self.experts:
            tt = T * self.topk
            ks += [gemm("router", T, self.experts, h), gemm("fc1", tt, self.ffn * (2 if self.swiglu else 1), h),
                   elementwise("act", tt * self.ffn * 6), gemm("fc2", tt, h, self.ffn)]
        else:
            up = 2 if self.swiglu else 1
            ks += [gemm("fc1", T, up * self.ffn / tp, h, sms), elementwise("act", T * self.ffn * 6 / tp),
                   gemm("fc2", T, h, self.ffn / tp, sms)]
        return ks

    def _tp_fwd(self, prog: Program, mb: int, op: str) -> None:
        if self.tp > 1 and not self.tp_comm_overlap:
            nbytes = self.tokens * self.hidden * 2
            prog.blocking(Call(None, self._coll(op if self.sp else "all_reduce", nbytes, "tp"), "tp", mb))

    def _forward_chunk(self, prog, c, mb, buckets, ag_idx, ag_done, pending_send) -> None:
        act_bytes = self.tokens * self.hidden * 2 / (self.tp if self.sp else 1)
        if self.pp > 1 and c > 0:
            prog.blocking(Call("pp.send_recv", self._coll("send", act_bytes, "pp"), "pp", mb))
        if c == 0:
            prog.kernel(elementwise("embedding", self.tokens * self.hidden * 2 * 2), mb)
        fwd_bucket_order = list(reversed(buckets)) if buckets else []
        layer_to_bucket = {li: b for b, lis, _ in (buckets or []) for li in lis}
        for li in range(self.layers_per_chunk):
            if buckets is not None:
                b = layer_to_bucket[li]
                if (c, b) not in ag_done:
                    if (c, b) not in ag_idx:
                        ag_idx[(c, b)] = prog.launch(self._ag_call(c, b, buckets, mb))
                    prog.wait(ag_idx[(c, b)])
                    ag_done.add((c, b))
                    nxt = [bb for bb, _, _ in fwd_bucket_order if bb < b]
                    if nxt and (c, nxt[0]) not in ag_idx:  # prefetch the next bucket
                        ag_idx[(c, nxt[0])] = prog.launch(self._ag_call(c, nxt[0], buckets, mb))
            self._layer_forward(prog, c, li, mb)
        if self.pp > 1:
            self._send(prog, "pp.send_recv", act_bytes, mb, pending_send)
        elif c == self.chunks - 1:
            T = self.tokens
            prog.kernel(gemm("output", T, self.vocab / self.tp, self.hidden, self._sms()), mb)
            prog.kernel(elementwise("cross_entropy", T * self.vocab / self.tp * 8), mb)

    def _ag_call(self, c, b, buckets, mb) -> Call:
        p = next(p for bb, _, p in buckets if bb == b)
        g = self.dp_group()
        return Call(f"dp.param_all_gather[chunk{c}.bucket{b}]", self._coll("all_gather", p * 2, g), g, mb)

    def _send(self, prog, sid, nbytes, mb, pending_send) -> None:
        if "pp" in pending_send:
            prog.wait(pending_send.pop("pp"))
        idx = prog.launch(Call(sid, self._coll("send", nbytes, "pp"), "pp", mb))
        if self.overlap_p2p:
            pending_send["pp"] = idx
        else:
            prog.wait(idx)

    def _layer_forward(self, prog: Program, c: int, li: int, mb: int) -> None:
        self._attn_forward(prog, c, li, mb)
        self._mlp_forward(prog, mb)

    def _attn_forward(self, prog: Program, c: int, li: int, mb: int) -> None:
        """Attention part of a layer's forward, up to the second norm (and the router)."""
        ks = {k.name: k for k in self._layer_fwd_kernels()}
        layer = self.global_layer(c, li)
        prog.kernel(ks["norm1"], mb)
        self._tp_fwd(prog, mb, "all_gather")
        prog.kernel(ks["qkv"], mb)
        if self.cp > 1:
            kv_bytes = 2 * self.tokens * self.kv_dim / self.tp * 2 * (self.cp - 1)
            idx = prog.launch(Call(f"cp.ring_exchange[layer{layer}]", self._coll("send", kv_bytes, "cp"), "cp", mb))
            prog.kernel(ks["attention"], mb)
            prog.wait(idx)
        else:
            prog.kernel(ks["attention"], mb)
        prog.kernel(ks["proj"], mb)
        self._tp_fwd(prog, mb, "reduce_scatter")
        prog.kernel(ks["norm2"], mb)
        if self.experts:
            prog.kernel(ks["router"], mb)

    def a2a_call(self, kind: str | None, mb: int) -> Call:
        """An expert-parallel all-to-all of the layer's routed tokens; ``kind`` None = a backward
        one (not a site), else the forward site stream ``dispatch_all_to_all`` / ``combine_all_to_all``."""
        a2a = self.tokens * self.topk * self.hidden * 2
        return Call(self._stream_id("ep", kind) if kind else None, self._coll("all_to_all", a2a, "ep"), "ep", mb)

    def _mlp_forward(self, prog: Program, mb: int) -> None:
        """MLP part of a layer's forward (experts: dispatch, expert MLP, combine, blocking)."""
        ks = {k.name: k for k in self._layer_fwd_kernels()}
        if self.experts:
            prog.blocking(self.a2a_call("dispatch_all_to_all", mb))
            for n in ("fc1", "act", "fc2"):
                prog.kernel(ks[n], mb)
            prog.blocking(self.a2a_call("combine_all_to_all", mb))
        else:
            self._tp_fwd(prog, mb, "all_gather")
            for n in ("fc1", "act", "fc2"):
                prog.kernel(ks[n], mb)
            self._tp_fwd(prog, mb, "reduce_scatter")

    def _column_backward(self, prog: Program, k: ComputeKernel, layer: int, module: str, mb: int) -> None:
        """Backward of a column-parallel linear: Megatron overlaps the input all-gather (for wgrad)
        with the dgrad GEMM and the dgrad reduce-scatter (or all-reduce) with the wgrad GEMM."""
        dgrad = ComputeKernel(f"{module}.dgrad", k.kind, k.flops, k.hbm_bytes, k.max_sms)
        wgrad = ComputeKernel(f"{module}.wgrad", k.kind, k.flops, k.hbm_bytes, k.max_sms)
        nbytes = self.tokens * self.hidden * 2
        if self.tp > 1 and not self.tp_comm_overlap and self.sp:
            ag = prog.launch(Call(self._stream_id("tp", "sp_all_gather"), self._coll("all_gather", nbytes, "tp"), "tp", mb))
            prog.kernel(dgrad, mb)
            prog.wait(ag)
            rs = prog.launch(Call(self._stream_id("tp", "sp_reduce_scatter"), self._coll("reduce_scatter", nbytes, "tp"), "tp", mb))
            prog.kernel(wgrad, mb)
            prog.wait(rs)
        elif self.tp > 1 and not self.tp_comm_overlap:
            prog.kernel(dgrad, mb)
            ar = prog.launch(Call(self._stream_id("tp", "dgrad_all_reduce"), self._coll("all_reduce", nbytes, "tp"), "tp", mb))
            prog.kernel(wgrad, mb)
            prog.wait(ar)
        else:
            prog.kernel(dgrad, mb)
            prog.kernel(wgrad, mb)

    def _layer_backward(self, prog: Program, c: int, li: int, mb: int) -> None:
        ks = {k.name: k for k in self._layer_fwd_kernels()}
        if self.experts:
            prog.blocking(self.a2a_call(None, mb))
            for n in ("fc2", "fc1"):
                prog.kernel(ks[n], mb)
                prog.kernel(ks[n], mb)
            prog.kernel(ks["act"], mb)
            prog.blocking(self.a2a_call(None, mb))
        self._attn_backward(prog, c, li, mb)

    def _attn_backward(self, prog: Program, c: int, li: int, mb: int) -> None:
        """A layer's backward after the expert MLP (router on) or, dense, all of it."""
        ks = {k.name: k for k in self._layer_fwd_kernels()}
        layer = self.global_layer(c, li)
        if self.experts:
            prog.kernel(ks["router"], mb)
        else:
            self._tp_fwd(prog, mb, "all_gather")
            prog.kernel(ks["fc2"], mb)
            prog.kernel(ks["fc2"], mb)
            prog.kernel(ks["act"], mb)
            self._column_backward(prog, ks["fc1"], layer, "fc1", mb)
        prog.kernel(ks["norm2"], mb)
        self._tp_fwd(prog, mb, "all_gather")
        prog.kernel(ks["proj"], mb)
        prog.kernel(ks["proj"], mb)
        att = ks["attention"]
        att_b = ComputeKernel("attention.bwd", att.kind, att.flops * 2.5, att.hbm_bytes * 2)
        if self.cp > 1:
            kv_bytes = 2 * self.tokens * self.kv_dim / self.tp * 2 * (self.cp - 1) * 2
            idx = prog.launch(Call(f"cp.ring_exchange[layer{layer}]", self._coll("send", kv_bytes, "cp"), "cp", mb))
            prog.kernel(att_b, mb)
            prog.wait(idx)
        else:
            prog.kernel(att_b, mb)
        self._column_backward(prog, ks["qkv"], layer, "qkv", mb)
        prog.kernel(ks["norm1"], mb)

    def _backward_chunk(self, prog, c, mb, buckets, pending_send) -> None:
        g = self.dp_group()
        act_bytes = self.tokens * self.hidden * 2 / (self.tp if self.sp else 1)
        if self.pp > 1:
            prog.blocking(Call("pp.send_recv", self._coll("send", act_bytes, "pp"), "pp", mb))
        elif c == self.chunks - 1:
            prog.kernel(gemm("output.dgrad", self.tokens, self.hidden, self.vocab / self.tp, self._sms()), mb)
            prog.kernel(gemm("output.wgrad", self.tokens, self.hidden, self.vocab / self.tp, self._sms()), mb)
        last_layer_of = {lis[-1]: (b, p) for b, lis, p in (buckets or [])}
        for li in range(self.layers_per_chunk - 1, -1, -1):
            self._layer_backward(prog, c, li, mb)
            if c == 0 and li == 0:
                prog.kernel(elementwise("embedding.bwd", self.tokens * self.hidden * 2 * 3), mb)
            if buckets is not None and self.overlap_grad and li in last_layer_of:
                b, p = last_layer_of[li]
                op, name = ("reduce_scatter", "grad_reduce_scatter") if self.dist_opt else ("all_reduce", "grad_all_reduce")
                prog.launch(Call(f"dp.{name}[chunk{c}.bucket{b}]", self._coll(op, p * 4, g), g, mb))
        if buckets is not None and not self.overlap_grad:
            for b, _, p in buckets:
                op, name = ("reduce_scatter", "grad_reduce_scatter") if self.dist_opt else ("all_reduce", "grad_all_reduce")
                prog.blocking(Call(f"dp.{name}[chunk{c}.bucket{b}]", self._coll(op, p * 4, g), g, mb))
        if self.pp > 1 and c > 0:
            self._send(prog, "pp.send_recv", act_bytes, mb, pending_send)


def prog_microbatches(w: Workload) -> int:
    """Micro-batches simulated explicitly (``MICROBATCH_CAP`` at most)."""
    return min(w.microbatches, MICROBATCH_CAP)


def steady_copies(w: Workload) -> int:
    """Steady micro-batches not simulated, added as copies of micro-batch 1."""
    return w.microbatches - prog_microbatches(w)


def fwd_flops(w: Workload) -> float:
    """Forward FLOPs of one micro-batch on this rank (for reports: MFU-style sanity checks)."""
    return sum(k.flops for k in w._layer_fwd_kernels()) * w.layers_per_chunk * w.chunks
