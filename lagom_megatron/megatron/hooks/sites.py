"""Collective sites: stable ids and records of Megatron-Core's overlapped collectives, from structure only, alike
across iterations and ranks (``dp.grad_reduce_scatter[chunk0.bucket1]``, ``pp.send_recv``: one per pipeline,
``tp.sp_all_gather[chunk0.decoder.layers.3.self_attention.linear_qkv]``); other streams by order in a micro-batch."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.megatron.groups import STAGE_LOCAL_GROUPS, GroupInfo, GroupNames

__all__ = [
    "ONE_RANK",
    "GroupInfo",
    "GroupNames",
    "NamedSite",
    "SiteRecord",
    "SiteRegistry",
    "Stream",
    "STAGE_LOCAL_GROUPS",
    "dtype_name",
    "tensor_nbytes",
]

ONE_RANK: Any = ()
"""For a group of one rank: never a site (no data moves); passed through unrecorded, unrouted, untimed."""


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

    def to_site(self, *, calls_per_iter: int | None = None) -> CollectiveSite:
        return CollectiveSite(
            site_id=self.site_id,
            op=self.op,
            nbytes=int(self.nbytes),
            dtype=self.dtype,
            group=self.group.name,
            group_size=self.group.size,
            n_nodes=self.group.n_nodes,
            calls_per_iter=max(1, calls_per_iter or self.calls),
            **(self.facts or {}),
        )


@dataclass(kw_only=True, slots=True)
class Stream:
    """One call stream (group, kind): its call counter and the site id of each call position."""

    prefix: str
    """``<group>.<kind>[<stage>``: the id of position ``i`` is ``f"{prefix}{i}]"``."""
    count: int = 0
    period: int | None = None
    ids: list[str] = field(default_factory=list)

    def next_id(self) -> str:
        """Site id of the next call (position ``count % period``; ``count`` before the period is known)."""
        n = self.count
        self.count = n + 1
        if self.period:
            n %= self.period
        ids = self.ids
        return ids[n] if n < len(ids) else self.id_at(n)

    def id_at(self, n: int) -> str:
        ids = self.ids
        ids.extend(f"{self.prefix}{i}]" for i in range(len(ids), n + 1))
        return ids[n]


class NamedSite:
    """A site named by structure (module path or FSDP unit): every call has the same id."""

    __slots__ = ("site_id",)

    def __init__(self, site_id: str) -> None:
        self.site_id = site_id

    def next_id(self) -> str:
        return self.site_id


class SiteRegistry:
    """Assigns site ids and keeps one ``SiteRecord`` per site seen in the current iteration."""

    def __init__(
        self,
        groups: GroupNames,
        *,
        num_microbatches: int = 1,
        pp_stage: int | None = None,
        registered_pools: dict[str, list] | None = None,
    ) -> None:
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1; got {num_microbatches}")
        self.groups = groups
        self.num_microbatches = num_microbatches
        self.stage = f"stage{pp_stage}." if pp_stage is not None else ""
        self.records: dict[str, SiteRecord] = {}
        self.recording = True
        self.registered_pools = registered_pools or {}
        self._bucket_tags: dict[int, str] = {}
        self._fsdp_buffers: dict[int, int] = {}
        self._module_names: dict[int, str] = {}
        self._named: dict[tuple[str, str, str], NamedSite] = {}
        self._streams: dict[tuple[str, str, bool], Stream] = {}
        self._keep: list[Any] = []

    def bind_model(self, model_chunks: Iterable[Any]) -> int:
        """Tags DDP bucket groups ``chunk{c}.bucket{i}`` / ``expert_bucket{i}``; the count (Megatron-FSDP chunk: 1)."""
        n = 0
        for c, chunk in enumerate(model_chunks):
            self.name_modules(chunk, prefix=f"chunk{c}.")
            buffer = getattr(chunk, "param_and_grad_buffer", None)
            if buffer is not None and hasattr(buffer, "parameter_groups"):
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
        """Names every submodule of ``root`` by its path, ``module.`` wrapper prefixes dropped; returns the count."""
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
        """The path ``name_modules`` gave ``module``; an unseen one is ``<class><n>`` in first-seen order."""
        name = self._module_names.get(id(module))
        if name is None:
            name = self._module_names[id(module)] = f"{type(module).__name__}{len(self._module_names)}"
            self._keep.append(module)
        return name

    def named_site(self, group: GroupInfo, kind: str, name: str) -> NamedSite:
        """The site ``<group>.<kind>[<stage><name>]`` (stage only for stage-local groups), created once."""
        key = (group.name, kind, name)
        site = self._named.get(key)
        if site is None:
            stage = self.stage if group.name in STAGE_LOCAL_GROUPS else ""
            site = self._named[key] = NamedSite(f"{group.name}.{kind}[{stage}{name}]")
        return site

    def fsdp_bucket_tags(self, buffer: Any) -> list[str] | None:
        """Tag per bucket of a bound Megatron-FSDP ``ParamAndGradBuffer``, else None. Units in backward order as in
        ``sim/workload_fsdp.py``: ``{stage}chunk{c}.bucket{u}`` / ``expert_bucket{u}``, else ``chunk{c}.root_bucket{j}``
        (``_get_parameter_groups``: a group per unit and kind; megatron-core 0.16.1 ``:1271-1502``, key ``:1475-1497``;
        0.17.1 / 0.18.2 ``:1349-1580`` of ``distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py``)."""
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

    def start_iteration(self, *, record: bool = True) -> None:
        """Forgets the previous iteration's records and restarts every call stream; ``record=False``: no records."""
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

    def stream(self, group: GroupInfo, kind: str, *, per_microbatch: bool = True) -> Stream:
        """The call stream (group, kind), created on first use and never replaced."""
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

    def record(
        self, site_id: str, *, op: str, nbytes: int, dtype: str, group: GroupInfo, facts: dict | None = None
    ) -> SiteRecord:
        """Counts one call of ``site_id`` (creating its record on first sight this iteration)."""
        rec = self.records.get(site_id)
        if rec is None:
            rec = self.records[site_id] = SiteRecord(
                site_id=site_id, op=op, nbytes=nbytes, dtype=dtype, group=group, facts=facts
            )
        elif nbytes > rec.nbytes:
            rec.nbytes = nbytes
        rec.calls += 1
        return rec

    def record_tensor(self, site_id: str, *, op: str, tensor: Any, group: GroupInfo, facts: dict | None = None) -> None:
        """``record`` that sizes ``tensor`` only on the site's first call in an iteration (one id, one size)."""
        rec = self.records.get(site_id)
        if rec is None:
            self.records[site_id] = SiteRecord(
                site_id=site_id,
                op=op,
                nbytes=tensor_nbytes(tensor),
                dtype=dtype_name(tensor),
                group=group,
                calls=1,
                facts=facts,
            )
        else:
            rec.calls += 1

    def sites(self) -> list[CollectiveSite]:
        """The current iteration's sites of groups over more than one rank, sorted by id."""
        return [self.records[k].to_site() for k in sorted(self.records) if self.records[k].group.size > 1]


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(tensor: Any) -> str:
    """``torch.float32`` -> ``float32`` (the first tensor's for a list of tensors)."""
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0] if tensor else None
    dtype = getattr(tensor, "dtype", "unknown")
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
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


