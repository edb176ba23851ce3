"""Communicator pool: process groups over the same ranks as a Megatron group, one per configuration.

A site whose configuration needs different communicator-scope options than its group's defaults
is routed to a *pool entry*: a process group over exactly the same ranks, in the same order,
created with that configuration's options (docs/nccl.md; what NCCL's maintainers
recommend for per-collective CTA limits). Per-call knobs travel with the call.

Backends (a small interface, ``PoolBackend``; ``backends.make_pool_backend`` picks one):

* ``gloo`` (CPU): ``gloo.GlooPoolBackend``, worker threads per communicator;
* ``nccl`` (GPU): ``lagom_megatron.nccl.pool.NcclPoolBackend``, ProcessGroupNCCL options and the
  tuner-plugin table.

Entries are created eagerly and collectively: every rank calls ``CommPool.prepare`` with the same
needs (derived from an agreed plan or from the probe configs), the rank lists of every group of
a name are all-gathered over the world, and ``torch.distributed.new_group`` is called for each in
one sorted order on all ranks (``new_group`` must be called by every rank of the world).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Hashable, Protocol

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

        Every rank must call this with the same ``needs``. A group with a partner
        (``GroupNames.add_partner``) gets the same entries for its partner. Returns the number of groups created
        on this rank's side (entries it is a member of).
        """
        import torch.distributed as dist

        needs = dict(needs)
        for name in list(needs):  # a group whose traffic also rides a partner group (PP=2: pp_world)
            partner = self.groups.partner(name)
            if partner is not None:
                needs[partner.name] = set(needs[name]) | set(needs.get(partner.name, ()))
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
