"""Communicator pool: process groups over the same ranks as a Megatron group, one per configuration.

A site whose configuration needs different communicator-scope options than its group's defaults
is routed to a *pool entry*: a process group over exactly the same ranks, in the same order,
created with that configuration's options (DESIGN.md section 5; what NCCL's maintainers
recommend for per-collective CTA limits). Per-call knobs travel with the call.

Backends (a small interface, ``PoolBackend``):

* ``gloo`` (CPU, implemented here): ``n_channels`` = worker threads of the gloo communicator
  (``ProcessGroupGloo`` options ``_threads``; torch's default is 2). ``chunk_size`` is per call:
  the tensor is split into pieces of at most that many bytes, issued as several async calls and
  returned as one handle (``MultiWork``). Splitting is elementwise, so every element is reduced
  over the same ranks with the same operation; for groups of two ranks the sums are bit-identical
  (a + b = b + a), for larger groups gloo's ring may add in another order (last-bit differences).
  All-gathers issued inside a coalescing manager (distributed-optimizer parameter all-gather)
  are not split: their pieces would need a copy after the coalesced wait, which torch's
  coalescing manager gives no place for.
* ``nccl`` (GPU): delegated to ``lagom_megatron.nccl.pool`` (ProcessGroupNCCL options,
  tuner-plugin table) when that module is present.

Entries are created eagerly and collectively: every rank calls ``CommPool.prepare`` with the same
needs (derived from an agreed plan or from the probe configs), the rank lists of every group of
a name are all-gathered over the world, and ``torch.distributed.new_group`` is called for each in
one sorted order on all ranks (``new_group`` must be called by every rank of the world).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol

from lagom_megatron.engine import knobs
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.megatron.sites import GroupInfo, GroupNames

log = logging.getLogger("lagom.pool")


class PoolBackend(Protocol):
    """Creates pool entries for one communication backend."""

    name: str

    def entry_key(self, config: CommConfig) -> Hashable | None:
        """The communicator-scope part of ``config``; None when the group's own communicator serves it."""

    def create_group(self, ranks: tuple[int, ...], config: CommConfig, desc: str) -> Any:
        """Creates one process group over ``ranks`` for ``config``; called collectively by all ranks."""


class GlooPoolBackend:
    """Gloo pool entries: ``n_channels`` -> worker threads of a new gloo group (see module docstring)."""

    name = "gloo"
    MAX_THREADS = knobs.GLOO_MAX_THREADS
    """Upper bound accepted for gloo worker threads (the engine's domain; each is an OS thread)."""
    DEFAULT_THREADS = knobs.GLOO_DEFAULT_THREADS
    """Worker threads of a gloo group built by ``new_group`` (torch 2.x; checked by the tests)."""

    def entry_key(self, config: CommConfig) -> Hashable | None:
        n = config.n_channels
        if n is None:
            return None
        if not 1 <= int(n) <= self.MAX_THREADS:
            raise ValueError(f"gloo n_channels (worker threads) must be in 1..{self.MAX_THREADS}; got {n}")
        if int(n) == self.DEFAULT_THREADS:
            return None  # the group's own communicator already has that many threads
        return ("threads", int(n))

    def create_group(self, ranks: tuple[int, ...], config: CommConfig, desc: str) -> Any:
        import torch.distributed as dist

        from lagom_megatron.megatron import patches

        with patches.gloo_threads(int(config.n_channels)):
            return dist.new_group(list(ranks), backend="gloo", group_desc=desc)


def make_backend(name: str) -> PoolBackend:
    """The pool backend for ``gloo`` or ``nccl``.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: ``nccl`` requested but ``lagom_megatron.nccl.pool`` is missing.
    """
    if name == "gloo":
        return GlooPoolBackend()
    if name == "nccl":
        try:
            from lagom_megatron.nccl import pool as nccl_pool# noqa: PLC0415
        except ImportError as exc:
            raise RuntimeError(f"nccl pool backend needs lagom_megatron.nccl.pool: {exc}") from None
        backend_cls = getattr(nccl_pool, "NcclPoolBackend", None)
        if backend_cls is None:
            raise RuntimeError("lagom_megatron.nccl.pool defines no NcclPoolBackend")
        return backend_cls()
    raise ValueError(f"pool backend must be one of 'gloo', 'nccl'; got {name!r}")


