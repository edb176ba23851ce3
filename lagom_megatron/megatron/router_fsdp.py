"""Megatron-FSDP routing of the ``SiteRouter``: per-unit parameter all-gathers and gradient reduce-scatters.

A mixin of ``router.SiteRouter`` (it uses its registry, profiler, pool and route cache). The
names are those of megatron-core 0.16.1's ``distributed/fsdp/src/megatron_fsdp/
param_and_grad_buffer.py`` (Megatron-FSDP 0.3.1, the copy megatron-core imports, also in
Megatron-LM's main; the ``megatron-fsdp`` 0.6.1 package on PyPI has the same names), which
``--use-megatron-fsdp`` wraps every model chunk with (``distributed/fsdp/mcore_fsdp_adapter.py``):

* ``AllGatherPipeline.all_gather_params(params, ..., bwd)`` (``:3447-3627``), called by the
  forward and backward pre-hooks of every module (``megatron_fsdp.py:680-711,808-829``): for each
  bucket group to gather (the unit's, and prefetched ones) it opens
  ``_coalescing_manager(dp_group, async_ops=async_param_gather)`` (``:3605-3613``), the group
  read from the bucket's buffer (``data_parallel_group``), and calls ``async_bucket_gather``
  (``:3719-3759``) per bucket, whose ``all_gather_into_tensor(..., group=wbuf.data_parallel_group,
  async_op=True)`` the manager queues; the manager itself is the handle kept for the bucket
  (``:3615-3621``) and waited by ``wait_bucket_ready`` (``:3629-3647``). In every micro-batch,
  forward and backward (the parameters are freed after each use).
* ``GradReducePipeline._bucket_group_gradient_reduce(bucket_group, async_op, ...)``
  (``:3182-3342``), called when a bucket group's gradients are all ready, every micro-batch:
  ``_coalescing_manager(dp_group)`` (synchronous, on its reduce-scatter stream on GPU) around one
  ``reduce_scatter_tensor`` (``all_reduce`` with ``no_shard``) per bucket on
  ``gbuf.data_parallel_group``; an event recorded after it is what the pipeline waits.
* ``_coalescing_manager``: the module's own name for torch's (imported at ``:32``).

A bucket group is one site per op: ``<group>.param_all_gather[<tag>]`` and
``<group>.grad_reduce_scatter[<tag>]`` (``grad_all_reduce`` without sharding), with the tags of
``SiteRegistry.fsdp_bucket_tags`` (the simulator's ids). Routing swaps the
``data_parallel_group`` of the buffers involved for the call: for a reduction, the gradient
buffers of its bucket group; for ``all_gather_params``, whose bucket groups (prefetch included)
are chosen inside, the weight buffers of every routed bucket, so each manager and its inner
calls see one group. The manager inside is timed: an asynchronous gather by its handle (the
consumer's ``wait``), a reduction as synchronous (on GPU its events are on the stream it runs
on). Bytes are those of the inner calls. Not sites: the outer (hybrid FSDP) group's gathers and
reductions, and the per-bucket gathers ``start_param_sync(force_sync=True)`` issues outside any
manager (they pass straight through).
"""

from __future__ import annotations

from typing import Any, Callable

from lagom_megatron.megatron.sites import ONE_RANK, dtype_name, tensor_nbytes

_WEIGHT_BUFFERS = ("model_weight_buffer", "transpose_weight_buffer", "hsdp_wbuf")
"""``ParameterGroup`` attributes of the buffers an all-gather may read its group from (``get_fsdp_buffer``, ``:3705-3716``)."""
_TENSOR = {"all_gather": ("output_tensor", 0), "reduce_scatter": ("input", 1), "all_reduce": ("tensor", 0)}


class _Buffer:
    """What the router keeps of one Megatron-FSDP ``ParamAndGradBuffer``: each bucket's sites."""

    __slots__ = ("gather", "reduce", "swaps", "swaps_for")

    def __init__(self, gather: list, reduce: list) -> None:
        self.gather = gather
        """Per bucket id: (site id, group info) of its all-gather, or ``ONE_RANK``."""
        self.reduce = reduce
        """Per bucket id: (site id, group info) of its gradient reduction, or ``ONE_RANK``."""
        self.swaps: list[tuple[Any, Any]] = []
        """(weight buffer, pool entry) of every routed all-gather under the routes ``swaps_for``."""
        self.swaps_for: Any = None


class _Manager:
    """One Megatron-FSDP call being routed: which bucket its coalesced manager gathers or reduces,
    and what that manager's inner calls moved."""

    __slots__ = ("sites", "gather", "bucket", "done", "calls", "nbytes", "dtype")

    def __init__(self, sites: list, *, gather: bool, bucket: int | None = None) -> None:
        self.sites, self.gather, self.bucket = sites, gather, bucket
        self.done = False
        """The reduction's manager has exited: a later one (the hybrid-FSDP outer group's) is not the site."""
        self.calls, self.nbytes, self.dtype = 0, 0, "float32"


