"""P2P routing of the ``SiteRouter`` (a mixin): pipeline P2P and TE's context-parallel ring.
``P2PCommunicator._communicate`` (mc0.16.1 ``pipeline_parallel/p2p_communication.py:254-389``) reads ``pp_group`` at
``:357``; ``_p2p_ops`` is ``:54-126``. TE reads ``cp_group`` at forward (v2.18
``dot_product_attention.py:1737,1793,1824``), keeping it on ``ctx`` for backward (``context_parallel.py:2148``): one
swap routes the whole CP exchange (not ``a2a+p2p``); ``flash_attn_p2p_communicate`` is one ring step (``:96-135``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lagom_megatron.megatron.hooks.sites import ONE_RANK, GroupInfo, dtype_name, tensor_nbytes


class RequestGroup:
    """The requests of one call as one handle; each is waited at most once (a gloo P2P request blocks when rewaited)."""

    __slots__ = ("works", "_waited")

    def __init__(self, works: list[Any]) -> None:
        self.works = works
        self._waited: set[int] = set()

    def wait_one(self, req: Any, *args: Any, **kwargs: Any) -> Any:
        """Waits ``req`` (one of ``works``) unless it was waited already; returns its result or True."""
        if req is None or id(req) in self._waited:
            return True
        self._waited.add(id(req))
        return req.wait(*args, **kwargs)

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        for w in self.works:
            self.wait_one(w, *args, **kwargs)
        return True

    def is_completed(self) -> bool:
        return all(w is None or w.is_completed() for w in self.works)


class RequestProxy:
    """One request of a timed call; ``wait()`` waits it through the call's ``TimedWork``."""

    __slots__ = ("_req", "_timed")

    def __init__(self, req: Any, timed: Any) -> None:
        self._req = req
        self._timed = timed

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """Waits this request (once); the first wait of the call stamps the consumer's wait."""
        return self._timed.wait_part(self._req, *args, **kwargs)

    def is_completed(self) -> bool:
        return bool(self._req.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


def time_requests(profiler: Any, site_id: str, reqs: Any, t_issue: Any) -> Any:
    """Posted requests (a list or dict of ``Work``) as one async call of ``site_id``, in a like container of proxies."""
    if not reqs or not profiler.timed:
        return reqs
    works = list(reqs.values()) if isinstance(reqs, dict) else list(reqs)
    timed = profiler.issue(site_id, RequestGroup(works), t_issue)
    if isinstance(reqs, dict):
        return {k: RequestProxy(v, timed) for k, v in reqs.items()}
    return [RequestProxy(v, timed) for v in reqs]


# per pipeline-rank parity, what Megatron-Core posts on WORLD, in order (p2p_communication.py:75-125: even ranks recv)
_WORLD_HALF = {
    True: (
        ("tensor_recv_prev", "recv_prev", "prev_pipeline_rank"),
        ("tensor_recv_next", "recv_next", "next_pipeline_rank"),
    ),
    False: (
        ("tensor_send_next", "send_next", "next_pipeline_rank"),
        ("tensor_send_prev", "send_prev", "prev_pipeline_rank"),
    ),
}
# a tag per direction: NCCL ignores tags; gloo matches by tag, and with two stages both directions join one rank pair
_TAGS = {"recv_prev": 1, "send_next": 1, "recv_next": 2, "send_prev": 2}


def uses_world_half(group: Any) -> bool:
    """Whether megatron-core's ``_p2p_ops`` posts one direction of ``group`` on WORLD (two ranks, not UCC)."""
    return group.size() == 2 and dist.get_backend(group) != "ucc"


def split_world_direction(orig: Callable[..., dict], kwargs: dict, world_entry: Any) -> dict:
    """``_p2p_ops(**kwargs)`` with its WORLD half on ``world_entry``, in Megatron's order (as the partner posts)."""
    even = kwargs["group"].rank() % 2 == 0
    half = _WORLD_HALF[even]
    own = dict(kwargs)
    for tensor_key, _, _ in half:
        own[tensor_key] = None
    reqs = orig(**own)
    for tensor_key, req_key, peer_key in half:
        tensor = kwargs.get(tensor_key)
        if tensor is None:
            continue
        peer = kwargs[peer_key]
        if even:
            reqs[req_key] = dist.irecv(tensor=tensor, src=peer, group=world_entry, tag=_TAGS[req_key])
        else:
            reqs[req_key] = dist.isend(tensor=tensor, dst=peer, group=world_entry, tag=_TAGS[req_key])
    return reqs


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

    def _route(self, site_id: str, info: GroupInfo) -> tuple[Any, Any, int]:
        raise NotImplementedError

    def _record_p2p(self, site_id: str, info: GroupInfo, communicator: Any, kwargs: dict) -> None:
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
        if known is None:
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

    def _cp_sites(self, module: Any, info: GroupInfo) -> tuple[str, str]:
        name = self.registry.module_name(module)
        return (
            self.registry.named_site(info, "ring_send_recv", name).site_id,
            self.registry.named_site(info, "a2a", name).site_id,
        )

    def attention(self, module: Any, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """TE ``DotProductAttention.forward``: named scope of the module; its ``cp_group`` routed."""
        if not self.active:
            return orig(module, *args, **kwargs)
        group = getattr(module, "cp_group", None)
        pool_group = None
        if self.assignment and group is not None and not isinstance(group, (list, tuple)):
            info = self.registry.groups.lookup(group)
            if info.size > 1:
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
        if info.size < 2:
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
