"""Megatron's named process groups (``parallel_state``'s ``tp``, ``pp``, ``dp``, ...) as lagom sees them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# the first name found for a group wins: a dp group that doubles as dp_cp (context parallel 1) is called dp
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
"""Groups within one pipeline stage: under PP their site ids carry the stage (``tp.sp_all_gather[stage1.3]``)."""

# a group with the ranks of the named one takes its name (context parallel 1, one distributed-optimizer instance)
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
    """Process-group objects -> Megatron's group names, by identity, then by ranks; ``local_world_size``: ranks/node."""

    def __init__(self, *, local_world_size: int | None = None) -> None:
        self.local_world_size = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", 0) or 1)
        self._by_id: dict[int, GroupInfo] = {}
        self._by_ranks: dict[tuple[int, ...], GroupInfo] = {}
        self._by_name: dict[str, GroupInfo] = {}
        self._keep: list[Any] = []  # holds group objects so that their ids stay unique
        self._partners: dict[str, str] = {}

    @classmethod
    def from_parallel_state(cls, **kwargs: Any) -> GroupNames:
        """Names every group that ``megatron.core.parallel_state`` has initialised on this rank."""
        from megatron.core import parallel_state as ps

        names = cls(**kwargs)
        for name, getter, kw in _GROUP_GETTERS:
            fn = getattr(ps, getter, None)
            if fn is None:
                continue
            try:
                group = (
                    fn(check_initialized=False, **kw) if "check_initialized" in fn.__code__.co_varnames else fn(**kw)
                )
            except (AssertionError, RuntimeError, TypeError):
                continue
            if group is not None:
                names.add(name, group)
        pp = names.by_name("pp")
        if pp is not None and pp.size == 2:
            import torch.distributed as dist

            names.add_partner("pp", "pp_world", tuple(range(dist.get_world_size())))
        return names

    def add(self, name: str, group: Any) -> GroupInfo:
        """Registers ``group`` under ``name`` unless the object already has a name; returns its info."""
        if id(group) in self._by_id:
            return self._by_id[id(group)]
        ranks = _group_ranks(group)
        same = self._by_name.get(_SAME_AS.get(name, ""))
        if same is not None and same.ranks == ranks:
            name = same.name
        info = GroupInfo(name=name, ranks=ranks, n_nodes=len({r // self.local_world_size for r in ranks}))
        self._by_id[id(group)] = info
        self._by_ranks.setdefault(ranks, info)
        self._by_name.setdefault(name, info)
        self._keep.append(group)
        return info

    def add_partner(self, of: str, name: str, ranks: tuple[int, ...]) -> None:
        """``name`` over ``ranks`` takes part of ``of``'s traffic and pool entries (PP=2: one direction on WORLD)."""
        self._by_name.setdefault(
            name, GroupInfo(name=name, ranks=tuple(ranks), n_nodes=len({r // self.local_world_size for r in ranks}))
        )
        self._partners[of] = name

    def partner(self, name: str) -> GroupInfo | None:
        """The partner group registered for ``name`` (``add_partner``), or None."""
        other = self._partners.get(name)
        return self._by_name.get(other) if other else None

    def alias(self, group: Any, info: GroupInfo) -> None:
        """Registers another group object (a pool entry) as the same named group ``info``."""
        self._by_id[id(group)] = info
        self._keep.append(group)

    def lookup(self, group: Any) -> GroupInfo:
        """The named group of ``group`` (None: ``world``); an unknown group by its ranks, else ``world`` / ``other``."""
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

    def objects(self) -> list[Any]:
        """The group objects registered (``add``, ``alias``), in registration order."""
        return list(self._keep)
