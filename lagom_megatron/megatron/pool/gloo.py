"""gloo (the CPU backend): knob rules, pool entries with more worker threads, calls split into pieces. ``n_channels`` =
worker threads (``ProcessGroupGloo`` ``_threads``, torch default 2) per communicator; ``chunk_size`` = piece bytes per
call. Elementwise splits: bit-identical sums for two ranks, last-bit differences beyond. No torch for ``GlooRules``."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import (
    GLOO_DEFAULT_THREADS,
    GLOO_MAX_THREADS,
    KNOB_ORDER,
    CommConfig,
    Scope,
    chunk_domain,
    invalid_value,
)

GLOO_CHUNK_MIN = 4096
"""Smallest piece lagom splits a gloo tensor into, bytes (a multiple of it is required)."""

GLOO_SCOPES: dict[str, Scope] = {"n_channels": "communicator", "chunk_size": "call"}


@dataclass(frozen=True)
class GlooRules:
    """``engine.knobs.KnobRules`` on gloo; ValueError for another mechanism or a non-gloo cluster."""

    cluster: ClusterSpec
    mechanism: str = "gloo"
    backend: str = field(default="gloo", init=False)

    def __post_init__(self) -> None:
        if self.mechanism != "gloo":
            raise ValueError(f"mechanism for backend 'gloo' must be one of ['gloo']; got {self.mechanism!r}")
        if self.cluster.backend != "gloo":
            raise ValueError(
                f"cluster {self.cluster.name!r} is a {self.cluster.backend} cluster; gloo rules need a gloo cluster"
            )

    def scope(self, knob: str) -> Scope | None:
        if knob not in KNOB_ORDER:
            raise ValueError(f"knob must be one of {list(KNOB_ORDER)}; got {knob!r}")
        return GLOO_SCOPES.get(knob)

    def domains(
        self, *, op: str, n_nodes: int = 1, group_size: int = 2, reduce_op: str | None = None
    ) -> dict[str, tuple]:
        out: dict[str, tuple] = {k: (None,) for k in KNOB_ORDER}
        out["n_channels"] = (1, 2, 4)
        out["chunk_size"] = (None,) + chunk_domain(None, "gloo")
        return out

    def site_domains(self, site: Any) -> tuple[dict[str, tuple], str]:
        return self.domains(op=site.op, n_nodes=site.n_nodes, group_size=site.group_size), ""

    def for_sites(self, sites: Any) -> GlooRules:
        return self

    def registration(self, site: Any) -> None:
        """gloo registers no buffers."""
        return None

    def probe_configs(self) -> list[CommConfig]:
        return [CommConfig(n_channels=1), CommConfig(n_channels=4), CommConfig(n_channels=2, chunk_size=1048576)]

    def applicable(self, config: CommConfig, *, op: str) -> CommConfig:
        return CommConfig(n_channels=config.n_channels, chunk_size=config.chunk_size)

    def validate(
        self,
        config: CommConfig,
        *,
        op: str,
        n_nodes: int = 1,
        group_size: int | None = None,
        reduce_op: str | None = None,
        dtype: str | None = None,
    ) -> None:
        c = config
        for knob in (
            "algorithm",
            "protocol",
            "n_threads",
            "cta_policy",
            "cga_cluster_size",
            "net_peer_channels",
            "high_priority_stream",
        ):
            if getattr(c, knob) is not None:
                raise invalid_value(knob, getattr(c, knob), [None], "gloo has no such knob")
        if c.n_channels is not None and not (isinstance(c.n_channels, int) and 1 <= c.n_channels <= GLOO_MAX_THREADS):
            raise invalid_value("n_channels", c.n_channels, f"1..{GLOO_MAX_THREADS} gloo worker threads")
        if c.chunk_size is not None and not (
            isinstance(c.chunk_size, int) and c.chunk_size >= GLOO_CHUNK_MIN and c.chunk_size % GLOO_CHUNK_MIN == 0
        ):
            raise invalid_value("chunk_size", c.chunk_size, f"a multiple of {GLOO_CHUNK_MIN} bytes")

    def process_env(self, chosen: dict[str, list[int]]) -> dict[str, str]:
        return {}


class GlooPoolBackend:
    """``comm_pool.PoolBackend`` on gloo: ``n_channels`` -> worker threads of a new gloo group; no device memory."""

    name = "gloo"
    MAX_THREADS = GLOO_MAX_THREADS
    DEFAULT_THREADS = GLOO_DEFAULT_THREADS
    """Worker threads of a gloo group built by ``new_group`` (torch 2.x)."""

    def entry_key(self, config: CommConfig, group: str | None = None) -> Hashable | None:
        n = config.n_channels
        if n is None:
            return None
        if not 1 <= int(n) <= self.MAX_THREADS:
            raise ValueError(f"gloo n_channels (worker threads) must be in 1..{self.MAX_THREADS}; got {n}")
        if int(n) == self.DEFAULT_THREADS:
            return None
        return ("threads", int(n))

    def estimate_bytes(self, config: CommConfig, group: str | None = None) -> int:
        return 0

    def preflight(self, config: CommConfig, op: str | None = None, group: str | None = None) -> None:
        pass  # entry_key checks the threads

    def create_group(
        self, ranks: tuple[int, ...], config: CommConfig, desc: str, *, group: str | None = None, parent: Any = None
    ) -> Any:
        import torch.distributed as dist

        with gloo_threads(int(config.n_channels)):
            return dist.new_group(list(ranks), backend="gloo", group_desc=desc)

    def tag_for(self, desc: str, group: str | None = None) -> str:
        return desc

    def register_memory(self, group: Any, pools: list[tuple[Any, bool]]) -> None:
        pass

    def verify(self) -> None:
        pass

    def destroy_group(self, group: Any) -> None:
        import torch.distributed as dist

        dist.destroy_process_group(group)


@contextmanager
def gloo_threads(n_threads: int) -> Iterator[None]:
    """While active, gloo groups from ``new_group`` get ``n_threads`` workers (ValueError < 1), by a
    ``ProcessGroupGloo`` subclass (torch 2.x ignores gloo ``pg_options``; 2.14.1 ``distributed_c10d.py:669-676``)."""
    if n_threads < 1:
        raise ValueError(f"gloo worker threads must be >= 1; got {n_threads}")
    from torch.distributed import distributed_c10d as c10d

    original = c10d.ProcessGroupGloo

    class _ProcessGroupGlooWithThreads(original):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            store: Any,
            rank: int,
            size: int,
            timeout: datetime.timedelta = datetime.timedelta(minutes=30),
            **options: Any,
        ) -> None:
            opts = original._Options()
            opts._timeout = timeout
            opts._threads = n_threads
            opts._devices = [original.create_default_device()]
            for name, value in options.items():  # torch 2.14: enable_reconfigure=, also an _Options field
                if not hasattr(opts, name):
                    raise TypeError(f"ProcessGroupGloo got an unexpected keyword argument {name!r}")
                setattr(opts, name, value)
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = _ProcessGroupGlooWithThreads
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = original


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
    """Element ranges [lo, hi) of at most ``chunk_bytes`` bytes covering ``numel``; ValueError under one element."""
    per = chunk_bytes // element_size
    if per < 1:
        raise ValueError(f"chunk_size ({chunk_bytes} bytes) is smaller than one element ({element_size} bytes)")
    return [(lo, min(numel, lo + per)) for lo in range(0, numel, per)] or [(0, 0)]


def in_coalescing(group: Any) -> bool:
    """True while torch's ``_coalescing_manager`` records calls for ``group``."""
    from torch.distributed import distributed_c10d as c10d

    g = group if group is not None else c10d._get_default_group()
    return g in c10d._world.pg_coalesce_state