class _Coalesced:
    """``_coalescing_manager`` of a site: opens torch's, times it, records it on exit."""

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
    """The handle a timed asynchronous manager yields: Megatron-FSDP keeps it and waits it later;
    it waits what the profiler made of the manager once the manager has exited."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class FsdpRouting:
    """Megatron-FSDP methods of ``SiteRouter`` (see module docstring)."""

    registry: Any
    profiler: Any
    active: bool
    calls_routed: int
    _scope: Any
    _routes: dict
    _mfsdp: dict

    def _resolve(self, site_id: str, info: Any) -> tuple[Any, Any, int]:  # provided by SiteRouter
        raise NotImplementedError

    def _mfsdp_buffer(self, buffer: Any) -> _Buffer | None:
        """The sites of ``buffer``'s buckets, described once (None: ``bind_model`` did not see it)."""
        known = self._mfsdp.get(id(buffer))
        if known is None and id(buffer) not in self._mfsdp:
            tags = self.registry.fsdp_bucket_tags(buffer)
            if tags is not None:
                lookup = self.registry.groups.lookup
                no_shard = buffer.ddp_config.data_parallel_sharding_strategy == "no_shard"
                reduce_name = "grad_all_reduce" if no_shard else "grad_reduce_scatter"

                def sites(bufs: tuple[str, ...], name: str) -> list:
                    out = []
                    for tag, g in zip(tags, buffer.parameter_groups):
                        buf = next((b for b in (getattr(g, a, None) for a in bufs) if b is not None), None)
                        info = lookup(buf.data_parallel_group) if buf is not None else None
                        out.append((f"{info.name}.{name}[{tag}]", info) if info is not None and info.size > 1
                                   else ONE_RANK)
                    return out

                known = _Buffer(sites(("hsdp_wbuf", "model_weight_buffer") if not no_shard else (), "param_all_gather"),
                                sites(("hsdp_gbuf", "main_grad_buffer"), reduce_name))
            self._mfsdp[id(buffer)] = known
        return known

    def mfsdp_all_gather(self, pipeline: Any, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``AllGatherPipeline.all_gather_params``: its coalesced bucket-group gathers are sites."""
        state = self._mfsdp_buffer(pipeline.buffer) if self.active else None
        if state is None:
            return orig(pipeline, *args, **kwargs)
        routes = self._routes
        if state.swaps_for is not routes:  # the weight buffers of every routed gather, once per assignment
            state.swaps = self._mfsdp_swaps(pipeline.buffer, state)
            state.swaps_for = routes
        prev = self._scope
        self._scope = ("mfsdp", _Manager(state.gather, gather=True))
        originals = [(buf, buf.data_parallel_group) for buf, _ in state.swaps]
        for buf, entry in state.swaps:
            buf.data_parallel_group = entry
        try:
            return orig(pipeline, *args, **kwargs)
        finally:
            for buf, group in originals:
                buf.data_parallel_group = group
            self._scope = prev

    def _mfsdp_swaps(self, buffer: Any, state: _Buffer) -> list[tuple[Any, Any]]:
        swaps = []
        for (site, g) in zip(state.gather, buffer.parameter_groups):
            if site is ONE_RANK:
                continue
            route = self._routes.get(site[0]) or self._resolve(site[0], site[1])
            if route[1] is not None:
                swaps.extend((b, route[1]) for b in (getattr(g, a, None) for a in _WEIGHT_BUFFERS) if b is not None)
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
        state = self._mfsdp_buffer(pipeline.buffer) if self.active else None
        bucket_group = kwargs["bucket_group"] if "bucket_group" in kwargs else args[0]
        if state is None or state.reduce[bucket_group[0]] is ONE_RANK:
            return orig(pipeline, *args, **kwargs)
        site_id, info = state.reduce[bucket_group[0]]
        route = self._routes.get(site_id) or self._resolve(site_id, info)
        swapped = []
        if route[1] is not None:
            for b in bucket_group:
                buf = pipeline.get_fsdp_buffer(b)
                swapped.append((buf, buf.data_parallel_group))
                buf.data_parallel_group = route[1]
        prev = self._scope
        self._scope = ("mfsdp", _Manager(state.reduce, gather=False, bucket=bucket_group[0]))
        try:
            return orig(pipeline, *args, **kwargs)
        finally:
            for buf, group in swapped:
                buf.data_parallel_group = group
            self._scope = prev

    def mfsdp_coalescing(self, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Megatron-FSDP's ``_coalescing_manager(group, device=None, async_ops=False)``: the site's
        manager is timed and recorded (``_Coalesced``); any other passes through."""
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
        return orig(*args, **kwargs)

    def _mfsdp_done(self, manager: _Coalesced) -> None:
        """A manager exited: record, count and time the call it issued, if it is a site's."""
        call = manager.call
        call.done = not call.gather
        site = call.sites[call.bucket] if call.bucket is not None else ONE_RANK
        if site is ONE_RANK or not call.calls:  # the outer group's gather, a one-rank group, or nothing queued
            return
        site_id, info = site
        if self.registry.recording:
            op = "all_gather" if call.gather else ("reduce_scatter" if "scatter" in site_id else "all_reduce")
            self.registry.record(site_id, op=op, nbytes=call.nbytes, dtype=call.dtype, group=info)
        if (self._routes.get(site_id) or self._resolve(site_id, info))[0] is not None:
            self.calls_routed += 1
        if manager.t0 is None:
            return
        if manager.handle is not None:  # asynchronous: the consumer's wait() ends the region
            manager.handle.work = self.profiler.issue(site_id, manager.handle.work, manager.t0)
        else:
            self.profiler.sync(site_id, manager.t0)