@dataclass(frozen=True, slots=True)
class _EntryId:
    name: str
    ranks: tuple[int, ...]
    key: Hashable


class CommPool:
    """Pool entries of one rank, looked up on every routed call (a dict lookup).

    Args:
        backend: a ``PoolBackend``.
        groups: the rank's ``GroupNames``; entries are registered in it as aliases of their group.
    """

    def __init__(self, backend: PoolBackend, groups: GroupNames) -> None:
        self.backend = backend
        self.groups = groups
        self._entries: dict[tuple[str, Hashable], Any] = {}
        self._created: set[_EntryId] = set()
        self._keys: dict[CommConfig, Hashable | None] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def invalidate_keys(self) -> None:
        """Forgets the cached entry keys: call it when the backend's mechanism changes (e.g. the
        NCCL backend switching from per-communicator probe entries to the plan's tuner table)."""
        self._keys.clear()

    def key(self, config: CommConfig) -> Hashable | None:
        """Cached ``backend.entry_key(config)``."""
        try:
            return self._keys[config]
        except KeyError:
            k = self._keys[config] = self.backend.entry_key(config)
            return k

    def prepare(self, needs: dict[str, set[CommConfig]] | dict[str, list[CommConfig]]) -> int:
        """Creates the entries that ``needs`` (group name -> configs) calls for; collective.

        Every rank must call this with the same ``needs``. Returns the number of groups created
        on this rank's side (entries it is a member of).
        """
        import torch.distributed as dist

        mine = {name: self.groups.by_name(name).ranks for name in self.groups.names()}
        gathered: list[dict[str, tuple[int, ...]]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine)
        wanted: set[_EntryId] = set()
        for name, configs in needs.items():
            keys = {self.key(c) for c in configs} - {None}
            all_ranks = sorted({d[name] for d in gathered if name in d})
            for ranks in all_ranks:
                for key in keys:
                    wanted.add(_EntryId(name, ranks, key))
        created = 0
        for eid in sorted(wanted - self._created, key=lambda e: (e.name, e.ranks, repr(e.key))):
            config = next(c for c in needs[eid.name] if self.key(c) == eid.key)
            desc = f"LAGOM_POOL_{eid.name.upper()}_{'_'.join(str(x) for x in _flat(eid.key))}"
            group = self.backend.create_group(eid.ranks, config, desc)
            self._created.add(eid)
            if dist.get_rank() in eid.ranks:
                info = self.groups.by_name(eid.name)
                if info is None or info.ranks != eid.ranks:
                    info = GroupInfo(name=eid.name, ranks=eid.ranks)
                self.groups.alias(group, info)
                self._entries[(eid.name, eid.key)] = group
                created += 1
        if created:
            log.info("lagom: communicator pool: %d entries on this rank (%s backend)", len(self._entries), self.backend.name)
        return created

    def group_for(self, info: GroupInfo, config: CommConfig) -> Any | None:
        """The pool entry of ``info``'s group for ``config``; None = use the group itself.

        Raises:
            KeyError: the config needs an entry that ``prepare`` did not create (names both).
        """
        key = self.key(config)
        if key is None:
            return None
        try:
            return self._entries[(info.name, key)]
        except KeyError:
            raise KeyError(f"no communicator-pool entry for group {info.name!r} and {config.to_dict()}; "
                           "CommPool.prepare was not called with it") from None


def _flat(key: Hashable) -> tuple:
    return key if isinstance(key, tuple) else (key,)


# ------------------------------------------------------------------ chunked calls (gloo chunk_size)