class GlooRecord:
    """What the gloo pool ran (``observed``) while ``on``: worker threads per call (``options._threads``), pieces."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[tuple[str, str, str, int], list] = {}
        """(group name, entry ``comm_key`` or "" for the own group, op, bytes) -> [calls, threads set, pieces set]."""
        self._threads: dict[int, int] = {}

    def start(self) -> None:
        """Forgets what was noted and starts noting."""
        self.calls.clear()
        self.on = True

    def stop(self) -> None:
        self.on = False

    def note(self, name: str, key: str, group: Any, op: str, nbytes: int, piece: int) -> None:
        """One call that ran on ``group``; ``piece``: its largest piece in bytes (0: issued whole)."""
        threads = self._threads.get(id(group))
        if threads is None:
            threads = self._threads[id(group)] = _gloo_threads(group)
        rec = self.calls.setdefault((name, key, op, int(nbytes)), [0, set(), set()])
        rec[0] += 1
        rec[1].add(threads)
        rec[2].add(int(piece))


def _gloo_threads(group: Any) -> int:
    import torch

    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return 0


def chunked_call(
    op: str,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    chunk_bytes: int,
    group_size: int,
    observe: Callable[[int], None] | None = None,
) -> Any:
    """Issues collective ``fn`` in pieces of at most ``chunk_bytes`` (``all_gather`` whole in a coalescing manager: no
    copy-back); ``MultiWork`` if ``async_op``, else None; ``observe`` gets the largest piece (bytes, 0: whole)."""

    def whole() -> Any:
        if observe is not None:
            observe(0)
        return fn(*args, **kwargs)

    async_op = bool(kwargs.get("async_op", False))
    kw = dict(kwargs)
    kw["async_op"] = True
    coalescing = in_coalescing(kwargs.get("group"))
    if op == "all_reduce":
        t = args[0]
        ranges = piece_ranges(t.numel(), t.element_size(), chunk_bytes)
        if len(ranges) <= 1 or not t.is_contiguous():
            return whole()
        flat = t.view(-1)
        works = [fn(flat[lo:hi], *args[1:], **kw) for lo, hi in ranges]
        after: list[Callable[[], None]] = []
    elif op == "reduce_scatter":
        out, inp = args[0], args[1]
        ranges = piece_ranges(out.numel(), out.element_size(), chunk_bytes)
        if len(ranges) <= 1 or not (out.is_contiguous() and inp.is_contiguous()):
            return whole()
        out_flat, inp_2d = out.view(-1), inp.reshape(group_size, -1)
        works = [fn(out_flat[lo:hi], inp_2d[:, lo:hi].contiguous().view(-1), *args[2:], **kw) for lo, hi in ranges]
        after = []
    elif op == "all_gather":
        out, inp = args[0], args[1]
        ranges = piece_ranges(inp.numel(), inp.element_size(), chunk_bytes)
        if len(ranges) <= 1 or coalescing or not (out.is_contiguous() and inp.is_contiguous()):
            return whole()
        inp_flat, out_2d = inp.view(-1), out.view(group_size, -1)
        works, after = [], []
        for lo, hi in ranges:
            tmp = out.new_empty((group_size, hi - lo))
            works.append(fn(tmp.view(-1), inp_flat[lo:hi], *args[2:], **kw))
            after.append(lambda tmp=tmp, lo=lo, hi=hi: out_2d[:, lo:hi].copy_(tmp))
    else:
        return whole()
    if observe is not None:
        observe(max(hi - lo for lo, hi in ranges) * (out.element_size() if op != "all_reduce" else t.element_size()))
    if coalescing:
        return works[0]
    handle = MultiWork(works, after)
    if async_op:
        return handle
    handle.wait()
    return None