OP_ARG = {"all_reduce": ("op", 1), "reduce_scatter": ("op", 2)}
"""(keyword, position) of the reduction in the torch functions the router wraps, per op."""


def reduce_op_name(op: Any) -> str:
    """torch's reduction as a lower-case name: ``ReduceOp.AVG`` -> ``avg``; None -> ``sum``."""
    if op is None:
        return "sum"
    op = getattr(op, "op", op)
    name = getattr(op, "name", None)
    return str(name if name is not None else op).rsplit(".", 1)[-1].lower()


def call_reduce_op(op: str, args: tuple, kwargs: dict) -> str | None:
    """The reduction of one wrapped call of ``op`` (None for an op that does not reduce)."""
    where = OP_ARG.get(op)
    if where is None:
        return None
    name, index = where
    value = kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)
    return reduce_op_name(value)


def bucket_reduce_op(bucket_group: Any, kind: str) -> str | None:
    """The reduction ``start_grad_sync`` uses for a bucket group; None for the parameter gather."""
    if kind != "grad":
        return None
    return "avg" if getattr(bucket_group.ddp_config, "average_in_collective", False) else "sum"


FP32_ALL_TO_ALL = "reduce_scatter_with_fp32_accumulation"
"""megatron-core's reduce-scatter by all-to-all, as ``param_and_grad_buffer`` imports it (``:29`` @core_v0.16.1, ``:44``
@core_v0.19.0)."""


