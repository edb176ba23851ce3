"""NCCL communicator-pool entries: process groups over the same ranks with their own config, made on every rank."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from lagom_megatron.engine.files import write_text_atomic
from lagom_megatron.engine.knobs import P2P_OPS, CommConfig
from lagom_megatron.engine.plan import Plan
from lagom_megatron.nccl.capabilities import Capabilities
from lagom_megatron.nccl.options import (
    TUNER_COMM_TAG_ENV,
    TUNER_CONFIG_ENV,
    TUNER_NO_TABLE,
    build_options,
    check_env_conflicts,
    nccl_config_fields,
    nccl_module_parts,
    nccl_options_for,
    runtime_nccl_version,
)

log = logging.getLogger("lagom.pool")


@contextlib.contextmanager
def scoped_env(values: Mapping[str, str], environ: Any = None) -> Iterator[None]:
    """Sets ``values`` in the environment for the ``with`` body, then restores what was there."""
    environ = os.environ if environ is None else environ
    saved = {k: environ.get(k) for k in values}
    try:
        environ.update(values)
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                environ.pop(k, None)
            else:
                environ[k] = old


def create_nccl_pool_entry(
    ranks: list[int],
    config: CommConfig,
    *,
    tag: str,
    use_tuner_plugin: bool,
    op: str | None = None,
    tuner_table: str | os.PathLike | None = None,
    high_priority_stream: bool = False,
    timeout: Any = None,
    inherited: Mapping[str, Any] | None = None,
    next_comm: Callable[[str | None, str | None], bool] | None = None,
) -> Any:
    """One pool entry (collective); ``tag``: its commTag, group_desc, commName; ``inherited``: unset ``ncclConfig_t``
    fields, stream priority (``ProcessGroupNCCL.hpp`` ``initNCCLComm``); ``next_comm``: ``plugin_status.set_next_comm``
    (tests stand in); RuntimeError: no NCCL; ValueError."""
    torch, pg_nccl, dist = nccl_module_parts()
    if not torch.cuda.is_available():
        raise RuntimeError("NCCL is not available: no CUDA device is visible")
    if not dist.is_initialized():
        raise RuntimeError(
            "NCCL is not available: torch.distributed is not initialized (call init_process_group first)"
        )
    bound = nccl_config_fields(pg_nccl.Options)
    mapping = entry_options(
        config, tag=tag, use_tuner_plugin=use_tuner_plugin, op=op, fields=bound, nccl_version=runtime_nccl_version()
    )
    fields = dict((inherited or {}).get("config", {}))
    fields.update(mapping["config"])
    if "comm_name" in bound:
        # ncclConfig_t.commName (2.27+; torch init.cpp @ce00583b binds none): NCCL gives it to the profiler's init
        # (v2.30.7 src/plugin/profiler.cc:250), which keys its records, as the tuner's rows, by it
        fields["comm_name"] = tag
    if config.high_priority_stream is not None:
        high_priority_stream = bool(config.high_priority_stream)
    elif inherited is not None:
        high_priority_stream = bool(inherited.get("is_high_priority_stream", high_priority_stream))
    opts = build_options(fields, options_cls=pg_nccl.Options, high_priority_stream=high_priority_stream)
    env = dict(mapping["env"])
    table = TUNER_NO_TABLE if tuner_table is None else os.fspath(tuner_table)
    # the plugin, mapped since NCCL's first communicator, takes the tag and table in-process (no setenv, N11)
    in_process = (next_comm or _set_next_comm)(env.get(TUNER_COMM_TAG_ENV, ""), table)
    if in_process:
        env.pop(TUNER_COMM_TAG_ENV, None)
    else:
        env[TUNER_CONFIG_ENV] = table
    device = torch.device("cuda", torch.cuda.current_device())
    kwargs: dict[str, Any] = {"ranks": sorted(ranks), "backend": "nccl", "pg_options": opts, "timeout": timeout}
    params = inspect.signature(dist.new_group).parameters
    if "group_desc" in params:
        kwargs["group_desc"] = tag
    if "device_id" in params:
        kwargs["device_id"] = device
    try:
        with scoped_env(env):
            group = dist.new_group(**kwargs)
            if dist.get_rank() in ranks:
                # Force the communicator into existence while its names are set.
                probe = torch.zeros(1, device=device)
                dist.all_reduce(probe, group=group)
                torch.cuda.synchronize(device)
    finally:
        if in_process:
            (next_comm or _set_next_comm)(None, None)
    return group


def entry_options(
    config: CommConfig,
    *,
    tag: str,
    use_tuner_plugin: bool,
    op: str | None = None,
    fields: Any = None,
    nccl_version: tuple[int, int, int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """The checks of ``create_nccl_pool_entry`` needing no collective (run first on every rank); ValueError."""
    env = os.environ if environ is None else environ
    check_env_conflicts(env, use_tuner_plugin=use_tuner_plugin, config=config)
    return nccl_options_for(
        config, fields=fields, nccl_version=nccl_version, use_tuner_plugin=use_tuner_plugin, op=op, tag=tag
    )


def parent_options(group: Any) -> dict[str, Any] | None:
    """Stream priority and non-default ``ncclConfig_t`` fields of a Megatron NCCL group; None without NCCL."""
    try:
        torch, pg_nccl, _ = nccl_module_parts()
        backend = group._get_backend(torch.device("cuda"))
        opts = backend.options
    except Exception:  # noqa: BLE001 - no NCCL backend on this group: nothing to inherit
        return None
    fresh = pg_nccl.Options().config
    config = {}
    for name in nccl_config_fields(pg_nccl.Options) - {"blocking"}:
        value = getattr(opts.config, name, None)
        if value != getattr(fresh, name, None):
            config[name] = value
    return {"is_high_priority_stream": bool(opts.is_high_priority_stream), "config": config}


def comm_tag(desc: str) -> str:
    """The plugin tag (``commTag``, at most 63 characters) of a pool entry whose ``group_desc`` is ``desc``."""
    import hashlib

    tag = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_.:/-[]") else "_" for ch in desc) or "_"
    if len(tag) > 63:
        tag = f"{tag[:54]}_{hashlib.sha256(desc.encode()).hexdigest()[:8]}"
    return tag


def pool_entry_tag(group: str, entry: str) -> str:
    """``"<group>/<entry>"`` through ``comm_tag``; rows tagged ``group`` reach all its entries."""
    return comm_tag(f"{group}/{entry}")


@contextlib.contextmanager
def comm_tag_scope(tag: str, environ: Any = None) -> Iterator[None]:
    """Sets ``LAGOM_TUNER_COMM_TAG`` for communicators created eagerly in the body; ValueError: a refused tag."""
    nccl_options_for(CommConfig(), tag=tag)
    with scoped_env({TUNER_COMM_TAG_ENV: tag}, environ):
        yield


def _group_from_desc(desc: str) -> tuple[str, str] | None:
    rest = desc[len("LAGOM_POOL_") :] if desc.startswith("LAGOM_POOL_") else None
    if not rest:
        return None
    for marker in ("_plugin", "_env"):  # first element of NcclPoolBackend.entry_key
        i = rest.find(marker + "_")
        if i < 0 and rest.endswith(marker):
            i = len(rest) - len(marker)
        if i > 0:
            return rest[:i].lower(), rest[i + 1 :]
    return None


RING_BUFFER_BYTES = 524_288 + 4_915_200 + 4_194_304
"""Bytes per ring channel and rank: LL + LL128 + Simple (2.30 ``src/init.cc:810-824``,
``src/include/device.h:26, 97-98, 114-115``)."""
NVLS_BYTES_PER_CHANNEL_HEAD = 2 * 128 * 1024 * 8
"""NVLS buffers per channel and NVLS head, bytes (``src/transport/nvls.cc:425-430``; ``NCCL_NVLS_CHUNKSIZE`` :160)."""
ASSUMED_CHANNELS = 32


def estimate_entry_bytes(n_channels: int | None, *, nvls_heads: int = 0) -> int:
    """Device bytes one entry's communicator may allocate: ring and NVLS buffers, not tree, P2P or host memory."""
    n = ASSUMED_CHANNELS if n_channels is None else int(n_channels)
    return n * RING_BUFFER_BYTES + (n * NVLS_BYTES_PER_CHANNEL_HEAD * nvls_heads if nvls_heads > 0 else 0)


