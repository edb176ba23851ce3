"""Site router: what every patched collective call does: its site (``sites.SiteRegistry``), pool entry and chunking
(``comm_pool.CommPool``), timing (``profiler.Profiler``); mixins ``router_p2p``, ``router_coalesced``, ``router_fsdp``.
Never changes which tensors move, their order or the bucket layout; a one-rank group is never a site."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.megatron.hooks.profiler import Profiler
from lagom_megatron.megatron.hooks.router_coalesced import CoalescedRouting
from lagom_megatron.megatron.hooks.router_fsdp import FsdpRouting
from lagom_megatron.megatron.hooks.router_p2p import P2PRouting
from lagom_megatron.megatron.hooks.sites import (
    ONE_RANK,
    GroupInfo,
    NamedSite,
    SiteRegistry,
    Stream,
    bucket_parts,
    bucket_reduce_op,
    bucket_registration,
    call_reduce_op,
    dtype_name,
    grad_all_to_all,
    tensor_nbytes,
)
from lagom_megatron.megatron.pool.comm_pool import CommPool
from lagom_megatron.megatron.pool.first_use import FirstUse
from lagom_megatron.megatron.pool.gloo import GlooRecord, chunked_call

# index of ``group`` in the wrapped functions' args (the same in the *_tensor and *_single forms, torch 2.4-2.13)
GROUP_ARG = {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 3, "all_to_all": 4}
_TENSOR_ARG = {
    "all_reduce": ("tensor", 0),
    "all_gather": ("output_tensor", 0),
    "reduce_scatter": ("input", 1),
    "all_to_all": ("input", 1),
}
_ASYNC_KIND = {
    ("tp", "all_gather"): "sp_all_gather",
    ("tp", "reduce_scatter"): "sp_reduce_scatter",
    ("tp", "all_reduce"): "dgrad_all_reduce",
    ("cp", "all_to_all"): "a2a",
}


def coalesce_state() -> dict:
    """torch's open ``_coalescing_manager`` s (group -> queued calls): a call on a group in it keeps that group
    (``distributed_c10d.py`` 2.6 ``:3789,4227,2797``, 2.13 ``:4378,4928,3236``, 2.14 ``:5152,5908,3897``); made in
    ``_World.__init__`` (``:598``, ``:685``, ``:1234``) for ``_world`` (``:713``, ``:805``, ``:1356``), only mutated."""
    from torch.distributed import distributed_c10d as c10d

    state = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    return state if isinstance(state, dict) else {}


def _arg(args: tuple, kwargs: dict, name: str, index: int, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


class _StreamCall:
    __slots__ = ("info", "stream", "site_id", "tname", "tindex", "chunkable")

    def __init__(
        self, info: GroupInfo, stream: Stream | NamedSite, tensor_arg: tuple[str, int], chunkable: bool
    ) -> None:
        self.info = info
        self.stream = stream
        self.site_id = stream.site_id if isinstance(stream, NamedSite) else None
        self.tname, self.tindex = tensor_arg
        self.chunkable = chunkable


_NO_ROUTE: tuple[CommConfig | None, Any, int] = (None, None, 0)


class SiteRouter(P2PRouting, CoalescedRouting, FsdpRouting):
    """Per-rank routing state shared by all patched entry points; ``pool`` None never reroutes, ``clock`` in seconds."""

    def __init__(
        self,
        registry: SiteRegistry,
        profiler: Profiler,
        pool: CommPool | None = None,
        *,
        split_chunks: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.registry = registry
        self.split_chunks = split_chunks
        """Split tensors by ``chunk_size`` (gloo); on NCCL the chunk size is the tuner plugin's per-call knob."""
        self.profiler = profiler
        self.pool = pool
        self.clock = clock
        self.assignment: dict[str, CommConfig] = {}
        self.active = True
        self.calls_routed = 0
        self._scope: tuple[str, Any] | None = None
        self._routes: dict[str, tuple[CommConfig | None, Any, int]] = {}
        self._buckets: dict[tuple[int, str, bool], tuple[str, str, int, str, GroupInfo]] = {}
        self._streams: dict[tuple[int, str, Any], _StreamCall] = {}
        self._p2p_sites: dict[int, tuple[str, GroupInfo]] = {}
        self._p2p_world: Any = None
        self._coalesce_state = coalesce_state()
        self._mfsdp: dict[int, Any] = {}
        self.first_use = FirstUse(self._coalesce_state)
        self.observe = GlooRecord() if split_chunks else None
        self._pieces: list[int] | None = None

    def set_assignment(self, assignment: dict[str, CommConfig]) -> None:
        """Site id -> config for the coming iteration (missing = defaults)."""
        assignment = {k: v for k, v in assignment.items() if not v.is_default()}
        if assignment != self.assignment:
            self.assignment = assignment
            self._routes = {}

    def _resolve(self, site_id: str, info: GroupInfo) -> tuple[CommConfig | None, Any, int]:
        cfg = self.assignment.get(site_id)
        if cfg is None:
            route = _NO_ROUTE
        else:
            group = self.pool.group_for(info, cfg) if self.pool is not None else None
            chunk = int(cfg.chunk_size) if cfg.chunk_size and self.split_chunks else 0
            route = (cfg, group, chunk)
        self._routes[site_id] = route
        return route

    def _route(self, site_id: str, info: GroupInfo) -> tuple[CommConfig | None, Any, int]:
        route = self._routes.get(site_id) or self._resolve(site_id, info)
        if route[0] is not None:
            self.calls_routed += 1
        return route

    def bucket_sync(self, bucket_group: Any, kind: str, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``start_grad_sync`` (kind ``grad``) or ``start_param_sync`` (kind ``param``) of a bucket group."""
        tag = self.registry.bucket_tag(bucket_group) if self.active else None
        if tag is None:
            return orig(bucket_group, *args, **kwargs)
        handle_attr = "grad_reduce_handle" if kind == "grad" else "param_gather_handle"
        if kind == "grad":
            force_all_reduce = bool(_arg(args, kwargs, "force_all_reduce", 0, False))
            if bucket_group.is_first_batch and bucket_group.grad_reduce_handle is not None:
                return orig(bucket_group, *args, **kwargs)  # Megatron's own no-op path
        elif _arg(args, kwargs, "force_sync", 0, False) and bucket_group.param_gather_handle is not None:
            return orig(bucket_group, *args, **kwargs)  # only waits for the outstanding gather
        distopt = bucket_group.ddp_config.use_distributed_optimizer
        if kind == "param" and not distopt:
            # the layer-wise optimizer (core_v0.19.0 param_and_grad_buffer.py:404-473): param_data is None, torch's
            # all_gather of uneven grad_data slices becomes grouped send/recv (:409-412): no NCCL all-gather to tune
            return orig(bucket_group, *args, **kwargs)
        attr = "intra_distributed_optimizer_instance_group" if distopt else "data_parallel_group"
        group = getattr(bucket_group, attr)
        rs = kind == "grad" and distopt and not force_all_reduce
        a2a = rs and grad_all_to_all(bucket_group)
        key = (id(bucket_group), kind, rs, a2a)
        known = self._buckets.get(key)
        if known is None:  # bucket layout and buffers are fixed after DDP construction: describe them once
            info = self.registry.groups.lookup(group)
            if info.size < 2:
                known = ONE_RANK
            elif kind == "grad":
                op, name = ("reduce_scatter", "grad_reduce_scatter") if rs else ("all_reduce", "grad_all_reduce")
                if a2a:  # the input's bytes, summed locally after the call: no reduction in NCCL
                    op, name = "all_to_all", "grad_all_to_all"
                tensors = [b.grad_data for b in bucket_group.buckets]
            else:
                op, name = "all_gather", "param_all_gather"
                tensors = [b.param_data for b in bucket_group.buckets]
            if known is None:
                facts = {
                    "reduce_op": None if a2a else bucket_reduce_op(bucket_group, kind),
                    "parts": bucket_parts(tensors),
                    "registered": bucket_registration(bucket_group, self.registry.registered_pools.get(info.name)),
                }
                known = (f"{info.name}.{name}[{tag}]", op, tensor_nbytes(tensors), dtype_name(tensors), info, facts)
            self._buckets[key] = known
        if known is ONE_RANK:
            return orig(bucket_group, *args, **kwargs)
        site_id, op, nbytes, dtype, info, facts = known
        if self.registry.recording:
            self.registry.record(site_id, op=op, nbytes=nbytes, dtype=dtype, group=info, facts=facts)
        cfg, pool_group, chunk = self._route(site_id, info)
        obs = self.observe
        noting = obs is not None and obs.on and cfg is not None
        if noting:
            self._pieces = []
        profiler = self.profiler
        timed = profiler.timed
        if timed:
            profiler.poll()
        prev_scope = self._scope
        self._scope = ("bucket", (chunk, info))
        if pool_group is not None:
            setattr(bucket_group, attr, pool_group)
            if self.first_use.armed:
                orig = self.first_use.guard_bucket(site_id, orig, bucket_group, attr, group)
        t0 = profiler.mark() if timed else None
        try:
            result = orig(bucket_group, *args, **kwargs)
        finally:
            if pool_group is not None:
                setattr(bucket_group, attr, group)
            self._scope = prev_scope
        if noting:
            key = (self.pool.comm_key(pool_group) or "") if pool_group is not None else ""
            obs.note(
                info.name,
                key,
                pool_group if pool_group is not None else group,
                op,
                nbytes,
                max(self._pieces, default=0),
            )
            self._pieces = None
        if timed:
            handle = getattr(bucket_group, handle_attr)
            if handle is None:
                profiler.sync(site_id, t0)
            else:
                setattr(bucket_group, handle_attr, profiler.issue(site_id, handle, t0))
        return result

    def bucket_coalescing(self, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """megatron-core's ``param_and_grad_buffer._coalescing_manager``, through ``FirstUse.coalescing``."""
        return self.first_use.coalescing(orig, args, kwargs)

    def collective(self, op: str, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A torch.distributed collective or Megatron alias (``op`` in GROUP_ARG), routed by the group in ``kwargs``."""
        scope = self._scope
        gi = GROUP_ARG[op]
        async_op = kwargs.get("async_op", False) or (len(args) > gi + 1 and args[gi + 1])
        if scope is None and not async_op or not self.active:
            return orig(*args, **kwargs)
        if scope is not None:
            tag = scope[0]
            if tag == "bucket":  # inside bucket_sync, which routed the group
                if self.first_use.pending is not None:  # the guarded first call: kept to be issued again
                    self.first_use.record(orig, args, kwargs, gi)
                chunk, info = scope[1]
                if chunk:
                    pieces = self._pieces
                    return chunked_call(
                        op, orig, args, kwargs, chunk, info.size, observe=pieces.append if pieces is not None else None
                    )
                return orig(*args, **kwargs)
            if tag == "named" and not async_op and not scope[1][2]:  # TE module forward: synchronous
                return orig(*args, **kwargs)
            if tag == "coalesced":  # inside a coalesced site (router_coalesced): it routed the group
                return self.coalesced_call(op, orig, args, kwargs)
            if tag == "mfsdp":  # inside Megatron-FSDP's gather or reduction (router_fsdp): it routed the buffers
                return self.mfsdp_call(op, orig, args, kwargs)
        group_in_args = "group" not in kwargs and len(args) > gi
        group = args[gi] if group_in_args else kwargs.get("group")
        key = (id(group), op, scope)
        call = self._streams.get(key)
        if call is None:
            call = self._streams[key] = self._stream_call(group, op, scope)
        if call is ONE_RANK:
            return orig(*args, **kwargs)
        site_id = call.site_id
        if site_id is None:  # Stream.next_id, inlined
            stream = call.stream
            n = stream.count
            stream.count = n + 1
            if stream.period:
                n %= stream.period
            ids = stream.ids
            site_id = ids[n] if n < len(ids) else stream.id_at(n)
        registry = self.registry
        if registry.recording:
            rec = registry.records.get(site_id)
            if rec is not None:  # a later call of the site in this iteration: count it (record_tensor, inlined)
                rec.calls += 1
            else:
                tname = call.tname
                reduce_op = call_reduce_op(op, args, kwargs)
                registry.record_tensor(
                    site_id,
                    op=op,
                    tensor=kwargs[tname] if tname in kwargs else args[call.tindex],
                    group=call.info,
                    facts=None if reduce_op is None else {"reduce_op": reduce_op},
                )
        route = self._routes.get(site_id) or self._resolve(site_id, call.info)
        chunk, note = 0, None
        if route[0] is not None:
            coalescing = self._coalesce_state
            if not (coalescing and group in coalescing):  # a coalesced call keeps its group, whole
                self.calls_routed += 1
                pool_group = route[1]
                if pool_group is not None:
                    if self.first_use.armed:  # the own group's arguments, before the swap below
                        orig = self.first_use.guard(site_id, orig, args, dict(kwargs))
                    if group_in_args:
                        args = args[:gi] + (pool_group,) + args[gi + 1 :]
                    else:  # the wrapper's own ``**kwargs`` dict (patches): nobody else holds it
                        kwargs["group"] = pool_group
                chunk = route[2] if call.chunkable else 0
                if self.observe is not None and self.observe.on:
                    note = self._note(op, call, pool_group if pool_group is not None else group, args, kwargs)
                    if not chunk:
                        note(0)
        profiler = self.profiler
        if not profiler.timed:
            if chunk:
                return chunked_call(op, orig, args, kwargs, chunk, call.info.size, observe=note)
            return orig(*args, **kwargs)
        profiler.poll()
        t0 = profiler.mark()
        work = (
            chunked_call(op, orig, args, kwargs, chunk, call.info.size, observe=note)
            if chunk
            else orig(*args, **kwargs)
        )
        if async_op:
            return profiler.issue(site_id, work, t0)
        profiler.sync(site_id, t0)
        return work

    def _note(self, op: str, call: _StreamCall, ran_on: Any, args: tuple, kwargs: dict) -> Callable[[int], None]:
        tensor = kwargs[call.tname] if call.tname in kwargs else args[call.tindex]
        key = (self.pool.comm_key(ran_on) or "") if self.pool is not None else ""
        nbytes, obs, name = tensor_nbytes([tensor]), self.observe, call.info.name
        return lambda piece: obs.note(name, key, ran_on, op, nbytes, piece)

    def _stream_call(self, group: Any, op: str, scope: Any) -> Any:
        info = self.registry.groups.lookup(group)
        if info.size < 2:
            return ONE_RANK
        if scope is None:
            stream: Stream | NamedSite = self.registry.stream(info, _ASYNC_KIND.get((info.name, op), f"async_{op}"))
        elif scope[0] == "named":
            name, prefix = scope[1][0], scope[1][1]
            kind = f"{prefix}_{op}" if prefix else _ASYNC_KIND.get((info.name, op), f"async_{op}")
            stream = self.registry.named_site(info, kind, name)
        else:
            kind, per_mb = scope[1]
            stream = self.registry.stream(info, kind, per_microbatch=per_mb)
        return _StreamCall(info, stream, _TENSOR_ARG[op], op != "all_to_all")

    @contextmanager
    def scope(self, kind: str, *, per_microbatch: bool) -> Iterator[None]:
        """Tags every collective issued inside as stream ``kind`` (``finalize_all_reduce``, ...)."""
        prev = self._scope
        self._scope = ("stream", (kind, per_microbatch))
        try:
            yield
        finally:
            self._scope = prev

    def current_scope(self) -> Any:
        """The scope collectives are tagged with now (kept by ``patches.carry_forward`` on a ctx)."""
        return self._scope

    @contextmanager
    def reenter(self, scope: Any) -> Iterator[None]:
        """Runs a backward in ``backward_scope(scope)``: the scope of its forward."""
        prev = self._scope
        self._scope = backward_scope(scope)
        try:
            yield
        finally:
            self._scope = prev

    @contextmanager
    def named(self, name: str, *, prefix: str | None = None, tag_sync: bool = False) -> Iterator[None]:
        """Sites ``<group>.<kind>[<stage><name>]`` (kind ``<prefix>_<op>``) inside; ``tag_sync``: sync calls too."""
        prev = self._scope
        self._scope = ("named", (name, prefix, tag_sync))
        try:
            yield
        finally:
            self._scope = prev

    def module(self, module: Any, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A module's ``forward`` (``patches.module_forward``) in the named scope of its path."""
        if not self.active:
            return orig(module, *args, **kwargs)
        prev = self._scope
        self._scope = ("named", (self.registry.module_name(module), None, False))
        try:
            return orig(module, *args, **kwargs)
        finally:
            self._scope = prev


def backward_scope(scope: Any) -> Any:
    """The scope a backward runs in, given its forward's: a stream kind gets ``_bwd``, named kept, else None."""
    if scope is None:
        return None
    tag, value = scope
    if tag == "stream":
        kind, per_mb = value
        return scope if kind.endswith("_bwd") else ("stream", (f"{kind}_bwd", per_mb))
    if tag == "named":
        return scope
    return None
