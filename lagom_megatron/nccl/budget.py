"""The pool's memory budget as the search sees it: the largest channel count each group's pool entries may have.

``NcclRules`` caps each group's channel domain at ``channel_cap`` of an equal share of ``--lagom-pool-budget-mib``
(``nccl.pool.estimate_entry_bytes``). ``tuner``: one entry per group, so the plan fits; ``communicator``: one per
config, which ``Applier.fit_plan_to_budget`` may trim; ``env``: no entries, no cap."""

from __future__ import annotations

from collections.abc import Iterable

from lagom_megatron.nccl.pool import estimate_entry_bytes


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
