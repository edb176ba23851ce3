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
    ep.dispatch_all_to_all_bwd[1]            its backward (``scopes.carry_backward``)
    tp.sp_all_gather[chunk0.decoder.layers.3.self_attention.linear_qkv]
                                             Transformer Engine layer: named by module path
    cp.ring_send_recv[chunk0.decoder.layers.3.self_attention.core_attention]
                                             TE's context-parallel KV ring of one attention module
    dp.fsdp_all_gather[decoder.layers.3]     torch FSDP2 unit (the fqn of its fully_shard module)
    dp.param_all_gather[chunk0.bucket3]      Megatron-FSDP unit 3 in backward order (``fsdp_bucket_tags``)

Streams of calls that have no structural index (TP, finalize, MoE) are numbered by call order
within one micro-batch: the first iteration (never timed) counts the calls of each stream, the
count divided by the number of micro-batches is the stream's period, and call ``n`` of a later
iteration is site ``n % period`` with ``calls_per_iter`` = micro-batches. Ranks of one group run
the same layers in the same order, so the numbering agrees across them.

Sites named by structure (``NamedSite``: a module path from ``name_modules`` or an FSDP unit's
fqn) have one id for all their calls; ``calls_per_iter`` is the number of calls seen.

Pipeline P2P is one site per pipeline, not one per stage pair: a send and its matching receive
must use the same communicator, and a call of the interleaved schedule touches both neighbours,
so the only routing that can never pair a send with a receive on another communicator is one
configuration for the whole pipeline. This is our design.

Group names are Megatron's process-group names (``parallel_state``'s ``dp``, ``dp_cp``, ``tp``,
``pp``, ``ep``, ``cp``, ...), resolved from the group object at setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.megatron.groups import STAGE_LOCAL_GROUPS, GroupInfo, GroupNames

__all__ = ["ONE_RANK", "GroupInfo", "GroupNames", "NamedSite", "SiteRecord", "SiteRegistry", "Stream", "STAGE_LOCAL_GROUPS",
           "dtype_name", "tensor_nbytes"]

ONE_RANK: Any = ()
"""What the router keeps for calls on a group of one rank (data, tensor, pipeline, expert or
context parallel 1, an FSDP group of one): never a site, since the collective moves no data, so
such calls pass straight through, unrecorded, unrouted and untimed, and no pool entry is made
for them."""


