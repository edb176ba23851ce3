"""Posted point-to-point requests: timing them as one overlapped call, and the PP=2 partner direction.

Waited later: ``_communicate(wait_on_reqs=False)`` (megatron-core 0.16.1
``pipeline_parallel/p2p_communication.py:379-383``, ``schedules.py:1425,1514,1549,1594``) and TE's CP ring (v2.18
``pytorch/attention/dot_product_attention/context_parallel.py:96-135,1702-1703``). With two pipeline ranks one
direction goes on ``group.WORLD`` (``p2p_communication.py:64-73``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist


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
    """Registers posted requests (a list or dict of ``Work``) as one async call of ``site_id``; returns the same
    container of ``RequestProxy`` (empty or None unchanged)."""
    if not reqs or not profiler.timed:
        return reqs
    works = list(reqs.values()) if isinstance(reqs, dict) else list(reqs)
    timed = profiler.issue(site_id, RequestGroup(works), t_issue)
    if isinstance(reqs, dict):
        return {k: RequestProxy(v, timed) for k, v in reqs.items()}
    return [RequestProxy(v, timed) for v in reqs]


# Per parity of the pipeline rank: the tensors Megatron-Core posts on group.WORLD, in its order
# (p2p_communication.py:75-125: even ranks receive there, odd ranks send there).
_WORLD_HALF = {
    True: (("tensor_recv_prev", "recv_prev", "prev_pipeline_rank"), ("tensor_recv_next", "recv_next", "next_pipeline_rank")),
    False: (("tensor_send_next", "send_next", "next_pipeline_rank"), ("tensor_send_prev", "send_prev", "prev_pipeline_rank")),
}
# A tag per direction (activations forward, gradients backward): NCCL ignores tags; gloo matches
# messages between one pair of ranks by tag, and with two stages both directions join the same pair.
_TAGS = {"recv_prev": 1, "send_next": 1, "recv_next": 2, "send_prev": 2}


def uses_world_half(group: Any) -> bool:
    """Whether megatron-core's ``_p2p_ops`` posts one direction of ``group`` on WORLD (two ranks, not UCC)."""
    return group.size() == 2 and dist.get_backend(group) != "ucc"


def split_world_direction(orig: Callable[..., dict], kwargs: dict, world_entry: Any) -> dict:
    """``_p2p_ops(**kwargs)`` with the half it would post on WORLD posted on ``world_entry`` (global ranks as peers), in
    Megatron's order so post orders match the partner's; returns the requests dict keyed as ``_p2p_ops`` keys it."""
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
