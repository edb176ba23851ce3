"""Point-to-point routing of the ``SiteRouter`` (a mixin): pipeline P2P and Transformer Engine's context-parallel ring.

``P2PCommunicator._communicate`` (mc0.16.1 ``pipeline_parallel/p2p_communication.py:254-389``) reads ``pp_group`` at
``:357``; ``_p2p_ops`` is ``:54-126``. TE reads ``cp_group`` at forward (v2.18
``dot_product_attention.py:1737,1793,1824``) and keeps it on ``ctx`` for backward (``context_parallel.py:2148``), so
one swap routes the whole CP exchange (not hierarchical ``a2a+p2p``); ``flash_attn_p2p_communicate`` is one ring
step (``context_parallel.py:96-135``).
"""

from __future__ import annotations

from typing import Any, Callable

from lagom_megatron.megatron.requests import split_world_direction, time_requests, uses_world_half
from lagom_megatron.megatron.sites import ONE_RANK, GroupInfo, dtype_name, tensor_nbytes


class P2PRouting:
    """Pipeline and context-parallel P2P methods of ``SiteRouter``."""

    registry: Any
    profiler: Any
    pool: Any
    active: bool
    assignment: dict
    _scope: Any
    _p2p_sites: dict
    _p2p_world: Any

    def _route(self, site_id: str, info: GroupInfo) -> tuple[Any, Any, int]:  # provided by SiteRouter
        raise NotImplementedError

    # -------------------------------------------------------------- pipeline
    def _record_p2p(self, site_id: str, info: GroupInfo, communicator: Any, kwargs: dict) -> None:
        """Records a ``_communicate`` call: bytes of the larger tensor sent, else of the shape received."""
        sent = [t for t in (kwargs.get("tensor_send_next"), kwargs.get("tensor_send_prev")) if t is not None]
        nbytes = max((tensor_nbytes(t) for t in sent), default=0)
        if not nbytes and kwargs.get("tensor_shape") is not None:
            n = 1
            for d in kwargs["tensor_shape"]:
                n *= int(d)
            dtype = communicator.config.pipeline_dtype
            nbytes = n * (dtype.itemsize if dtype is not None else 4)
        dtype = dtype_name(sent[0]) if sent else str(communicator.config.pipeline_dtype).replace("torch.", "")
        self.registry.record(site_id, op="send", nbytes=nbytes, dtype=dtype, group=info)

    def p2p(self, communicator: Any, orig: Callable[..., Any], kwargs: dict) -> Any:
        """``P2PCommunicator._communicate``: one site per pipeline, routed as a whole, overlap timed."""
        if not self.active:
            return orig(communicator, **kwargs)
        group = communicator.pp_group
        known = self._p2p_sites.get(id(group))
        if known is None:  # one site per pipeline group, named once
            info = self.registry.groups.lookup(group)
            known = self._p2p_sites[id(group)] = (f"{info.name}.send_recv", info) if info.size > 1 else ONE_RANK
        if known is ONE_RANK:
            return orig(communicator, **kwargs)
        site_id, info = known
        if self.registry.recording:
            self._record_p2p(site_id, info, communicator, kwargs)
        cfg, pool_group, _ = self._route(site_id, info)
        world = None
        if pool_group is not None and uses_world_half(pool_group):
            partner = self.registry.groups.partner(info.name)
            world = self.pool.group_for(partner, cfg) if partner is not None else None
        profiler = self.profiler
        timed = profiler.timed
        if timed:
            profiler.poll()
        if pool_group is not None:
            communicator.pp_group = pool_group
        prev_world, self._p2p_world = self._p2p_world, world
        t0 = profiler.mark() if timed else None
        try:
            result = orig(communicator, **kwargs)
        finally:
            self._p2p_world = prev_world
            if pool_group is not None:
                communicator.pp_group = group
        if timed:
            reqs = result[2] if isinstance(result, tuple) and len(result) == 3 else None
            if reqs:  # posted, not waited: the schedule waits them after computing
                return result[0], result[1], time_requests(profiler, site_id, reqs, t0)
            profiler.sync(site_id, t0)
        return result

    def p2p_ops(self, orig: Callable[..., dict], kwargs: dict) -> dict:
        """megatron-core's ``_p2p_ops``: the WORLD half goes to the partner entry while a routed call runs."""
        world = self._p2p_world
        if world is None or not uses_world_half(kwargs["group"]):
            return orig(**kwargs)
        return split_world_direction(orig, kwargs, world)

    # -------------------------------------------------------------- context parallel (TE)
    def _cp_sites(self, module: Any, info: GroupInfo) -> tuple[str, str]:
        name = self.registry.module_name(module)
        return (self.registry.named_site(info, "ring_send_recv", name).site_id,
                self.registry.named_site(info, "a2a", name).site_id)

    def attention(self, module: Any, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """TE ``DotProductAttention.forward``: named scope of the module; its ``cp_group`` routed."""
        if not self.active:
            return orig(module, *args, **kwargs)
        group = getattr(module, "cp_group", None)
        pool_group = None
        if self.assignment and group is not None and not isinstance(group, (list, tuple)):
            info = self.registry.groups.lookup(group)
            if info.size > 1:  # a group of one rank is never a site
                ring, a2a = self._cp_sites(module, info)
                site = ring if ring in self.assignment else a2a
                pool_group = self._route(site, info)[1]
        prev = self._scope
        self._scope = ("named", (self.registry.module_name(module), None, False))
        if pool_group is not None:
            module.cp_group = pool_group
        try:
            return orig(module, *args, **kwargs)
        finally:
            self._scope = prev
            if pool_group is not None:
                module.cp_group = group

    def ring_exchange(self, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """TE ``flash_attn_p2p_communicate``: one ring step of site ``cp.ring_send_recv[<module>]``."""
        if not self.active:
            return orig(*args, **kwargs)
        group = kwargs["cp_group"] if "cp_group" in kwargs else args[5]
        info = self.registry.groups.lookup(group)
        if info.size < 2:  # a group of one rank is never a site
            return orig(*args, **kwargs)
        scope = self._scope
        if scope is not None and scope[0] == "named":
            site_id = self.registry.named_site(info, "ring_send_recv", scope[1][0]).site_id
        else:
            site_id = self.registry.stream(info, "ring_send_recv").next_id()
        if self.registry.recording:
            send = kwargs["send_tensor"] if "send_tensor" in kwargs else args[1]
            self.registry.record(site_id, op="send", nbytes=tensor_nbytes(send), dtype=dtype_name(send), group=info)
        profiler = self.profiler
        if not profiler.timed:
            return orig(*args, **kwargs)
        profiler.poll()
        t0 = profiler.mark()
        return time_requests(profiler, site_id, orig(*args, **kwargs), t0)
