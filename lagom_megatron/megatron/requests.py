"""Posted point-to-point requests: timing them as one overlapped call, and the PP=2 partner direction.

Two Megatron-Core / Transformer Engine paths post sends and receives and hand the requests back
to code that waits on them later, after computing:

* the interleaved pipeline schedule with ``overlap_p2p_comm``: ``P2PCommunicator._communicate``
  returns its ``reqs`` dict unwaited when ``wait_on_reqs=False`` (megatron-core 0.16.1
  ``pipeline_parallel/p2p_communication.py:379-383``) and the schedule waits each entry separately
  later (``schedules.py:1425,1514,1549,1594``);
* Transformer Engine's context-parallel ring: ``flash_attn_p2p_communicate`` returns the list of
  requests of one ring step, waited one step later while the next attention block runs
  (TE v2.18 ``pytorch/attention/dot_product_attention/context_parallel.py:96-135,1702-1703``).

``time_requests`` registers such a call with the profiler as one asynchronous call and returns
the same container with each request replaced by a ``RequestProxy``: waiting a proxy waits only
its own request and stamps the consumer's wait (the end of the overlapped compute) the first
time any request of the call is waited. In the serialized profiling iteration the profiler waits
the whole call at once, so ``t_comp`` is the compute between posting and the first wait.

``split_world_direction`` is the PP=2 case: for a pipeline group of two ranks Megatron-Core posts
one direction on ``torch.distributed.group.WORLD`` so that the two directions use different
communicators (``p2p_communication.py:64-73``); routing only ``pp_group`` would leave that half
on the default communicator. When the pipeline site is routed, this posts that half on the pool
entry of the partner group ``pp_world`` (the world's ranks, same configuration) instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist


class RequestGroup:
    """The requests of one call as one handle: ``works`` (the profiler polls them), ``wait()`` waits all.

    Each request is waited at most once, whether through ``wait()`` (the serialized profiling
    iteration) or ``wait_one`` (a proxy): a gloo send/receive request blocks when waited a second
    time (its unbound buffer waits for another message).
    """

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
        """Waits every request not waited yet; returns True."""
        for w in self.works:
            self.wait_one(w, *args, **kwargs)
        return True

    def is_completed(self) -> bool:
        """Whether every request has completed (``Work.is_completed``)."""
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
        """Whether this request has completed."""
        return bool(self._req.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._req, name)


def time_requests(profiler: Any, site_id: str, reqs: Any, t_issue: Any) -> Any:
    """Registers posted requests (a list or a dict of ``Work``) as one async call of ``site_id``.

    Args:
        profiler: the rank's ``Profiler`` (``issue`` returns a ``TimedWork`` with ``wait_part``).
        reqs: what the posting function returned: a list or a dict name -> ``Work``; empty or
            None is returned unchanged (nothing posted, or already waited).
        t_issue: ``profiler.mark()`` taken before posting.

    Returns:
        The same kind of container with every request wrapped in a ``RequestProxy``.
    """
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
    """``_p2p_ops(**kwargs)`` with the half it would post on WORLD posted on ``world_entry``.

    ``orig`` is called with that half's tensors set to None, so it posts only the sends or
    receives that go on ``kwargs['group']``; the other half is then posted on ``world_entry`` in
    Megatron's order. Within each communicator the order of posts matches the partner rank's, so
    no send waits on a receive posted later on the same communicator.

    Args:
        orig: megatron-core's ``_p2p_ops`` (keyword-only: ``tensor_send_prev``, ``tensor_recv_prev``,
            ``tensor_send_next``, ``tensor_recv_next``, ``group``, ``prev_pipeline_rank``,
            ``next_pipeline_rank``).
        world_entry: a process group over all ranks of the world (global ranks are the peers).

    Returns:
        The requests dict, keyed as ``_p2p_ops`` keys it (``send_next``, ``recv_prev``, ...).
    """
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