@dataclass(kw_only=True, slots=True)
class SiteRecord:
    """Registry record of one site in the current iteration (bytes of one call, calls so far)."""

    site_id: str
    op: str
    nbytes: int
    dtype: str
    group: GroupInfo
    calls: int = 0
    facts: dict | None = None
    """The call's reduction, coalesced parts and buffer registration (``call_facts``), as
    ``CollectiveSite`` fields; None: none recorded."""

    def to_site(self, *, calls_per_iter: int | None = None) -> CollectiveSite:
        """The engine's ``CollectiveSite`` for this record."""
        return CollectiveSite(
            site_id=self.site_id, op=self.op, nbytes=int(self.nbytes), dtype=self.dtype,
            group=self.group.name, group_size=self.group.size, n_nodes=self.group.n_nodes,
            calls_per_iter=max(1, calls_per_iter or self.calls), **(self.facts or {}),
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
        return ids[n] if n < len(ids) else self.id_at(n)

    def id_at(self, n: int) -> str:
        """Site id of call position ``n`` (formatted once, with every position before it)."""
        ids = self.ids
        ids.extend(f"{self.prefix}{i}]" for i in range(len(ids), n + 1))
        return ids[n]


class NamedSite:
    """A site named by structure (module path or FSDP unit): every call has the same id.

    It has ``next_id`` like ``Stream`` so that the router treats both alike.
    """

    __slots__ = ("site_id",)

    def __init__(self, site_id: str) -> None:
        self.site_id = site_id

    def next_id(self) -> str:
        """The site id (the same for every call)."""
        return self.site_id


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
        self.registered_pools: dict[str, list] = {}
        """Group name -> the NCCL memory pools its DDP buffers are registered in (``call_facts``)."""
        self._bucket_tags: dict[int, str] = {}
        self._fsdp_buffers: dict[int, int] = {}
        """``id`` of a Megatron-FSDP ``ParamAndGradBuffer`` -> its model chunk (``bind_model``)."""
        self._module_names: dict[int, str] = {}
        self._named: dict[tuple[str, str, str], "NamedSite"] = {}
        self._streams: dict[tuple[str, str, bool], Stream] = {}
        self._keep: list[Any] = []

    # -------------------------------------------------------------- structure
    def bind_model(self, model_chunks: Iterable[Any]) -> int:
        """Tags every DDP bucket group of every model chunk ``chunk{c}.bucket{i}``; returns the count.

        ``model_chunks`` are Megatron ``DistributedDataParallel`` modules (one per virtual pipeline
        stage); expert-parallel bucket groups are tagged ``chunk{c}.expert_bucket{i}``. A chunk
        wrapped by Megatron-FSDP (its ``param_and_grad_buffer``) has its buckets tagged by
        ``fsdp_bucket_tags`` instead and counts one.
        """
        n = 0
        for c, chunk in enumerate(model_chunks):
            self.name_modules(chunk, prefix=f"chunk{c}.")
            buffer = getattr(chunk, "param_and_grad_buffer", None)
            if buffer is not None and hasattr(buffer, "parameter_groups"):  # Megatron-FSDP
                self._fsdp_buffers[id(buffer)] = c
                self._keep.append(buffer)
                n += 1
            for attr, word in (("bucket_groups", "bucket"), ("expert_parallel_bucket_groups", "expert_bucket")):
                for i, bg in enumerate(getattr(chunk, attr, None) or []):
                    self._bucket_tags[id(bg)] = f"{self.stage}chunk{c}.{word}{i}"
                    self._keep.append(bg)
                    n += 1
        return n

    def name_modules(self, root: Any, *, prefix: str = "") -> int:
        """Names every submodule of ``root`` by its path, wrapper prefixes (``module.``) dropped.

        ``chunk0.decoder.layers.3.self_attention.linear_qkv``: the same on every rank of a stage
        and every run of one model, so sites named after it are stable. Returns the count.
        """
        named = getattr(root, "named_modules", None)
        if named is None:
            return 0
        n = 0
        for path, module in named():
            parts = path.split(".")
            while parts and parts[0] == "module":
                parts = parts[1:]
            self._module_names.setdefault(id(module), prefix + (".".join(parts) or "root"))
            self._keep.append(module)
            n += 1
        return n

    def module_name(self, module: Any) -> str:
        """The path ``name_modules`` gave ``module``; a module it never saw is named by its class and
        the order in which such modules are first seen (the same on ranks that build one model)."""
        name = self._module_names.get(id(module))
        if name is None:
            name = self._module_names[id(module)] = f"{type(module).__name__}{len(self._module_names)}"
            self._keep.append(module)
        return name

    def named_site(self, group: GroupInfo, kind: str, name: str) -> "NamedSite":
        """The site ``<group>.<kind>[<stage><name>]`` (stage only for stage-local groups), created once."""
        key = (group.name, kind, name)
        site = self._named.get(key)
        if site is None:
            stage = self.stage if group.name in STAGE_LOCAL_GROUPS else ""
            site = self._named[key] = NamedSite(f"{group.name}.{kind}[{stage}{name}]")
        return site

    def fsdp_bucket_tags(self, buffer: Any) -> list[str] | None:
        """The structural tag of each bucket of a Megatron-FSDP ``ParamAndGradBuffer`` (by bucket
        id), or None when ``bind_model`` did not see the buffer.

        Megatron-FSDP (megatron-core 0.16.1 ``distributed/fsdp/src/megatron_fsdp/
        param_and_grad_buffer.py:1271-1502``, 0.17.1 / 0.18.2 ``:1349-1580``,
        ``_get_parameter_groups``) puts the parameters of each FSDP unit module (a
        ``TransformerLayer``) in buckets by dtype, expert-ness and chunk-size factor, and coalesces
        the buckets of one unit and kind into one bucket group (key ``(fsdp_unit_id,
        is_expert_param)``, 0.16.1 ``:1475-1497``): a unit's non-expert buckets form one group, its
        expert buckets another, and every bucket of a group has the group's tag. Parameters
        outside every unit (embedding, final norm, output layer) get buckets of their own. Units
        are numbered in backward order like DDP buckets (the last layer is ``bucket0``), the same
        ids the simulator's FSDP workload uses (``sim/workload_fsdp.py``):
        ``{stage}chunk{c}.bucket{u}``, ``chunk{c}.expert_bucket{u}``; the buckets outside the
        units are ``chunk{c}.root_bucket{j}`` in bucket order.
        """
        c = self._fsdp_buffers.get(id(buffer))
        if c is None:
            return None
        groups = buffer.parameter_groups
        units = sorted({g.fsdp_unit_id for g in groups if g.fsdp_unit_id is not None})
        last = len(units) - 1
        position = {u: last - i for i, u in enumerate(units)}
        tags, root = [], 0
        for g in groups:
            if g.fsdp_unit_id is None:
                tags.append(f"{self.stage}chunk{c}.root_bucket{root}")
                root += 1
            else:
                word = "expert_bucket" if g.is_expert_param else "bucket"
                tags.append(f"{self.stage}chunk{c}.{word}{position[g.fsdp_unit_id]}")
        return tags

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

    def record(self, site_id: str, *, op: str, nbytes: int, dtype: str, group: GroupInfo,
               facts: dict | None = None) -> SiteRecord:
        """Counts one call of ``site_id`` (creating its record on first sight this iteration)."""
        rec = self.records.get(site_id)
        if rec is None:
            rec = self.records[site_id] = SiteRecord(site_id=site_id, op=op, nbytes=nbytes, dtype=dtype, group=group,
                                                     facts=facts)
        elif nbytes > rec.nbytes:
            rec.nbytes = nbytes
        rec.calls += 1
        return rec

    def record_tensor(self, site_id: str, *, op: str, tensor: Any, group: GroupInfo, facts: dict | None = None) -> None:
        """``record`` that sizes ``tensor`` only on the first call of the site in an iteration.

        Calls of one site id carry tensors of one size (ids are per call position), so later
        calls only count; this keeps the per-call cost to two dict operations.
        """
        rec = self.records.get(site_id)
        if rec is None:
            self.records[site_id] = SiteRecord(site_id=site_id, op=op, nbytes=tensor_nbytes(tensor),
                                               dtype=dtype_name(tensor), group=group, calls=1, facts=facts)
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