class NcclPoolBackend:
    """``megatron.pool.comm_pool.PoolBackend`` on NCCL: one entry per distinct config, or with the plugin per-call knobs
    from its table and ``min = max`` CTAs = the group's largest planned count, as NCCL caps the tuner's ``*nChannels``
    at the communicator's (v2.30.7 ``src/enqueue.cc:583``, :598-599; ``src/graph/connect.cc:503-505``)."""

    name = "nccl"

    def __init__(
        self,
        use_tuner_plugin: bool = False,
        tuner_table: str | os.PathLike | None = None,
        status_reader: Callable[[], Any] | None = None,
    ) -> None:
        self.use_tuner_plugin = bool(use_tuner_plugin)
        self.tuner_table = tuner_table
        self.table_id: str | None = None
        self.plugin_active = self.use_tuner_plugin
        self.cta_bound: int | None = None
        self.cta_bounds: dict[str, int] = {}
        """Group -> CTA bounds of its plugin-mode entries (``cta_bound`` where no group applies; None = NCCL's)."""
        self.p2p_configs: dict[str, set[CommConfig]] = {}
        """Group -> its P2P sites' configs (entries bounded at their own channel count, ``comm->p2pnChannels``)."""
        self.nvls_heads = 0
        self.status_reader = status_reader
        self._inits_before: int | None = None
        self._failures_before = 0

    @property
    def uses_table(self) -> bool:
        """True while per-call knobs travel through the plan table."""
        return self.use_tuner_plugin and self.plugin_active

    # Each method below changes ``entry_key``: call ``CommPool.invalidate_keys()`` after it.
    def configure(self, capabilities: Capabilities) -> None:
        """The mechanism (``tuner``: the plugin's table) and NVLS heads of the agreed ``nccl.capabilities``."""
        self.use_tuner_plugin = self.plugin_active = capabilities.mechanism() == "tuner"
        self.nvls_heads = capabilities.ranks_per_node if capabilities.nvls_multicast else 0

    def start_probes(self) -> bool:
        """Per-communicator entries until the next ``set_cta_bounds`` (no table exists yet); True in plugin mode."""
        self.plugin_active = False
        return self.use_tuner_plugin

    def set_cta_bounds(self, plan: Plan) -> bool:
        """Plugin mode (else False): each group's CTA bound its sites' largest planned count; P2P keeps its own."""
        if not self.use_tuner_plugin:
            return False
        self.plugin_active = True
        bounds: dict[str, int] = {}
        p2p: dict[str, set[CommConfig]] = {}
        for e in plan.entries.values():
            if e.op in P2P_OPS:
                if not e.config.is_default():
                    p2p.setdefault(e.group, set()).add(e.config)
            elif e.config.n_channels:
                bounds[e.group] = max(bounds.get(e.group, 0), int(e.config.n_channels))
        self.cta_bounds, self.cta_bound, self.p2p_configs = bounds, max(bounds.values(), default=None), p2p
        return True

    def load_table(self, plan: Plan, path: str | os.PathLike, text: str) -> bool:
        """Plugin mode (else False): ``set_cta_bounds(plan)`` and the table ``text`` written at ``path``; OSError."""
        if not self.set_cta_bounds(plan):
            return False
        write_text_atomic(path, text)
        with open(path, encoding="utf-8") as f:  # what the plugin will read: readable here, or fail now
            f.read(1)
        self.tuner_table, self.table_id = str(path), plan.digest()[:12]
        return True

    def _entry_config(self, config: CommConfig, group: str | None = None) -> CommConfig:
        if self.uses_table:
            if config.n_channels is None:
                bound = None  # NCCL's own CTA bounds: it starts from comm->nChannels (src/enqueue.cc:2070)
            elif group is not None and config in self.p2p_configs.get(group, ()):
                bound = config.n_channels  # P2P: the bound is the knob (engine.p2p), no row applies
            else:  # a group the plan gives no channel count keeps NCCL's own (None)
                bound = self.cta_bounds.get(group) if group is not None and self.cta_bounds else self.cta_bound
            return CommConfig(
                n_channels=bound,
                cta_policy=config.cta_policy,
                cga_cluster_size=config.cga_cluster_size,
                net_peer_channels=config.net_peer_channels,
                high_priority_stream=config.high_priority_stream,
            )
        return CommConfig(
            n_channels=config.n_channels,
            algorithm=config.algorithm,
            protocol=config.protocol,
            cta_policy=config.cta_policy,
            cga_cluster_size=config.cga_cluster_size,
            net_peer_channels=config.net_peer_channels,
            high_priority_stream=config.high_priority_stream,
        )

    def entry_key(self, config: CommConfig, group: str | None = None) -> tuple | None:
        """None if the group's own communicator serves ``config``, else its communicator-scope key (ValueError)."""
        entry = self._entry_config(config, group)
        nccl_options_for(entry, use_tuner_plugin=self.uses_table)
        if config.is_default() or (not self.uses_table and entry.is_default()):
            return None  # e.g. only chunk_size, which needs the plugin: nothing an entry can apply

        def part(v: Any) -> str:
            return "any" if v is None else str(v)

        peer = () if entry.net_peer_channels is None else ("npp", str(entry.net_peer_channels))
        if entry.high_priority_stream:
            peer += ("hp",)  # a stream priority is the process group's: its own entry
        if self.uses_table:  # the table is part of the key: the plugin reads it at communicator creation
            return (
                "plugin",
                part(entry.cta_policy),
                part(entry.cga_cluster_size),
                part(entry.n_channels),
                self.table_id or "env-table",
                *peer,
            )
        return (
            "env",
            part(entry.n_channels),
            part(entry.algorithm),
            part(entry.protocol),
            part(entry.cta_policy),
            part(entry.cga_cluster_size),
            *peer,
        )

    def estimate_bytes(self, config: CommConfig, group: str | None = None) -> int:
        """``estimate_entry_bytes`` of the entry of ``group`` that serves ``config``."""
        return estimate_entry_bytes(self._entry_config(config, group).n_channels, nvls_heads=self.nvls_heads)

    def preflight(self, config: CommConfig, op: str | None = None, group: str | None = None) -> None:
        """The checks of ``config``'s entry that need no collective (``entry_options``); ValueError."""
        try:
            fields = nccl_config_fields()
        except RuntimeError:
            fields = None  # no NCCL here (CPU): checked against every known field
        entry_options(
            self._entry_config(config, group),
            tag="_",
            use_tuner_plugin=self.uses_table,
            op=op,
            fields=fields,
            nccl_version=runtime_nccl_version(),
        )
        if self.uses_table and self._inits_before is None:
            status = (self.status_reader or _read_status)()
            self._inits_before = status.init_count if status is not None else 0
            self._failures_before = getattr(status, "table_failures", 0) if status is not None else 0

    def verify(self) -> None:
        """Plugin mode: RuntimeError unless the plugin initialised the new communicators and loaded the plan table."""
        if not self.uses_table:
            return
        before, self._inits_before = self._inits_before, None
        status = (self.status_reader or _read_status)()
        if status is None:
            raise RuntimeError("lagom's tuner plugin is not loaded by NCCL in this process")
        if before is not None and status.init_count <= before:
            raise RuntimeError(
                f"NCCL did not initialise lagom's plugin for the new entries (init count "
                f"{status.init_count}, {before} before)"
            )
        failures_before, self._failures_before = self._failures_before, 0
        failed = before is not None and status.table_failures > failures_before
        if not status.table_loaded or failed:
            # table_loaded may be an earlier plan's; a failure since the preflight is this one's (plugin/table.c)
            raise RuntimeError(
                f"lagom's plugin did not load the plan table {self.tuner_table or '(environment)'}"
                f" ({status.table_failures - failures_before} failed load(s) in NCCL's log, 'LAGOM/tuner')"
            )

    def tag_for(self, desc: str, group: str | None = None) -> str:
        """The entry's tuner tag: ``"<group>/<key>"`` from ``LAGOM_POOL_<GROUP>_<key>``, else ``comm_tag(desc)``."""
        parsed = _group_from_desc(desc)
        if group is not None:
            return pool_entry_tag(group, parsed[1] if parsed else desc)
        return pool_entry_tag(*parsed) if parsed else comm_tag(desc)

    def create_group(
        self, ranks: tuple[int, ...], config: CommConfig, desc: str, *, group: str | None = None, parent: Any = None
    ) -> Any:
        """Creates the entry (``create_nccl_pool_entry``), inheriting ``parent``'s options; collective."""
        return create_nccl_pool_entry(
            list(ranks),
            self._entry_config(config, group),
            tag=self.tag_for(desc, group),
            use_tuner_plugin=self.uses_table,
            tuner_table=self.tuner_table if self.uses_table else None,
            inherited=parent_options(parent) if parent is not None else None,
        )

    def register_memory(self, group: Any, pools: list[tuple[Any, bool]]) -> None:
        """Registers (``MemPool``, symmetric) pairs on this entry's own communicator as megatron-core does on its group
        (core_v0.16.1 ``nccl_allocator.py:163-182``); RuntimeError: a refused registration. The tuner sees local
        registrations through ``ncclRegFind`` (v2.30.7-1 ``src/enqueue.cc:2141-2146``); copy engines and symmetric
        kernels need a ``NCCL_WIN_COLL_SYMMETRIC`` window of this communicator (``ncclDevrFindWindow``,
        ``ncclGetSymRegType``: ``src/enqueue.cc:3044-3055``, ``src/sym_kernels.cc:675-692``), which only ``symm=True``
        makes. The ``TypeError`` fallback and torch's nccl2 engine on a communicator without symmetric support
        (a warning, no error: ``nccl2/ProcessGroupNCCLUtils.cpp`` ``registerMemPool`` @02514e9) leave a plain
        registration, on which NCCL runs a ZERO entry's all-gather on SMs: the observed check reverts it."""
        import torch

        backend = group._get_backend(torch.device("cuda", torch.cuda.current_device()))
        for pool, symmetric in pools:
            try:
                backend.register_mem_pool(pool, symm=symmetric)
            except TypeError:  # a torch whose register_mem_pool has no symm argument
                if symmetric:
                    log.warning("this torch registers memory pools without symmetric windows: copy engines cannot run")
                backend.register_mem_pool(pool)

    def destroy_group(self, group: Any) -> None:
        """Destroys one entry (``torch.distributed.destroy_process_group``; frees its communicator)."""
        import torch.distributed as dist

        dist.destroy_process_group(group)


def _set_next_comm(tag: str | None, table: str | None) -> bool:
    from lagom_megatron.nccl.plugin_status import set_next_comm

    return set_next_comm(tag, table)


def _read_status() -> Any:
    from lagom_megatron.nccl.plugin_status import read_plugin_status

    return read_plugin_status()


def group_share(budget_bytes: int, groups: Iterable[str]) -> int:
    """Equal share (bytes) of ``budget_bytes`` per distinct group, all of it when none; ValueError when negative."""
    if budget_bytes < 0:
        raise ValueError(f"pool budget must be >= 0 bytes; got {budget_bytes}")
    n = len(set(groups))
    return int(budget_bytes) // max(1, n)


def channel_cap(share_bytes: int, *, nvls_heads: int = 0, limit: int = 64) -> int:
    """Largest channel count 0..``limit`` whose pool entry fits ``share_bytes`` (0: the group keeps NCCL's count)."""
    cap = 0
    for n in range(1, int(limit) + 1):
        if estimate_entry_bytes(n, nvls_heads=nvls_heads) > share_bytes:
            break
        cap = n
    return cap
