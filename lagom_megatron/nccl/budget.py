"""The communicator pool's memory budget as the search sees it: the largest channel count each
group's pool entries may have.

The pool bounds the device memory of its extra communicators (``--lagom-pool-budget-mib``,
``megatron.comm_pool.CommPool``; estimate ``nccl.pool.estimate_entry_bytes``: NCCL's ring buffers
per channel plus NVLS buffers per channel and NVLS head). ``megatron.apply.Applier.fit_plan_to_budget``
trims a plan that passes it, but a group whose entry alone passes the budget then loses every one
of its sites. So the budget reaches the search: ``NcclRules`` caps each group's channel domain at
``channel_cap`` of the group's share, and a plan found there fits by construction.

The split: every group that can need an entry (a group with at least one site whose channel count
the mechanism can set) gets an equal share of the budget. Equal, because the search decides the
groups together and no share can be chosen from gains before it has run; deterministic, because
every rank computes it from the same sites.

* ``tuner`` (plugin) mechanism: one entry per group (the search changes no communicator-scope knob),
  created with CTA bounds = the largest channel count of its sites (``NcclPoolBackend.cta_bounds``),
  so capping every site of the group at the share's channel count bounds the entry.
* ``communicator`` mechanism: one entry per distinct config of a group. The cap bounds each entry
  by the group's share; a group with several distinct channel counts can still pass its share, and
  the fit trims the entries of least predicted gain there (the search does not count entries).
* ``env`` mechanism: no pool entries, no cap.
"""

from __future__ import annotations

from collections.abc import Iterable

from lagom_megatron.nccl.pool import estimate_entry_bytes


def group_share(budget_bytes: int, groups: Iterable[str]) -> int:
    """Bytes of ``budget_bytes`` each of ``groups`` gets: an equal split (the whole budget when no
    group is named).

    Raises:
        ValueError: a negative budget (names it).
    """
    if budget_bytes < 0:
        raise ValueError(f"pool budget must be >= 0 bytes; got {budget_bytes}")
    n = len(set(groups))
    return int(budget_bytes) // max(1, n)


def channel_cap(share_bytes: int, *, nvls_heads: int = 0, limit: int = 64) -> int:
    """Largest channel count ``n`` (0..``limit``) whose entry fits ``share_bytes``:
    ``estimate_entry_bytes(n, nvls_heads=nvls_heads) <= share_bytes``. 0 = not even one channel fits
    (the group's sites keep NCCL's channel count and need no entry for it)."""
    cap = 0
    for n in range(1, int(limit) + 1):
        if estimate_entry_bytes(n, nvls_heads=nvls_heads) > share_bytes:
            break
        cap = n
    return cap
