"""Communicator pool: process groups over the same ranks as a Megatron group, one per communicator-scope configuration
(docs/nccl.md); created by every rank in one sorted order, as ``new_group`` requires."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig, KnobRules
from lagom_megatron.engine.profile import BACKENDS
from lagom_megatron.megatron.groups import GroupInfo, GroupNames
from lagom_megatron.megatron.pool.gloo import GlooPoolBackend, GlooRules
from lagom_megatron.nccl.capabilities import Capabilities
from lagom_megatron.nccl.rules import NcclRules, check_mechanism

log = logging.getLogger("lagom.pool")


class PoolBackend(Protocol):
    """Creates pool entries for one communication backend; ``group``: the name of the Megatron group an entry serves."""

    name: str

    def entry_key(self, config: CommConfig, group: str | None = None) -> Hashable | None:
        """The communicator-scope part of ``config``; None when the group's own communicator serves it (ValueError)."""

    def estimate_bytes(self, config: CommConfig, group: str | None = None) -> int:
        """Device memory of the entry serving ``config``, bytes."""

    def preflight(self, config: CommConfig, op: str | None = None, group: str | None = None) -> None:
        """The checks of ``config``'s entry that need no collective; ValueError."""

    def create_group(
        self, ranks: tuple[int, ...], config: CommConfig, desc: str, *, group: str | None = None, parent: Any = None
    ) -> Any:
        """One process group over ``ranks`` for ``config``, with ``parent``'s options where it has any; collective."""

    def tag_for(self, desc: str, group: str | None = None) -> str:
        """The entry's communicator name in the profiler's records (``CommPool.comm_key``)."""

    def register_memory(self, group: Any, pools: list[tuple[Any, bool]]) -> None:
        """Registers the (memory pool, symmetric) pairs of the entry's group with the entry; collective."""

    def verify(self) -> None:
        """After the entries were created: RuntimeError when they did not come up as configured."""

    def destroy_group(self, group: Any) -> None:
        """Destroys one entry."""


@dataclass(frozen=True, slots=True)
class _EntryId:
    name: str
    ranks: tuple[int, ...]
    key: Hashable


def _local_step(name: str, fn: Callable[[], Any]) -> Any:
    return fn()


DEFAULT_BUDGET_MIB = 512
"""Default bound on the estimated device memory of all live pool entries of one rank (MiB)."""


class PoolBudgetExceeded(ValueError):
    """The entries a plan or the probes need would exceed the pool's memory budget."""


