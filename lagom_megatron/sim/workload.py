"""One Megatron GPT iteration of the first TP rank of the first PP stage (it finishes backward last) as kernels and
collectives. Bubble: ``(pp - 1) (t_fwd + t_bwd) / v`` (Narayanan et al. 2021). Not modelled: expert-DP grad sync, TE
userbuffers beyond ``UB_SMS``, recompute, FP8."""

from __future__ import annotations

from dataclasses import dataclass, field

from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.sim.device import Collective, ComputeKernel, compute_time_us
from lagom_megatron.sim.program import Call, Program, elementwise, gemm
from lagom_megatron.sim.workload_fsdp import every_microbatch, fsdp_microbatch
from lagom_megatron.sim.workload_shape import WorkloadShape

MICROBATCH_CAP = 4
"""Micro-batches simulated explicitly; the rest copy the steady one."""
UB_SMS = 16
"""SMs userbuffers' TP overlap keeps when ``tp_comm_overlap`` is on."""
ADAM_BYTES_PER_PARAM = 28.0
"""HBM bytes per parameter of a distributed-optimizer Adam step (fp32 param, grad, m, v r/w; bf16 param w)."""


@dataclass(kw_only=True)
class Workload(WorkloadShape):
    _counters: dict = field(default_factory=dict, repr=False)

    def _stream_id(self, group: str, kind: str) -> str:
        """``{group}.{kind}[n]``: the n-th call of this stream in the micro-batch (as megatron/hooks/sites.py)."""
        key = (group, kind)
        n = self._counters.get(key, 0)
        self._counters[key] = n + 1
        return f"{group}.{kind}[{n}]"

    def _coll(self, op: str, nbytes: float, group: str) -> Collective:
        return Collective(
            op=op,
            nbytes=int(nbytes),
            group_size=self.sizes[group],
            n_nodes=self.nodes[group],
            stride=self.strides.get(group, 1),
        )

    def sites(self) -> list[CollectiveSite]:
        """The collective sites of one iteration with their calls per iteration."""
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
            out.append(
                CollectiveSite(
                    site_id=sid,
                    op=call.coll.op,
                    nbytes=call.coll.nbytes,
                    dtype=dtype,
                    group=call.stream,
                    group_size=call.coll.group_size,
                    n_nodes=call.coll.n_nodes,
                    calls_per_iter=max(1, n),
                    reduce_op=reduce_op,
                )
            )
        return out

    def program(self) -> Program:
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
            if self.ep_overlap and mb > 0:  # forward mb with backward mb-1
                combined_step(self, prog, mb)
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
        # finish_grad_sync, then the optimizer step
        for i, call in enumerate(prog.calls):
            if call.stream in ("dp", "dp_cp") and "grad" in (call.site_id or ""):
                prog.wait(i)
        params = (
            self.layer_params() * self.layers_per_chunk * self.chunks + self.output_params() + self.embedding_params()
        )
        shard = (
            params / (self.dp * self.cp)
            if (self.dist_opt or (self.fsdp and self.fsdp_sharding != "no_shard"))
            else params
        )
        prog.kernel(elementwise("optimizer.adam", shard * ADAM_BYTES_PER_PARAM), mbs - 1)
        if not (self.dist_opt and self.overlap_param) and self.dist_opt:
            for c in range(self.chunks):
                for b, _, p in buckets[c]:
                    prog.blocking(
                        Call(
                            f"dp.param_all_gather[chunk{c}.bucket{b}]",
                            self._coll("all_gather", p * 2, self.dp_group()),
                            self.dp_group(),
                            mbs - 1,
                        )
                    )
        return prog

    def bubble_us(self) -> float:
        """Pipeline bubble (us) from standalone kernel times."""
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
            ks += [
                gemm("router", T, self.experts, h),
                gemm("fc1", tt, self.ffn * (2 if self.swiglu else 1), h),
                elementwise("act", tt * self.ffn * 6),
                gemm("fc2", tt, h, self.ffn),
            ]
        else:
            up = 2 if self.swiglu else 1
            ks += [
                gemm("fc1", T, up * self.ffn / tp, h, sms),
                elementwise("act", T * self.ffn * 6 / tp),
                gemm("fc2", T, h, self.ffn / tp, sms),
            ]
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
                    if nxt and (c, nxt[0]) not in ag_idx:
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
        """An EP all-to-all of the layer's routed tokens; ``kind`` None: a backward one (not a site)."""
        a2a = self.tokens * self.topk * self.hidden * 2
        return Call(self._stream_id("ep", kind) if kind else None, self._coll("all_to_all", a2a, "ep"), "ep", mb)

    def _mlp_forward(self, prog: Program, mb: int) -> None:
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
        """Column-parallel backward: input all-gather beside dgrad, dgrad reduce-scatter / all-reduce beside wgrad."""
        dgrad = ComputeKernel(f"{module}.dgrad", k.kind, k.flops, k.hbm_bytes, k.max_sms)
        wgrad = ComputeKernel(f"{module}.wgrad", k.kind, k.flops, k.hbm_bytes, k.max_sms)
        nbytes = self.tokens * self.hidden * 2
        if self.tp > 1 and not self.tp_comm_overlap and self.sp:
            ag = prog.launch(
                Call(self._stream_id("tp", "sp_all_gather"), self._coll("all_gather", nbytes, "tp"), "tp", mb)
            )
            prog.kernel(dgrad, mb)
            prog.wait(ag)
            rs = prog.launch(
                Call(self._stream_id("tp", "sp_reduce_scatter"), self._coll("reduce_scatter", nbytes, "tp"), "tp", mb)
            )
            prog.kernel(wgrad, mb)
            prog.wait(rs)
        elif self.tp > 1 and not self.tp_comm_overlap:
            prog.kernel(dgrad, mb)
            ar = prog.launch(
                Call(self._stream_id("tp", "dgrad_all_reduce"), self._coll("all_reduce", nbytes, "tp"), "tp", mb)
            )
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
                op, name = (
                    ("reduce_scatter", "grad_reduce_scatter") if self.dist_opt else ("all_reduce", "grad_all_reduce")
                )
                prog.launch(Call(f"dp.{name}[chunk{c}.bucket{b}]", self._coll(op, p * 4, g), g, mb))
        if buckets is not None and not self.overlap_grad:
            for b, _, p in buckets:
                op, name = (
                    ("reduce_scatter", "grad_reduce_scatter") if self.dist_opt else ("all_reduce", "grad_all_reduce")
                )
                prog.blocking(Call(f"dp.{name}[chunk{c}.bucket{b}]", self._coll(op, p * 4, g), g, mb))
        if self.pp > 1 and c > 0:
            self._send(prog, "pp.send_recv", act_bytes, mb, pending_send)


