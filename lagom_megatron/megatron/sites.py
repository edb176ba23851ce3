"""Collective sites: stable ids and registry records for every overlapped collective of Megatron-Core.

A *collective site* is one place that issues a collective; its id is the
same on every iteration and on every rank of its process group, because it is derived from
structure only, never from object ids:

    dp.grad_reduce_scatter[chunk0.bucket1]   DDP bucket group 1 of model chunk 0 (distributed optimizer)
    dp.grad_all_reduce[stage1.chunk0.bucket0] the same on pipeline stage 1 (pipeline parallel runs)
    dp.grad_all_reduce[chunk0.bucket0]       the same without the distributed optimizer
    dp.param_all_gather[chunk0.bucket0]      distributed-optimizer parameter all-gather
    tp.sp_all_gather[3]                      4th asynchronous TP all-gather of a micro-batch's backward
    tp.sp_reduce_scatter[3], tp.dgrad_all_reduce[3]
    tp.finalize_all_reduce[0]                all-reduces issued by ``finalize_model_grads``
    pp.send_recv                             all pipeline P2P traffic of the rank's pipeline
    ep.dispatch_all_to_all[1]                MoE token dispatcher all-to-all (call order)

Streams of calls that have no structural index (TP, finalize, MoE) are numbered by call order
within one micro-batch: the first iteration (never timed) counts the calls of each stream, the
count divided by the number of micro-batches is the stream's period, and call ``n`` of a later
iteration is site ``n % period`` with ``calls_per_iter`` = micro-batches. Ranks of one group run
the same layers in the same order, so the numbering agrees across them.

Pipeline P2P is one site per pipeline, not one per stage pair: a send and its matching receive
must use the same communicator, and a call of the interleaved schedule touches both neighbours,
so the only routing that can never pair a send with a receive on another communicator is one
configuration for the whole pipeline. This is our design.

Group names are Megatron's process-group names (``parallel_state``'s ``dp``, ``dp_cp``, ``tp``,
``pp``, ``ep``, ``cp``, ...), resolved from the group object at setup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from lagom_megatron.engine.profile import CollectiveSite

# (name, parallel_state getter, kwargs): order matters, the first name found for a group wins, so
# that a data-parallel group that doubles as the dp_cp group (context parallel 1) is called dp.
_GROUP_GETTERS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("tp", "get_tensor_model_parallel_group", {}),
    ("pp", "get_pipeline_model_parallel_group", {}),
    ("dp", "get_data_parallel_group", {"with_context_parallel": False}),
    ("dp_cp", "get_data_parallel_group", {"with_context_parallel": True}),
    ("cp", "get_context_parallel_group", {}),
    ("ep", "get_expert_model_parallel_group", {}),
    ("expt_tp", "get_expert_tensor_parallel_group", {}),
    ("expt_dp", "get_expert_data_parallel_group", {}),
    ("intra_dist_opt", "get_intra_distributed_optimizer_instance_group", {}),
    ("embd", "get_embedding_group", {}),
    ("pos_embd", "get_position_embedding_group", {}),
    ("mp", "get_model_parallel_group", {}),
)


STAGE_LOCAL_GROUPS = frozenset({"tp", "dp", "dp_cp", "cp", "ep", "expt_tp", "expt_dp", "intra_dist_opt"})
"""Groups whose ranks all hold the same pipeline stage: under pipeline parallelism their site ids
carry the stage (``tp.sp_all_gather[stage1.3]``, ``dp.grad_all_reduce[stage0.chunk0.bucket1]``), since
each stage runs other layers and buckets. Groups across stages (``pp``, ``embd``) carry none."""

# A group whose ranks equal those of the named group is called by that name (context parallel 1,
# one distributed-optimizer instance): the collectives are then the plain data-parallel ones.
_SAME_AS = {"dp_cp": "dp", "intra_dist_opt": "dp_cp"}


def _group_ranks(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


@dataclass(kw_only=True, slots=True)
class GroupInfo:
    """A named process group as lagom sees it: Megatron's name, its ranks and its node span."""

    name: str
    ranks: tuple[int, ...]
    n_nodes: int = 1

    @property
    def size(self) -> int:
        return len(self.ranks)