class CommPool:
    """Pool entries of one rank; ``budget_bytes`` bounds the live entries' estimated bytes (None: unbounded)."""

    def __init__(
        self,
        backend: PoolBackend,
        groups: GroupNames,
        *,
        budget_bytes: int | None = DEFAULT_BUDGET_MIB * 2**20,
        registered: dict[str, list] | None = None,
    ) -> None:
        self.backend = backend
        self.groups = groups
        self.budget_bytes = budget_bytes
        self._entries: dict[tuple[str, Hashable], Any] = {}
        self._created: dict[_EntryId, Any] = {}
        self._names: dict[int, str] = {}
        self._bytes: dict[_EntryId, int] = {}
        self._keys: dict[tuple[CommConfig, str | None], Hashable | None] = {}
        self.stats = {"created": 0, "destroyed": 0}
        self.registered = registered or {}

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Any]:
        """This rank's live entries (the groups it is a member of)."""
        return list(self._entries.values())

    @property
    def live(self) -> int:
        """Entries created and not destroyed, also those this rank is not a member of."""
        return len(self._created)

    @property
    def estimated_bytes(self) -> int:
        """Estimated device memory of the live entries (bytes)."""
        return sum(self._bytes.values())

    def describe(self) -> str:
        """``"<n> entries, ~<MiB> MiB"``."""
        return f"{len(self._created)} entries, ~{self.estimated_bytes / 2**20:.0f} MiB"

    def invalidate_keys(self) -> None:
        """Forgets the cached entry keys (after the backend's mechanism changes)."""
        self._keys.clear()

    def key(self, config: CommConfig, group: str | None = None) -> Hashable | None:
        """Cached ``backend.entry_key(config, group)``."""
        try:
            return self._keys[(config, group)]
        except KeyError:
            k = self._keys[(config, group)] = self.backend.entry_key(config, group)
            return k

    def estimate(self, config: CommConfig, group: str | None = None) -> int:
        """Estimated bytes of the entry of ``group`` serving ``config``."""
        return int(self.backend.estimate_bytes(config, group))

    def own_group(self, name: str) -> Any:
        """This rank's own process group called ``name`` (Megatron's, not a pool entry), or None."""
        info = self.groups.by_name(name)
        entries = {id(e) for e in self._created.values()}
        for g in self.groups.objects():
            if id(g) not in entries and self.groups.lookup(g) is info:
                return g
        return None

    def prepare(
        self,
        needs: dict[str, set[CommConfig]] | dict[str, list[CommConfig]],
        *,
        step: Callable[[str, Callable[[], Any]], Any] = _local_step,
        ops: dict[CommConfig, str] | None = None,
    ) -> int:
        """Creates the entries ``needs`` (group name -> configs) calls for; every rank, same ``needs``. Returns
        how many this rank is a member of; ``PoolBudgetExceeded`` (through ``step``) past the budget."""
        import torch.distributed as dist

        needs = dict(needs)
        for name in list(needs):  # a group whose traffic also rides a partner group (PP=2: pp_world)
            partner = self.groups.partner(name)
            if partner is not None:
                needs[partner.name] = set(needs[name]) | set(needs.get(partner.name, ()))
        mine = {name: self.groups.by_name(name).ranks for name in self.groups.names()}
        gathered: list[dict[str, tuple[int, ...]]] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine)

        def preflight() -> list[tuple[_EntryId, CommConfig]]:
            wanted: dict[_EntryId, CommConfig] = {}
            for name, configs in needs.items():
                for c in sorted(configs, key=lambda c: repr(c.to_dict())):
                    key = self.key(c, name)
                    if key is None:
                        continue
                    for ranks in sorted({d[name] for d in gathered if name in d}):
                        wanted.setdefault(_EntryId(name, ranks, key), c)
            todo = sorted(
                ((e, c) for e, c in wanted.items() if e not in self._created),
                key=lambda ec: (ec[0].name, ec[0].ranks, repr(ec[0].key)),
            )
            extra = sum(self.estimate(c, e.name) for e, c in todo if dist.get_rank() in e.ranks)
            if self.budget_bytes is not None and self.estimated_bytes + extra > self.budget_bytes:
                raise PoolBudgetExceeded(
                    f"{len(todo)} new communicator-pool entries need ~{extra / 2**20:.0f} MiB on this rank on top of "
                    f"~{self.estimated_bytes / 2**20:.0f} MiB live, over the budget of {self.budget_bytes / 2**20:.0f} MiB "
                    "(--lagom-pool-budget-mib)"
                )
            for e, c in todo:
                self.backend.preflight(c, (ops or {}).get(c), group=e.name)
            return todo

        todo = step("pool-preflight", preflight)

        def create() -> int:
            made, errors = 0, []
            for eid, config in todo:
                desc = f"LAGOM_POOL_{eid.name.upper()}_{'_'.join(str(x) for x in _flat(eid.key))}"
                try:
                    group = self._create(eid, config, desc)
                except Exception as exc:  # noqa: BLE001 - kept, reported after every rank made the same calls
                    errors.append(f"entry {desc}: {type(exc).__name__}: {exc}")
                    continue
                self._created[eid] = group
                self.stats["created"] += 1
                if dist.get_rank() in eid.ranks and self.registered.get(eid.name):
                    try:  # collective among the entry's ranks (symmetric windows): same order on each
                        self.backend.register_memory(group, self.registered[eid.name])
                    except Exception as exc:  # noqa: BLE001 - kept, reported after every rank made the same calls
                        errors.append(
                            f"entry {desc}: registering its group's NCCL memory pool: {type(exc).__name__}: {exc}"
                        )
                if dist.get_rank() in eid.ranks:
                    info = self.groups.by_name(eid.name)
                    if info is None or info.ranks != eid.ranks:
                        info = GroupInfo(name=eid.name, ranks=eid.ranks)
                    self.groups.alias(group, info)
                    self._entries[(eid.name, eid.key)] = group
                    self._names[id(group)] = self.backend.tag_for(desc, eid.name)
                    self._bytes[eid] = self.estimate(config, eid.name)
                    made += 1
            if errors:
                raise RuntimeError("; ".join(errors))
            return made

        created = step("pool-create", create)
        step("first-use", self.backend.verify)
        if created:
            log.info("lagom: communicator pool: %s on this rank (%s backend)", self.describe(), self.backend.name)
        return created

    def _create(self, eid: _EntryId, config: CommConfig, desc: str) -> Any:
        info = self.groups.by_name(eid.name)
        parent = self.own_group(eid.name) if info is not None and info.ranks == eid.ranks else None
        # the group's name as the plan's entries (and so the tuner table's commTag) spell it
        return self.backend.create_group(eid.ranks, config, desc, group=eid.name, parent=parent)

    def destroy(self, keep: dict[str, set[CommConfig]] | None = None) -> int:
        """Destroys every entry ``keep`` (group name -> configs) does not need, on all ranks; returns the count."""
        import torch.distributed as dist

        kept_keys = {(name, self.key(c, name)) for name, cs in (keep or {}).items() for c in cs}
        n = 0
        for eid in sorted(self._created, key=lambda e: (e.name, e.ranks, repr(e.key))):
            if (eid.name, eid.key) in kept_keys:
                continue
            group = self._created.pop(eid)
            self._bytes.pop(eid, None)
            self._names.pop(id(group), None)
            if self._entries.get((eid.name, eid.key)) is group:
                del self._entries[(eid.name, eid.key)]
            if group is not None and group is not getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
                self.backend.destroy_group(group)
            n += 1
        self.stats["destroyed"] += n
        if n:
            log.info("lagom: communicator pool: %d entries destroyed, %s left", n, self.describe())
        return n

    def comm_key(self, group: Any) -> str | None:
        """A live entry's communicator name in NCCL's profiler records (gloo: its ``group_desc``), or None."""
        return self._names.get(id(group))

    def group_for(self, info: GroupInfo, config: CommConfig) -> Any | None:
        """``info``'s pool entry for ``config`` (None: the group itself); KeyError if ``prepare`` did not create it."""
        key = self.key(config, info.name)
        if key is None:
            return None
        try:
            return self._entries[(info.name, key)]
        except KeyError:
            raise KeyError(
                f"no communicator-pool entry for group {info.name!r} and {config.to_dict()}; "
                "CommPool.prepare was not called with it"
            ) from None