class MultiWork:
    """Several async ``Work`` handles as one; ``wait()`` waits for all, then runs the copy-backs."""

    __slots__ = ("works", "after")

    def __init__(self, works: list[Any], after: list[Callable[[], None]] | None = None) -> None:
        self.works = works
        self.after = after or []

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        for w in self.works:
            if w is not None:
                w.wait(*args, **kwargs)
        for fn in self.after:
            fn()
        self.after = []
        return True

    def is_completed(self) -> bool:
        return all(w is None or w.is_completed() for w in self.works)


def piece_ranges(numel: int, element_size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges [lo, hi) of at most ``chunk_bytes`` bytes each covering ``numel`` elements.

    Raises:
        ValueError: ``chunk_bytes`` smaller than one element.
    """
    per = chunk_bytes // element_size
    if per < 1:
        raise ValueError(f"chunk_size ({chunk_bytes} bytes) is smaller than one element ({element_size} bytes)")
    return [(lo, min(numel, lo + per)) for lo in range(0, numel, per)] or [(0, 0)]


def in_coalescing(group: Any) -> bool:
    """True while torch's ``_coalescing_manager`` records calls for ``group``."""
    from torch.distributed import distributed_c10d as c10d

    g = group if group is not None else c10d._get_default_group()
    return g in c10d._world.pg_coalesce_state


def chunked_call(op: str, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], chunk_bytes: int, group_size: int) -> Any:
    """Issues ``fn`` (a torch.distributed collective) as pieces of at most ``chunk_bytes`` bytes.

    ``op`` is ``all_reduce`` (args: tensor), ``reduce_scatter`` (args: output, input; input is
    ``group_size`` x output along the first dimension) or ``all_gather`` (args: output, input).
    Returns a ``MultiWork`` when ``async_op`` is set, else None after waiting; inside a coalescing
    manager it returns what the first piece returned (torch's placeholder). A tensor that fits in
    one piece is passed through unchanged, and so is any other op.
    """
    async_op = bool(kwargs.get("async_op", False))
    kw = dict(kwargs)
    kw["async_op"] = True
    coalescing = in_coalescing(kwargs.get("group"))
    if op == "all_reduce":
        t = args[0]
        ranges = piece_ranges(t.numel(), t.element_size(), chunk_bytes)
        if len(ranges) <= 1 or not t.is_contiguous():
            return fn(*args, **kwargs)
        flat = t.view(-1)
        works = [fn(flat[lo:hi], *args[1:], **kw) for lo, hi in ranges]
        after: list[Callable[[], None]] = []
    elif op == "reduce_scatter":
        out, inp = args[0], args[1]
        ranges = piece_ranges(out.numel(), out.element_size(), chunk_bytes)
        if len(ranges) <= 1 or not (out.is_contiguous() and inp.is_contiguous()):
            return fn(*args, **kwargs)
        out_flat, inp_2d = out.view(-1), inp.reshape(group_size, -1)
        works = [fn(out_flat[lo:hi], inp_2d[:, lo:hi].contiguous().view(-1), *args[2:], **kw) for lo, hi in ranges]
        after = []
    elif op == "all_gather":
        out, inp = args[0], args[1]
        ranges = piece_ranges(inp.numel(), inp.element_size(), chunk_bytes)
        if len(ranges) <= 1 or coalescing or not (out.is_contiguous() and inp.is_contiguous()):
            return fn(*args, **kwargs)
        inp_flat, out_2d = inp.view(-1), out.view(group_size, -1)
        works, after = [], []
        for lo, hi in ranges:
            tmp = out.new_empty((group_size, hi - lo))
            works.append(fn(tmp.view(-1), inp_flat[lo:hi], *args[2:], **kw))
            after.append(lambda tmp=tmp, lo=lo, hi=hi: out_2d[:, lo:hi].copy_(tmp))
    else:
        return fn(*args, **kwargs)
    if coalescing:
        return works[0]
    handle = MultiWork(works, after)
    if async_op:
        return handle
    handle.wait()
    return None