def prog_microbatches(w: Workload) -> int:
    return min(w.microbatches, MICROBATCH_CAP)


def steady_copies(w: Workload) -> int:
    """Steady micro-batches not simulated, added as copies of micro-batch 1."""
    return w.microbatches - prog_microbatches(w)


def _kernels(w: Workload, prog: Program, names: tuple[str, ...], mb: int) -> None:
    ks = {k.name: k for k in w._layer_fwd_kernels()}
    for n in names:
        prog.kernel(ks[n], mb)  # a backward GEMM costs its forward's (as ``Workload._layer_backward``)


def combined_step(w: Workload, prog: Program, mb: int) -> None:
    """Micro-batch ``mb``'s forward with ``mb - 1``'s backward, Megatron-Core 0.16.1's combined 1F1B
    (pipeline_parallel/schedules.py:598-599, combined_1f1b.py:51-108): forward layer j with backward L-1-j
    (models/common/model_chunk_schedule_plan.py:473-484) as ``TransformerLayerSchedulePlan.run`` (:215-254): comm
    ``combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd``, compute ``attn_fwd | mlp_bwd -> mlp_bwd_dw ->
    mlp_fwd | attn_bwd``; the forward all-to-alls are the sites."""
    L = w.layers_per_chunk
    prog.kernel(elementwise("embedding", w.tokens * w.hidden * 2 * 2), mb)
    T = w.tokens
    prog.kernel(gemm("output.dgrad", T, w.hidden, w.vocab / w.tp, w._sms()), mb)
    prog.kernel(gemm("output.wgrad", T, w.hidden, w.vocab / w.tp, w._sms()), mb)
    pending_cf = -1
    for j in range(L):
        bl = L - 1 - j
        cb = prog.launch(w.a2a_call(None, mb))  # combine backward of layer bl
        prog.wait(pending_cf)  # forward layer j needs layer j-1's output
        w._attn_forward(prog, 0, j, mb)
        prog.wait(cb)
        df = prog.launch(w.a2a_call("dispatch_all_to_all", mb))
        _kernels(w, prog, ("fc2", "act", "fc1"), mb)  # expert MLP input gradients (mlp.backward)
        db = prog.launch(w.a2a_call(None, mb))  # dispatch backward, queued behind df
        _kernels(w, prog, ("fc2", "fc1"), mb)  # weight gradients (mlp.backward_dw)
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