def grad_all_to_all(bucket_group: Any) -> bool:
    """Whether the gradients' reduce-scatter of ``bucket_group`` is megatron-core's all-to-all with fp32 accumulation:
    ``--ddp-reduce-scatter-with-fp32-accumulation`` makes any bucket group's ``__init__`` rebind its module's
    ``dist_reduce_scatter_func`` (core_v0.16.1 ``param_and_grad_buffer.py:163-165``, core_v0.19.0 ``:247-249``, read at
    ``:443`` / ``:712``) to a function that calls ``all_to_all_single`` and sums locally
    (``reduce_scatter_with_fp32_accumulation.py:78`` @core_v0.16.1 to core_v0.19.0): NCCL runs it as send/recv."""
    module = sys.modules.get(type(bucket_group).__module__)
    fn = getattr(module, "dist_reduce_scatter_func", None)
    return fn is not None and getattr(fn, "__wrapped__", fn) is getattr(module, FP32_ALL_TO_ALL, None)


def bucket_parts(tensors: list[Any]) -> tuple[tuple[str, int], ...]:
    """(dtype, bytes) of each bucket tensor of one bucket-group call (empty for one tensor)."""

    if len(tensors) < 2:
        return ()
    return tuple((dtype_name(t), tensor_nbytes(t)) for t in tensors)


def bucket_registration(bucket_group: Any, pools: list | None) -> str:
    """``registered`` of a bucket group: ``""`` (no ``nccl_ub``), ``pool``, ``symmetric``, ``fixed`` (mcore < 0.18)."""
    if not getattr(bucket_group.ddp_config, "nccl_ub", False):
        return ""
    if not pools:
        return "fixed"
    return "symmetric" if any(symmetric for _, symmetric in pools) else "pool"


def registered_pools(model_chunks: Any, name_of: Any) -> dict[str, list[tuple[Any, bool]]]:
    """Group name -> [(NCCL memory pool, symmetric)] of the ``nccl_ub`` DDP buffers of ``model_chunks``;
    symmetric needs torch 2.9+ (core_v0.16.1 ``nccl_allocator.py:111-122, 244-263``) and no
    ``--disable-symmetric-registration`` (core_v0.19.0 ``param_and_grad_buffer.py:1132-1140``). The pool holds
    ``param_data`` and ``grad_data`` (``:1152-1188``), so a bucket's in-place all-gather into ``bucket.param_data``
    (``:502-520``) has both buffers in it; ``nccl_mem_pool`` is kept from core 0.18 (core_v0.19.0 ``:1127, 1135``):
    before it a group is left out. A buffer that ``reload_from_cpu`` re-grows (``:1634-1647``) lies outside the pool."""
    symm = _torch_at_least(2, 9)
    out: dict[str, list[tuple[Any, bool]]] = {}
    lost: set[str] = set()
    for chunk in model_chunks or ():
        for attr in ("buffers", "expert_parallel_buffers"):
            for buf in getattr(chunk, attr, None) or ():
                if not getattr(buf, "nccl_ub", False):
                    continue
                name = name_of(getattr(buf, "data_parallel_group", None))
                pool = getattr(buf, "nccl_mem_pool", None)
                if pool is None or name is None:
                    lost.add(str(name))
                    continue
                symmetric = symm and not getattr(buf.ddp_config, "disable_symmetric_registration", False)
                out.setdefault(name, []).append((pool, symmetric))
    return {k: v for k, v in out.items() if k not in lost}


def _torch_at_least(*version: int) -> bool:
    from lagom_megatron.megatron.hooks.versions import installed_torch, release

    found = installed_torch()
    try:
        return found is not None and release(found.version) >= version
    except ValueError:  # "unknown": no version in its source
        return False
