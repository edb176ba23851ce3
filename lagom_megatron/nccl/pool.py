"""NCCL communicator-pool entries: process groups over the same ranks with their own NCCL config.

A site whose searched ``CommConfig`` differs from its group's other sites is routed to a pool entry:
a process group created with ``ProcessGroupNCCL.Options`` carrying the per-communicator knobs
(``options.nccl_options_for``). The entry is created eagerly with ``NCCL_ALGO`` / ``NCCL_PROTO``,
the tuner plugin's communicator tag (``LAGOM_TUNER_COMM_TAG``) and an explicit plan table
(``LAGOM_TUNER_CONFIG``: the plan's, or ``TUNER_NO_TABLE``) set, and the previous environment
restored right after: the plugin reads the tag in its ``init``, which NCCL runs in the
creating thread for blocking communicators.

Every rank of the job must create the same entries in the same order (``torch.distributed.new_group``
is collective over the default group). This module imports torch lazily.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.nccl.options import (
    TUNER_COMM_TAG_ENV, TUNER_CONFIG_ENV, TUNER_NO_TABLE, build_options, check_env_conflicts, nccl_config_fields, nccl_module_parts,
    nccl_options_for, runtime_nccl_version,
)


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


def create_nccl_pool_entry(ranks: list[int], config: CommConfig, *, tag: str, use_tuner_plugin: bool,
                           op: str | None = None, tuner_table: str | os.PathLike | None = None,
                           high_priority_stream: bool = False, timeout: Any = None,
                           inherited: Mapping[str, Any] | None = None) -> Any:
    """Creates one pool entry: an NCCL process group over ``ranks`` with ``config`` applied.

    Collective over the default group: every rank calls it with the same arguments in the same
    order. The communicator is created eagerly (``device_id`` where torch supports it, then a
    one-element all-reduce and a device synchronize) while NCCL_ALGO / NCCL_PROTO and the tuner
    tag are set, and the environment is restored afterwards.

    Args:
        ranks: global ranks of the entry (the same ranks as the site's group).
        config: the searched configuration for this entry.
        tag: communicator tag (the plan table's ``commTag``); also the group's ``group_desc`` and,
            where torch binds ``NCCLConfig.comm_name``, the communicator's ``commName``.
        use_tuner_plugin: the tuner plugin applies algorithm/protocol/channels per call (the
            agreed mechanism is ``tuner``: NCCL loaded lagom's plugin on every rank).
        op: the site's op, to scope NCCL_ALGO/NCCL_PROTO to its NCCL function.
        tuner_table: plan table the plugin reads for this communicator (``LAGOM_TUNER_CONFIG``
            during creation); None = explicitly none (``TUNER_NO_TABLE``: neither the process's
            ``LAGOM_TUNER_CONFIG`` nor ``NCCL_TUNER_CONFIG_FILE`` reaches a probe entry).
        high_priority_stream: ``Options.is_high_priority_stream`` where neither ``config`` nor
            ``inherited`` says.
        timeout: passed to ``new_group``.
        inherited: ``parent_options`` of the site's own group: its stream priority (unless
            ``config.high_priority_stream`` sets one: the plan's wins) and the ``ncclConfig_t``
            fields the entry's ``config`` does not set (Megatron's per-group
            ``--nccl-communicator-config-path`` CTAs / CGA / net_name, SHARP's ``collnet_enable``).
            torch takes the entry's NCCL stream from its pool at that priority when it creates the
            communicator (``ProcessGroupNCCL::initNCCLComm``: ``getStreamFromPool(
            options_->is_high_priority_stream || TORCH_NCCL_HIGH_PRIORITY)``; ``Options(bool
            is_high_priority_stream = false)`` in ``ProcessGroupNCCL.hpp``).

    Returns:
        The ``torch.distributed`` process group (``GroupMember.NON_GROUP_MEMBER`` on other ranks).

    Raises:
        RuntimeError: "NCCL is not available: ..." (CPU torch, no GPU, or no default group).
        ValueError: environment conflicts, or a config outside NCCL's domain (nccl_options_for).
    """
    torch, pg_nccl, dist = nccl_module_parts()
    if not torch.cuda.is_available():
        raise RuntimeError("NCCL is not available: no CUDA device is visible")
    if not dist.is_initialized():
        raise RuntimeError("NCCL is not available: torch.distributed is not initialized "
                           "(call init_process_group first)")
    bound = nccl_config_fields(pg_nccl.Options)
    mapping = entry_options(config, tag=tag, use_tuner_plugin=use_tuner_plugin, op=op,
                            fields=bound, nccl_version=runtime_nccl_version())
    fields = dict((inherited or {}).get("config", {}))
    fields.update(mapping["config"])  # the entry's own knobs win over the parent's
    if "comm_name" in bound:
        # ncclConfig_t.commName (NCCL 2.27+), where the torch release binds it (detected: torch
        # init.cpp @ce00583b does not): NCCL hands it to the profiler's init (v2.30.7
        # src/plugin/profiler.cc:250), whose records and the tuner's rows are then keyed by it
        fields["comm_name"] = tag
    if config.high_priority_stream is not None:
        high_priority_stream = bool(config.high_priority_stream)
    elif inherited is not None:
        high_priority_stream = bool(inherited.get("is_high_priority_stream", high_priority_stream))
    opts = build_options(fields, options_cls=pg_nccl.Options, high_priority_stream=high_priority_stream)
    env = dict(mapping["env"])
    env[TUNER_CONFIG_ENV] = TUNER_NO_TABLE if tuner_table is None else os.fspath(tuner_table)
    device = torch.device("cuda", torch.cuda.current_device())
    kwargs: dict[str, Any] = {"ranks": sorted(ranks), "backend": "nccl", "pg_options": opts, "timeout": timeout}
    params = inspect.signature(dist.new_group).parameters
    if "group_desc" in params:
        kwargs["group_desc"] = tag
    if "device_id" in params:
        kwargs["device_id"] = device
    with scoped_env(env):
        group = dist.new_group(**kwargs)
        if dist.get_rank() in ranks:
            # Force the communicator into existence while the environment is set.
            probe = torch.zeros(1, device=device)
            dist.all_reduce(probe, group=group)
            torch.cuda.synchronize(device)
    return group


def entry_options(config: CommConfig, *, tag: str, use_tuner_plugin: bool, op: str | None = None,
                  fields: Any = None, nccl_version: tuple[int, int, int] | None = None,
                  environ: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The checks of ``create_nccl_pool_entry`` that need no collective: the environment conflicts
    with what ``config`` sets and ``nccl_options_for``. Run on every rank before any ``new_group``
    (``CommPool.prepare``'s preflight), so a rank never fails alone in the middle of creation.

    Raises:
        ValueError: an environment conflict or a config outside this NCCL's domain (both name the
            value and what is allowed).
    """
    env = os.environ if environ is None else environ
    check_env_conflicts(env, use_tuner_plugin=use_tuner_plugin, config=config)
    return nccl_options_for(config, fields=fields, nccl_version=nccl_version, use_tuner_plugin=use_tuner_plugin,
                            op=op, tag=tag)


def parent_options(group: Any) -> dict[str, Any] | None:
    """What a pool entry inherits from its site's own NCCL group: ``is_high_priority_stream`` and
    the ``ncclConfig_t`` fields the parent set (``NCCLConfig`` attributes other than ``blocking``
    that differ from a fresh ``Options()``), read from ``ProcessGroupNCCL.options`` (torch binds it
    read-only; Megatron's ``get_nccl_options`` builds these for ``--nccl-communicator-config-path``).
    None when the group has no NCCL backend (gloo, CPU)."""
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
    """The tuner-plugin tag of a pool entry whose ``group_desc`` is ``desc``.

    Characters the plugin does not accept become ``_``; a description longer than 63 characters
    is cut to 54 and followed by ``_`` and 8 hex digits of its SHA-256, so tags stay distinct.
    The plan table's ``commTag`` column must carry this value for rows meant for that entry.
    """
    import hashlib

    tag = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_.:/-[]") else "_" for ch in desc) or "_"
    if len(tag) > 63:
        tag = f"{tag[:54]}_{hashlib.sha256(desc.encode()).hexdigest()[:8]}"
    return tag


def pool_entry_tag(group: str, entry: str) -> str:
    """Tag of a pool entry of process group ``group``: ``"<group>/<entry>"`` (sanitised by
    ``comm_tag``). Plan-table rows tagged with the group name (what ``lagom plan export``
    writes) apply to the group's own communicator and to all its entries (the plugin matches
    ``"<row tag>/..."``); rows tagged with the full entry tag apply to that entry only."""
    return comm_tag(f"{group}/{entry}")


@contextlib.contextmanager
def comm_tag_scope(tag: str, environ: Any = None) -> Iterator[None]:
    """Sets ``LAGOM_TUNER_COMM_TAG`` for communicators created in the ``with`` body.

    For a process group's own communicator (e.g. Megatron's ``dp``) to receive the plan-table
    rows tagged with its name, create it eagerly inside this scope: the default group bound to a
    device (``init_process_group(device_id=...)``) makes ``new_group`` create the communicator at
    once, while a lazily created one is made at its first collective, outside the scope.

    Raises:
        ValueError: a tag the plugin would refuse.
    """
    nccl_options_for(CommConfig(), tag=tag)  # validates the tag
    with scoped_env({TUNER_COMM_TAG_ENV: tag}, environ):
        yield


def _group_from_desc(desc: str) -> tuple[str, str] | None:
    """(group, entry) from CommPool's ``LAGOM_POOL_<GROUP>_<key...>`` with this backend's keys."""
    rest = desc[len("LAGOM_POOL_"):] if desc.startswith("LAGOM_POOL_") else None
    if not rest:
        return None
    for marker in ("_plugin", "_env"):  # first element of NcclPoolBackend.entry_key
        i = rest.find(marker + "_")
        if i < 0 and rest.endswith(marker):
            i = len(rest) - len(marker)
        if i > 0:
            return rest[:i].lower(), rest[i + 1:]
    return None


RING_BUFFER_BYTES = 524_288 + 4_915_200 + 4_194_304
"""Buffers of one ring connection (one per channel per rank), bytes: LL (8 lines x 512 threads x 8
steps x 16 B) + LL128 (120 elements x 640 threads x 8 steps x 8 B) + Simple (4 MiB), NCCL's
defaults (2.30 ``src/init.cc:810-824``, constants in ``src/include/device.h:26, 97-98, 114-115``);
a receive buffer holds all three protocols."""
NVLS_BYTES_PER_CHANNEL_HEAD = 2 * 128 * 1024 * 8
"""NVLS buffers per channel and NVLS head, bytes: 2 x (chunk 128 KiB x 8 steps) (``src/transport/nvls.cc:425-430``,
``NCCL_NVLS_CHUNKSIZE`` default ``nvls.cc:160``)."""
ASSUMED_CHANNELS = 32
"""Channel count assumed for an entry without CTA bounds (NCCL picks it from the topology)."""


def estimate_entry_bytes(n_channels: int | None, *, nvls_heads: int = 0) -> int:
    """Device memory one pool entry's communicator may allocate, bytes: ring buffers per channel plus,
    where NVLS can run (``nvls_heads`` > 0: the NVLink domain's ranks), NVLS buffers for as many NVLS
    channels (the pool sets ``nvls_ctas`` = ``n_channels``). Tree, P2P and host memory are not
    counted (an estimate, the same on every rank). ``n_channels`` None = ``ASSUMED_CHANNELS``."""
    n = ASSUMED_CHANNELS if n_channels is None else int(n_channels)
    return n * RING_BUFFER_BYTES + (n * NVLS_BYTES_PER_CHANNEL_HEAD * nvls_heads if nvls_heads > 0 else 0)


class NcclPoolBackend:
    """Pool backend for ``megatron.comm_pool.CommPool`` on NCCL (``megatron.backends.make_pool_backend("nccl")``).

    Two mechanisms (``nccl.rules.MECHANISMS``), chosen from the agreed capabilities (never from one
    rank's environment):

    * tuner plugin: algorithm, protocol, channels and chunk size are per call, from the plan table.
      Every non-default config gets an entry keyed by its communicator-scope knobs (CTA policy, CGA
      cluster size, stream priority), its CTA bounds and the table. A config that sets a channel count runs on an
      entry with CTA bounds ``min = max`` = the plan's largest channel count among the group's
      collective sites (``cta_bounds``): NCCL caps the plugin's ``*nChannels`` at the
      communicator's channel count (``src/enqueue.cc:583``, ``:598-599``), and both bounds make
      that count the bound (``src/graph/connect.cc:503-505``, NVIDIA/nccl v2.30.7). A config that
      leaves channels to NCCL runs on an entry with NCCL's own bounds: ``topoGetAlgoInfo`` starts
      from ``comm->nChannels`` (``src/enqueue.cc:2070``), so a bounded entry would run it at the
      bound. A point-to-point config runs on an entry bounded at its own channel count
      (``p2p_configs``). An entry of group ``dp`` is tagged ``dp/<key>`` (``pool_entry_tag``), so the
      rows the exporter tags ``dp`` reach it.
    * communicator (no plugin): one entry per distinct (n_channels, algorithm, protocol,
      cta_policy, cga_cluster_size, stream priority), applied with ``ncclConfig_t``,
      NCCL_ALGO/NCCL_PROTO and ``Options.is_high_priority_stream``.

    Args:
        use_tuner_plugin: the agreed mechanism is ``tuner`` (``Capabilities.mechanism``, set by
            ``megatron.apply.Applier.agree_capabilities``). Default False: the launch sets
            ``NCCL_TUNER_PLUGIN`` for every rank (``plugin_launch``), so the variable's text says
            nothing about whether NCCL loaded the plugin; only the agreed capabilities do.
        tuner_table: plan table for the plugin (``LAGOM_TUNER_CONFIG`` during entry creation);
            entries made without one (probes, communicator mode, or None) get ``TUNER_NO_TABLE``.
        status_reader: ``plugin_status.read_plugin_status`` (tests pass stand-ins).
    """

    name = "nccl"

    def __init__(self, use_tuner_plugin: bool = False, tuner_table: str | os.PathLike | None = None,
                 status_reader: Callable[[], Any] | None = None) -> None:
        self.use_tuner_plugin = bool(use_tuner_plugin)
        self.tuner_table = tuner_table
        self.table_id: str | None = None
        """Identifies the table's content (e.g. the plan digest), the same on every rank; part of
        the plugin entries' key, so that a new table gets new communicators."""
        self.plugin_active = self.use_tuner_plugin
        """With the plugin loaded: True = per-call knobs go through the plan table (the plan's
        entries); False = through per-communicator entries, as without the plugin. The probes of
        the warm-up use False: each probe config needs its own communicator anyway, and the
        plugin reads a table only when a communicator is created, before any plan exists.
        Changing it changes ``entry_key``: call ``CommPool.invalidate_keys()`` after."""
        self.cta_bound: int | None = None
        """CTA bounds of plugin-mode entries when no group is named or ``cta_bounds`` is empty (the
        plan's largest channel count); None = NCCL's."""
        self.cta_bounds: dict[str, int] = {}
        """Group name -> CTA bounds of its plugin-mode entries: the largest channel count the plan
        gives that group's collective sites (a tp entry is not made with the dp sites' 64 channels:
        each channel costs ring buffers, ``estimate_entry_bytes``)."""
        self.p2p_configs: dict[str, set[CommConfig]] = {}
        """Group name -> the configs the plan gives its point-to-point sites: their plugin-mode entry
        has CTA bounds ``min = max`` = the config's own channel count, which is how NCCL bounds P2P
        channels (``comm->p2pnChannels``, ``engine.p2p``); the tuner table has no row for P2P."""
        self.nvls_heads = 0
        """Ranks of an NVLink domain when NVLS can run (agreed capabilities), for ``estimate_bytes``."""
        self.status_reader = status_reader
        self._inits_before: int | None = None
        self._failures_before = 0

    @property
    def _plugin(self) -> bool:
        return self.use_tuner_plugin and self.plugin_active

    def _entry_config(self, config: CommConfig, group: str | None = None) -> CommConfig:
        if self._plugin:  # per-call knobs travel through the plugin table
            if config.n_channels is None:
                # the row leaves channels to NCCL, which starts from comm->nChannels (src/enqueue.cc:2070):
                # an entry with NCCL's own CTA bounds, so the site runs at the count NCCL would choose
                bound = None
            elif group is not None and config in self.p2p_configs.get(group, ()):
                bound = config.n_channels  # P2P: the bound is the knob (engine.p2p), no row applies
            else:  # a group the plan gives no channel count keeps NCCL's own (None)
                bound = self.cta_bounds.get(group) if group is not None and self.cta_bounds else self.cta_bound
            return CommConfig(n_channels=bound, cta_policy=config.cta_policy, cga_cluster_size=config.cga_cluster_size,
                              net_peer_channels=config.net_peer_channels, high_priority_stream=config.high_priority_stream)
        return CommConfig(n_channels=config.n_channels, algorithm=config.algorithm, protocol=config.protocol,
                          cta_policy=config.cta_policy, cga_cluster_size=config.cga_cluster_size,
                          net_peer_channels=config.net_peer_channels, high_priority_stream=config.high_priority_stream)

    def entry_key(self, config: CommConfig, group: str | None = None) -> tuple | None:
        """None when the group's own communicator serves ``config`` (all defaults, or, without the
        plugin, no communicator-scope knob set), else the communicator-scope part of ``config``
        as a tuple of strings (with the plugin, the CTA bounds of ``group``'s entries).

        Raises:
            ValueError: a value outside NCCL's domains (see ``nccl_options_for``).
        """
        entry = self._entry_config(config, group)
        nccl_options_for(entry, use_tuner_plugin=self._plugin)  # validates
        if config.is_default() or (not self._plugin and entry.is_default()):
            return None  # e.g. only chunk_size, which needs the plugin: nothing an entry can apply

        def part(v: Any) -> str:
            return "any" if v is None else str(v)
        peer = () if entry.net_peer_channels is None else ("npp", str(entry.net_peer_channels))
        if entry.high_priority_stream:
            peer += ("hp",)  # a stream priority is the process group's: its own entry
        if self._plugin:  # the table is part of the key: the plugin reads it at communicator creation
            return ("plugin", part(entry.cta_policy), part(entry.cga_cluster_size), part(entry.n_channels),
                    self.table_id or "env-table", *peer)
        return ("env", part(entry.n_channels), part(entry.algorithm), part(entry.protocol),
                part(entry.cta_policy), part(entry.cga_cluster_size), *peer)

    def estimate_bytes(self, config: CommConfig, group: str | None = None) -> int:
        """``estimate_entry_bytes`` of the entry of ``group`` that serves ``config``."""
        return estimate_entry_bytes(self._entry_config(config, group).n_channels, nvls_heads=self.nvls_heads)

    def preflight(self, config: CommConfig, op: str | None = None, group: str | None = None) -> None:
        """The checks of the entry for ``config`` that need no collective (``entry_options``).

        Raises:
            ValueError: an environment conflict or a value this NCCL / torch cannot apply.
        """
        try:
            fields = nccl_config_fields()
        except RuntimeError:
            fields = None  # no NCCL here (CPU): checked against every known field
        entry_options(self._entry_config(config, group), tag="_", use_tuner_plugin=self._plugin, op=op, fields=fields,
                      nccl_version=runtime_nccl_version())
        if self._plugin and self._inits_before is None:
            status = (self.status_reader or _read_status)()
            self._inits_before = status.init_count if status is not None else 0
            self._failures_before = getattr(status, "table_failures", 0) if status is not None else 0

    def verify(self) -> None:
        """After the entries exist: in plugin mode, the plugin NCCL loaded in this process initialised
        the new communicators and loaded the plan table (``plugin_status``); nothing to check otherwise.

        Raises:
            RuntimeError: the plugin is not loaded, did not see the new communicators, or could not
                read the table (names the table).
        """
        if not self._plugin:
            return
        before, self._inits_before = self._inits_before, None
        status = (self.status_reader or _read_status)()
        if status is None:
            raise RuntimeError("lagom's tuner plugin is not loaded by NCCL in this process")
        if before is not None and status.init_count <= before:
            raise RuntimeError(f"NCCL did not initialise lagom's plugin for the new entries (init count "
                               f"{status.init_count}, {before} before)")
        failures_before, self._failures_before = self._failures_before, 0
        failed = before is not None and status.table_failures > failures_before  # only entries made now count
        if not status.table_loaded or failed:
            # table_loaded says some table was loaded in this process (an earlier plan's, maybe);
            # a failure counted since the preflight is this table's (plugin/table.c loadTable)
            raise RuntimeError(f"lagom's plugin did not load the plan table {self.tuner_table or '(environment)'}"
                               f" ({status.table_failures - failures_before} failed load(s) in NCCL's log, 'LAGOM/tuner')")

    def tag_for(self, desc: str, group: str | None = None) -> str:
        """The entry's tuner tag: ``"<group>/<key>"`` from CommPool's description
        ``LAGOM_POOL_<GROUP>_<key>`` (or the given ``group``); ``comm_tag(desc)`` when the
        description has another form (then only rows with that exact tag, or ``*``, apply)."""
        parsed = _group_from_desc(desc)
        if group is not None:
            return pool_entry_tag(group, parsed[1] if parsed else desc)
        return pool_entry_tag(*parsed) if parsed else comm_tag(desc)

    def create_group(self, ranks: tuple[int, ...], config: CommConfig, desc: str, *, group: str | None = None,
                     parent: Any = None) -> Any:
        """Creates the entry with ``create_nccl_pool_entry``, inheriting ``parent``'s options
        (``parent_options``); collective over all ranks.

        Raises:
            RuntimeError: NCCL is not available. ValueError: see ``create_nccl_pool_entry``.
        """
        return create_nccl_pool_entry(list(ranks), self._entry_config(config, group), tag=self.tag_for(desc, group),
                                      use_tuner_plugin=self._plugin, tuner_table=self.tuner_table if self._plugin else None,
                                      inherited=parent_options(parent) if parent is not None else None)

    def register_memory(self, group: Any, pools: list[tuple[Any, bool]]) -> None:
        """Registers each NCCL memory pool of ``pools`` ((``torch.cuda.MemPool``, symmetric)) with the
        entry ``group``'s NCCL backend, as megatron-core registers its DDP buffers on their own group
        (core_v0.16.1 ``nccl_allocator.py:163-182``: ``backend.register_mem_pool(pool, symm=...)``,
        without ``symm`` on a torch that lacks it). torch binds ``ProcessGroupNCCL.register_mem_pool``
        (``torch/csrc/distributed/c10d/init.cpp``); NCCL then finds the calls' buffers registered
        (``ncclRegFind``, ``src/enqueue.cc:2141-2146``) and keeps the registered algorithms.

        Raises:
            RuntimeError: torch or NCCL refused a registration (the pool step reverts).
        """
        import torch

        backend = group._get_backend(torch.device("cuda", torch.cuda.current_device()))
        for pool, symmetric in pools:
            try:
                backend.register_mem_pool(pool, symm=symmetric)
            except TypeError:  # a torch whose register_mem_pool has no symm argument
                backend.register_mem_pool(pool)

    def destroy_group(self, group: Any) -> None:
        """Destroys one entry (``torch.distributed.destroy_process_group``; frees its communicator)."""
        import torch.distributed as dist

        dist.destroy_process_group(group)


def _read_status() -> Any:
    from lagom_megatron.nccl.plugin_status import read_plugin_status

    return read_plugin_status()