def _flat(key: Hashable) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def rules_for(
    backend: str,
    cluster: ClusterSpec,
    mechanism: str | None = None,
    capabilities: Capabilities | None = None,
    pool_budget_bytes: int | None = None,
) -> KnobRules:
    """Knob rules of ``backend`` (gloo, nccl, sim) on ``cluster``, with agreed NCCL ``capabilities`` (mechanism,
    version); ``pool_budget_bytes`` caps channels (``nccl.pool``). ValueError: bad backend, mechanism or cluster."""
    if backend == "gloo":
        return GlooRules(cluster, mechanism=mechanism or "gloo")
    if backend in ("nccl", "sim"):
        if capabilities is not None and backend == "nccl":
            if capabilities.nccl_version is not None:
                cluster = dataclasses.replace(cluster, nccl_version=".".join(map(str, capabilities.nccl_version)))
            heads = capabilities.ranks_per_node if capabilities.nvls_multicast else 0
            return NcclRules(
                cluster,
                mechanism=mechanism or capabilities.mechanism(),
                backend=backend,
                capabilities=capabilities,
                pool_budget_bytes=pool_budget_bytes,
                nvls_heads=heads or 0,
            )
        if mechanism is not None and cluster.backend == "nccl":
            check_mechanism(mechanism, cluster)
        return NcclRules(cluster, mechanism=mechanism, backend=backend, pool_budget_bytes=pool_budget_bytes)
    raise ValueError(f"backend must be one of {list(BACKENDS)}; got {backend!r}")


def make_pool_backend(name: str) -> PoolBackend:
    """The communicator-pool backend for ``gloo`` or ``nccl``; ValueError for any other name."""
    if name == "gloo":
        return GlooPoolBackend()
    if name == "nccl":
        from lagom_megatron.nccl.pool import NcclPoolBackend

        return NcclPoolBackend()
    raise ValueError(f"pool backend must be one of 'gloo', 'nccl'; got {name!r}")