class GroupNames:
    """Maps process-group objects to Megatron's group names (``tp``, ``dp``, ``pp``, ...).

    Built once after ``parallel_state.initialize_model_parallel``. Lookups are by object identity
    first (O(1), used on every call), then by rank list (groups built outside ``parallel_state``
    over the same ranks, e.g. lagom's own communicator-pool entries, which register themselves
    with ``alias``).

    Args:
        local_world_size: ranks per node, for ``n_nodes``; default ``$LOCAL_WORLD_SIZE`` or 1.
    """

    def __init__(self, *, local_world_size: int | None = None) -> None:
        self.local_world_size = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", 0) or 1)
        self._by_id: dict[int, GroupInfo] = {}
        self._by_ranks: dict[tuple[int, ...], GroupInfo] = {}
        self._by_name: dict[str, GroupInfo] = {}
        self._keep: list[Any] = []  # holds group objects so that their ids stay unique

    @classmethod
    def from_parallel_state(cls, **kwargs: Any) -> "GroupNames":
        """Names every group that ``megatron.core.parallel_state`` has initialised on this rank."""
        from megatron.core import parallel_state as ps

        names = cls(**kwargs)
        for name, getter, kw in _GROUP_GETTERS:
            fn = getattr(ps, getter, None)
            if fn is None:
                continue
            try:
                group = fn(check_initialized=False, **kw) if "check_initialized" in fn.__code__.co_varnames else fn(**kw)
            except (AssertionError, RuntimeError, TypeError):
                continue
            if group is not None:
                names.add(name, group)
        return names

    def add(self, name: str, group: Any) -> GroupInfo:
        """Registers ``group`` under ``name`` unless the object already has a name; returns its info."""
        if id(group) in self._by_id:
            return self._by_id[id(group)]
        ranks = _group_ranks(group)
        same = self._by_name.get(_SAME_AS.get(name, ""))
        if same is not None and same.ranks == ranks:
            name = same.name  # e.g. the dp_cp group of a run without context parallelism is dp
        info = GroupInfo(name=name, ranks=ranks, n_nodes=len({r // self.local_world_size for r in ranks}))
        self._by_id[id(group)] = info
        self._by_ranks.setdefault(ranks, info)
        self._by_name.setdefault(name, info)
        self._keep.append(group)
        return info

    def alias(self, group: Any, info: GroupInfo) -> None:
        """Registers another group object (a pool entry) as the same named group ``info``."""
        self._by_id[id(group)] = info
        self._keep.append(group)

    def lookup(self, group: Any) -> GroupInfo:
        """The named group of ``group`` (None = the default group, named ``world``).

        Unknown groups are named by their rank list when it matches a known group, else
        ``world`` (all ranks) or ``other``; the result is cached.
        """
        if group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        info = self._by_id.get(id(group))
        if info is not None:
            return info
        ranks = _group_ranks(group)
        known = self._by_ranks.get(ranks)
        import torch.distributed as dist

        name = known.name if known else ("world" if len(ranks) == dist.get_world_size() else "other")
        return self.add(name, group)

    def by_name(self, name: str) -> GroupInfo | None:
        """This rank's group called ``name``, or None."""
        return self._by_name.get(name)

    def names(self) -> list[str]:
        """Names of this rank's groups, in registration order."""
        return list(self._by_name)


@dataclass(kw_only=True, slots=True)
class SiteRecord:
    """Registry record of one site in the current iteration (bytes of one call, calls so far)."""

    site_id: str
    op: str
    nbytes: int
    dtype: str
    group: GroupInfo
    calls: int = 0

    def to_site(self, *, calls_per_iter: int | None = None) -> CollectiveSite:
        """The engine's ``CollectiveSite`` for this record."""
        return CollectiveSite(
            site_id=self.site_id, op=self.op, nbytes=int(self.nbytes), dtype=self.dtype,
            group=self.group.name, group_size=self.group.size, n_nodes=self.group.n_nodes,
            calls_per_iter=max(1, calls_per_iter or self.calls),
        )


@dataclass(kw_only=True, slots=True)
class Stream:
    """One call stream (group, kind): its call counter and the site id of each call position.

    ``next_id`` is what a routed call pays for its site id: a counter step and a list index.
    """

    prefix: str
    """``<group>.<kind>[<stage>``: the id of position ``i`` is ``f"{prefix}{i}]"``."""
    count: int = 0
    period: int | None = None
    ids: list[str] = field(default_factory=list)
    """Site id of each call position (formatted once)."""

    def next_id(self) -> str:
        """Site id of the next call (position ``count % period``; ``count`` before the period is known)."""
        n = self.count
        self.count = n + 1
        if self.period:
            n %= self.period
        ids = self.ids
        if n < len(ids):
            return ids[n]
        ids.extend(f"{self.prefix}{i}]" for i in range(len(ids), n + 1))
        return ids[n]


class SiteRegistry:
    """Assigns site ids and keeps one ``SiteRecord`` per site seen in the current iteration.

    Args:
        groups: the ``GroupNames`` of this rank.
        num_microbatches: micro-batches per iteration (folds per-micro-batch call streams).
    """

    def __init__(self, groups: GroupNames, *, num_microbatches: int = 1, pp_stage: int | None = None) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1; got {num_microbatches}")
        self.groups = groups
        self.num_microbatches = num_microbatches
        self.stage = f"stage{pp_stage}." if pp_stage is not None else ""
        """Prefix of the ids of stage-local groups under pipeline parallelism (``stage1.``)."""
        self.records: dict[str, SiteRecord] = {}
        self.recording = True
        """Whether this iteration's calls are recorded in ``records`` (see ``start_iteration``)."""
        self._bucket_tags: dict[int, str] = {}
        self._streams: dict[tuple[str, str, bool], Stream] = {}
        self._keep: list[Any] = []

    # -------------------------------------------------------------- structure
    def bind_model(self, model_chunks: Iterable[Any]) -> int:
        """Tags every DDP bucket group of every model chunk ``chunk{c}.bucket{i}``; returns the count.

        ``model_chunks`` are Megatron ``DistributedDataParallel`` modules (one per virtual pipeline
        stage); expert-parallel bucket groups are tagged ``chunk{c}.expert_bucket{i}``.
        """
        n = 0
        for c, chunk in enumerate(model_chunks):
            for attr, word in (("bucket_groups", "bucket"), ("expert_parallel_bucket_groups", "expert_bucket")):
                for i, bg in enumerate(getattr(chunk, attr, None) or []):
                    self._bucket_tags[id(bg)] = f"{self.stage}chunk{c}.{word}{i}"
                    self._keep.append(bg)
                    n += 1
        return n

    def bucket_tag(self, bucket_group: Any) -> str | None:
        """The structural tag of a bucket group, or None when ``bind_model`` did not see it."""
        return self._bucket_tags.get(id(bucket_group))

    # -------------------------------------------------------------- iterations
    def start_iteration(self, *, record: bool = True) -> None:
        """Forgets the records of the previous iteration and restarts every call stream.

        Args:
            record: keep a ``SiteRecord`` of every call of this iteration. False once a plan is
                applied (records are read only while tuning): the call streams still advance, so
                site ids and routing are the same, but a call's first sight in the iteration no
                longer sizes its tensor and builds a record (several microseconds on a cache-cold
                call).
        """
        self.records = {}
        self.recording = record
        for s in self._streams.values():
            s.count = 0

    def finish_iteration(self) -> None:
        """Fixes the period of every stream that has none yet from this iteration's call count."""
        for (_, _, per_mb), s in self._streams.items():
            if s.period is None and s.count:
                m = self.num_microbatches if per_mb else 1
                s.period = s.count // m if s.count % m == 0 else s.count

    # -------------------------------------------------------------- ids
    def stream(self, group: GroupInfo, kind: str, *, per_microbatch: bool = True) -> Stream:
        """The call stream (group, kind), created on first use; callers may keep it (it is never replaced)."""
        key = (group.name, kind, per_microbatch)
        s = self._streams.get(key)
        if s is None:
            stage = self.stage if group.name in STAGE_LOCAL_GROUPS else ""
            s = self._streams[key] = Stream(prefix=f"{group.name}.{kind}[{stage}")
        return s

    def stream_site_id(self, group: GroupInfo, kind: str, *, per_microbatch: bool = True) -> tuple[str, int]:
        """Site id of the next call of stream (group, kind) and the calls per iteration it stands for."""
        s = self.stream(group, kind, per_microbatch=per_microbatch)
        return s.next_id(), (self.num_microbatches if per_microbatch and s.period else 1)

    def record(self, site_id: str, *, op: str, nbytes: int, dtype: str, group: GroupInfo) -> SiteRecord:
        """Counts one call of ``site_id`` (creating its record on first sight this iteration)."""
        rec = self.records.get(site_id)
        if rec is None:
            rec = self.records[site_id] = SiteRecord(site_id=site_id, op=op, nbytes=nbytes, dtype=dtype, group=group)
        elif nbytes > rec.nbytes:
            rec.nbytes = nbytes
        rec.calls += 1
        return rec

    def record_tensor(self, site_id: str, *, op: str, tensor: Any, group: GroupInfo) -> None:
        """``record`` that sizes ``tensor`` only on the first call of the site in an iteration.

        Calls of one site id carry tensors of one size (ids are per call position), so later
        calls only count; this keeps the per-call cost to two dict operations.
        """
        rec = self.records.get(site_id)
        if rec is None:
            self.records[site_id] = SiteRecord(site_id=site_id, op=op, nbytes=tensor_nbytes(tensor),
                                               dtype=dtype_name(tensor), group=group, calls=1)
        else:
            rec.calls += 1

    def sites(self) -> list[CollectiveSite]:
        """The sites of the current iteration as engine ``CollectiveSite`` records, sorted by id.

        A group of one rank (e.g. DP = 1) is never a site: its collective moves no data, so there
        is nothing to profile, tune or give a pool entry."""
        return [self.records[k].to_site() for k in sorted(self.records) if self.records[k].group.size > 1]


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(tensor: Any) -> str:
    """``torch.float32`` -> ``float32`` (the first tensor's for a list of tensors)."""
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0] if tensor else None
    dtype = getattr(tensor, "dtype", "unknown")
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # formatted once per dtype
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def tensor_nbytes(x: Any) -> int:
    """Bytes of a tensor or of a list/tuple of tensors (0 for anything else)."""
    if isinstance(x, (list, tuple)):
        return sum(tensor_nbytes(t) for t in x)
    numel = getattr(x, "numel", None)
    if numel is None:
        return 0
    return int(numel()) * int(x.element_size())
