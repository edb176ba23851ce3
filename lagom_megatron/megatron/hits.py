"""What NCCL's tuner plugin matched, after a plan was applied through it: this rank's hit summary
and the comparison of the hit counts of shared communicators across ranks.

The plugin counts, per table row, the ``getCollInfo`` calls that matched it (``nccl/plugin/status.c``),
read in-process (``nccl.plugin_status.read_plugin_status``). A row applies to one group's
communicator and its pool entries; every member rank of that communicator makes the same calls,
so a counter that differs between two members means NCCL was asked different questions (or
answered by different tables) on ranks that must choose alike: the hang class of NCCL issue 1136.
``compare_shared_hits`` all-gathers every rank's counters and logs one warning naming the rows
and ranks that differ (``plugin_status.shared_hit_mismatches``).

Both run at train end on every rank (the controller's condition is the same on every rank: the
agreed mechanism, the agreed plan, a revert is collective). Neither raises into training.
"""

from __future__ import annotations

from typing import Any, Callable

from lagom_megatron.megatron import consensus
from lagom_megatron.megatron.run_files import say


def log_plan_hits(plan: Any, groups: Any, *, status_reader: Callable[[], Any] | None = None) -> list[str]:
    """Logs this rank's hit summary (``export.plan_hit_summary``) and then, collectively,
    ``compare_shared_hits``. Returns the comparison's warnings (empty when the members agree)."""
    from lagom_megatron.nccl.export import plan_hit_summary

    try:
        say(plan_hit_summary(plan, status_reader=status_reader))
    except Exception as exc:  # noqa: BLE001 - a log line is not worth a training run
        say(f"lagom: WARNING: tuner plugin hit summary failed ({type(exc).__name__}: {exc})")
    return compare_shared_hits(plan, groups, status_reader=status_reader)


def compare_shared_hits(plan: Any, groups: Any, *, status_reader: Callable[[], Any] | None = None) -> list[str]:
    """All-gathers every rank's row hit counts and the ranks of its groups; logs one warning naming
    the rows whose counts differ among the member ranks of one communicator, and the ranks.

    Collective over the default group: every rank must call it (it all-gathers exactly once, also
    when reading the status or the plan's rows fails here, so no rank waits alone).

    Args:
        plan: the applied plan (its tuner rows, ``export.tuner_rows(plan, extended=True)``, are the
            table the plugin loaded, in file order).
        groups: the rank's ``GroupNames`` (``names``, ``by_name(name).ranks``); None = no named
            group (nothing to compare).
        status_reader: ``plugin_status.read_plugin_status`` (tests pass a stand-in).

    Returns:
        The warning lines logged (rank 0 logs, every rank returns the same): the rows whose members
        disagree, and the ranks whose counts could not be read (left out, with their error). Empty
        when the members agree. Never raises.
    """
    from lagom_megatron.nccl import plugin_status
    from lagom_megatron.nccl.export import tuner_rows

    rows: list[Any] = []
    try:
        rows = tuner_rows(plan, extended=True)
        status = (status_reader or plugin_status.read_plugin_status)()
        hits = tuple(status.row_hits) if status is not None and status.table_loaded else None
        if hits is not None and len(hits) != len(rows):
            hits = None  # another table than this plan's: nothing to compare (the summary says so)
        members = {} if groups is None else {name: tuple(info.ranks) for name in groups.names()
                                             if (info := groups.by_name(name)) is not None}
        local: tuple = (hits, members, None)
    except Exception as exc:  # noqa: BLE001 - still join the all-gather below
        local = (None, {}, f"{type(exc).__name__}: {exc}")
    warnings: list[str] = []
    try:
        reports = consensus.all_gather(local)
        mismatches = plugin_status.shared_hit_mismatches([r.cells[11] for r in rows], [(h, m) for h, m, _ in reports])
        line = plugin_status.describe_mismatches(mismatches, rows)
        if line:
            warnings.append(line)
        failed = [f"rank {r}: {err}" for r, (_, _, err) in enumerate(reports) if err]
        if failed:
            warnings.append(f"lagom: WARNING: tuner row hits not read, left out of the comparison across ranks: "
                            f"{'; '.join(failed)}")
    except Exception as exc:  # noqa: BLE001 - a broken comparison must not end training
        warnings = [f"lagom: WARNING: comparing tuner row hits across ranks failed ({type(exc).__name__}: {exc})"]
    for line in warnings:
        say(line)
    return warnings
