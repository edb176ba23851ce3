"""Megatron-FSDP routing of the ``SiteRouter`` (a mixin): per-unit parameter all-gathers and gradient reductions.
``distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py`` of megatron-core 0.16.1 / 0.17.1 / 0.18.2 (Megatron-FSDP
0.3.1 / 0.4.0 / 0.5.1; ``megatron-fsdp`` 0.6.1; ``distributed/fsdp/mcore_fsdp_adapter.py``), lines in that order:
``all_gather_params`` (``:3447-3627``, ``:3921-4107``, ``:3975-4163``; 0.16.1 ``megatron_fsdp.py:432,680-711,808-829``)
opens a manager per bucket group (``:3605-3613``, ``:4085-4093``, ``:4141-4149``) around ``async_bucket_gather``
(``:3718-3758``, ``:4206-4250``, ``:4263-4310``); ``_bucket_group_gradient_reduce`` (``:3182-3341``, ``:3566-3815``,
``:3600-3849``); torch's ``_coalescing_manager`` at ``:32``; ``get_fsdp_buffer`` (``:3705-3716``, ``:4190-4204``,
``:4247-4261``; ``:3175-3180``, ``:3559-3564``, ``:3593-3598``) gives the groups, swapped over the site's ranks only.
core_v0.19.0 / main keep these names and signatures (``all_gather_params`` ``:4380`` / ``:4388``, ``async_bucket_gather``
``:4682`` / ``:4690``, ``_bucket_group_gradient_reduce`` ``:4005`` / ``:4013``, managers ``:4038,4132,4542,4561`` /
``:4046,4140,4550,4569``); main's opt-in version 2 (``megatron_fsdp/experimental/``) is not hooked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lagom_megatron.megatron.hooks.sites import ONE_RANK, call_reduce_op, dtype_name, tensor_nbytes

_TENSOR = {"all_gather": ("output_tensor", 0), "reduce_scatter": ("input", 1), "all_reduce": ("tensor", 0)}
_UNSEEN: Any = object()


class _Buffer:
    __slots__ = ("tags", "gather", "reduce", "swaps", "swaps_for")

    def __init__(self, tags: list[str]) -> None:
        self.tags = tags
        self.gather: list | None = None
        self.reduce: list | None = None
        self.swaps: dict[bool, list[tuple[Any, Any]]] = {}
        self.swaps_for: Any = None


class _Manager:
    __slots__ = ("sites", "gather", "bucket", "done", "calls", "nbytes", "dtype", "reduce_op")

    def __init__(self, sites: list, *, gather: bool, bucket: int | None = None) -> None:
        self.sites, self.gather, self.bucket = sites, gather, bucket
        self.done = False
        """The reduction's manager has exited: a later one (the hybrid-FSDP outer group's) is not the site."""
        self.calls, self.nbytes, self.dtype = 0, 0, "float32"
        self.reduce_op: str | None = None


class _Coalesced:
    __slots__ = ("router", "inner", "call", "t0", "handle", "async_ops")

    def __init__(self, router: Any, inner: Any, call: _Manager, async_ops: bool) -> None:
        self.router, self.inner, self.call, self.async_ops = router, inner, call, async_ops
        self.t0: Any = None
        self.handle: _LateHandle | None = None

    def __enter__(self) -> Any:
        call = self.call
        if call.gather:  # each bucket group of all_gather_params has its own manager (the bucket named inside)
            call.bucket = None
        call.calls = call.nbytes = 0
        profiler = self.router.profiler
        if profiler.timed:
            profiler.poll()
            self.t0 = profiler.mark()
        cm = self.inner.__enter__()
        if profiler.timed and self.async_ops:
            self.handle = _LateHandle(cm)
            return self.handle
        return cm

    def __exit__(self, *exc: Any) -> Any:
        out = self.inner.__exit__(*exc)
        if exc[0] is None:
            self.router._mfsdp_done(self)
        return out


class _LateHandle:
    """The handle a timed async manager yields; waits what the profiler made of the manager once it exited."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class FsdpRouting:
    """Megatron-FSDP methods of ``SiteRouter``."""

    registry: Any
    profiler: Any
    active: bool
    calls_routed: int
    _scope: Any
    _routes: dict
    _mfsdp: dict

    def _resolve(self, site_id: str, info: Any) -> tuple[Any, Any, int]:
        raise NotImplementedError

    def _mfsdp_state(self, buffer: Any) -> _Buffer | None:
        known = self._mfsdp.get(id(buffer), _UNSEEN)
        if known is _UNSEEN:
            tags = self.registry.fsdp_bucket_tags(buffer)
            known = self._mfsdp[id(buffer)] = _Buffer(tags) if tags is not None else None
        return known

    def _mfsdp_sites(self, tags: list[str], buffers: list[Any], name: str) -> list:
        """Per bucket id: (site id, group info) after the group of its ``get_fsdp_buffer`` buffer, or ``ONE_RANK``."""
        lookup = self.registry.groups.lookup
        out = []
        for tag, buf in zip(tags, buffers):
            info = lookup(buf.data_parallel_group) if buf is not None else None
            out.append((f"{info.name}.{name}[{tag}]", info) if info is not None and info.size > 1 else ONE_RANK)
        return out

    def _same_ranks(self, buf: Any, info: Any) -> bool:
        """Whether ``buf`` communicates over ``info``'s ranks (only then may a pool entry of that group stand in)."""
        return buf is not None and self.registry.groups.lookup(buf.data_parallel_group).ranks == info.ranks

    def mfsdp_all_gather(self, pipeline: Any, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``AllGatherPipeline.all_gather_params``: its coalesced bucket-group gathers are sites."""
        state = self._mfsdp_state(pipeline.buffer) if self.active else None
        if state is None:
            return orig(pipeline, *args, **kwargs)
        if state.gather is None:
            n = len(state.tags)
            state.gather = self._mfsdp_sites(
                state.tags, [pipeline.get_fsdp_buffer(i) for i in range(n)], "param_all_gather"
            )
        bwd = bool(kwargs["bwd"] if "bwd" in kwargs else len(args) > 6 and args[6])
        routes = self._routes
        if state.swaps_for is not routes:
            state.swaps, state.swaps_for = {}, routes
        swaps = state.swaps.get(bwd)
        if swaps is None:
            swaps = state.swaps[bwd] = self._mfsdp_swaps(pipeline, state, bwd)
        prev = self._scope
        self._scope = ("mfsdp", _Manager(state.gather, gather=True))
        originals = [(buf, buf.data_parallel_group) for buf, _ in swaps]
        for buf, entry in swaps:
            buf.data_parallel_group = entry
        try:
            return orig(pipeline, *args, **kwargs)
        finally:
            for buf, group in originals:
                buf.data_parallel_group = group
            self._scope = prev

    def _mfsdp_swaps(self, pipeline: Any, state: _Buffer, bwd: bool) -> list[tuple[Any, Any]]:
        swaps: list[tuple[Any, Any]] = []
        groups = pipeline.buffer.parameter_groups
        for i, site in enumerate(state.gather):
            if site is ONE_RANK:
                continue
            entry = (self._routes.get(site[0]) or self._resolve(site[0], site[1]))[1]
            if entry is None:
                continue
            bufs = [pipeline.get_fsdp_buffer(i)]
            if bwd and getattr(groups[i], "transpose_weight_buffer", None) is not None:
                try:
                    bufs.append(pipeline.get_fsdp_buffer(i, bwd=True))
                except RuntimeError:  # mc 0.16.1 HSDP has no transposed buffer: Megatron-FSDP raises at that gather
                    pass
            swaps.extend((b, entry) for b in bufs if self._same_ranks(b, site[1]) and all(b is not s for s, _ in swaps))
        return swaps

    def mfsdp_bucket(self, pipeline: Any, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``AllGatherPipeline.async_bucket_gather(bucket_id, bwd)``: names the manager it runs in."""
        scope = self._scope
        if scope is not None and scope[0] == "mfsdp" and scope[1] is not None:
            call = scope[1]
            if call.bucket is None:
                call.bucket = kwargs["bucket_id"] if "bucket_id" in kwargs else args[0]
            return orig(pipeline, *args, **kwargs)
        self._scope = ("mfsdp", None)  # outside all_gather_params (start_param_sync(force_sync)): not a site
        try:
            return orig(pipeline, *args, **kwargs)
        finally:
            self._scope = scope

    def mfsdp_reduce(self, pipeline: Any, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``GradReducePipeline._bucket_group_gradient_reduce(bucket_group, ...)``: one site, routed."""
        state = self._mfsdp_state(pipeline.buffer) if self.active else None
        if state is None:
            return orig(pipeline, *args, **kwargs)
        if state.reduce is None:
            no_shard = pipeline.buffer.ddp_config.data_parallel_sharding_strategy == "no_shard"
            state.reduce = self._mfsdp_sites(
                state.tags,
                [pipeline.get_fsdp_buffer(i) for i in range(len(state.tags))],
                "grad_all_reduce" if no_shard else "grad_reduce_scatter",
            )
        bucket_group = kwargs["bucket_group"] if "bucket_group" in kwargs else args[0]
        site = state.reduce[bucket_group[0]]
        if site is ONE_RANK:
            return orig(pipeline, *args, **kwargs)
        site_id, info = site
        entry = (self._routes.get(site_id) or self._resolve(site_id, info))[1]
        swapped = []
        if entry is not None:
            for b in bucket_group:
                buf = pipeline.get_fsdp_buffer(b)
                if self._same_ranks(buf, info):
                    swapped.append((buf, buf.data_parallel_group))
        for buf, _ in swapped:
            buf.data_parallel_group = entry
        prev = self._scope
        self._scope = ("mfsdp", _Manager(state.reduce, gather=False, bucket=bucket_group[0]))
        try:
            return orig(pipeline, *args, **kwargs)
        finally:
            for buf, group in swapped:
                buf.data_parallel_group = group
            self._scope = prev

    def mfsdp_coalescing(self, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Megatron-FSDP's ``_coalescing_manager(group, device=None, async_ops=False)``: a site's is timed, recorded."""
        scope = self._scope
        call = scope[1] if scope is not None and scope[0] == "mfsdp" else None
        if call is None or call.done:
            return orig(*args, **kwargs)
        async_ops = kwargs["async_ops"] if "async_ops" in kwargs else (len(args) > 2 and args[2])
        return _Coalesced(self, orig(*args, **kwargs), call, bool(async_ops))

    def mfsdp_call(self, op: str, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A collective issued inside a Megatron-FSDP call: counted for the manager it is queued in."""
        call = self._scope[1]
        if call is not None and op in _TENSOR:
            name, index = _TENSOR[op]
            t = kwargs[name] if name in kwargs else args[index]
            call.calls += 1
            call.nbytes += tensor_nbytes(t)
            call.dtype = dtype_name(t)
            call.reduce_op = call_reduce_op(op, args, kwargs)
        return orig(*args, **kwargs)

    def _mfsdp_done(self, manager: _Coalesced) -> None:
        call = manager.call
        call.done = not call.gather
        site = call.sites[call.bucket] if call.bucket is not None else ONE_RANK
        if site is ONE_RANK or not call.calls:  # the outer group's gather, a one-rank group, or nothing queued
            return
        site_id, info = site
        if self.registry.recording:
            op = "all_gather" if call.gather else ("reduce_scatter" if "scatter" in site_id else "all_reduce")
            self.registry.record(
                site_id,
                op=op,
                nbytes=call.nbytes,
                dtype=call.dtype,
                group=info,
                facts=None if call.reduce_op is None else {"reduce_op": call.reduce_op},
            )
        if (self._routes.get(site_id) or self._resolve(site_id, info))[0] is not None:
            self.calls_routed += 1
        if manager.t0 is None:
            return
        if manager.handle is not None:
            manager.handle.work = self.profiler.issue(site_id, manager.handle.work, manager.t0)
        else:
            self.profiler.sync(site_id, manager.t0)
