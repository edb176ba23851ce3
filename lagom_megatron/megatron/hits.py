"""What NCCL's tuner plugin matched (per-row ``getCollInfo`` hits, ``nccl/plugin/status.c``), and whether
the members of one communicator agree: differing counts are the hang class of NCCL issue 1136.
Run at train end on every rank; never raises into training.
"""

from __future__ import annotations

from typing import Any, Callable

from lagom_megatron.megatron import consensus
from lagom_megatron.megatron.run_files import say


def log_plan_hits(plan: Any, groups: Any, *, status_reader: Callable[[], Any] | None = None) -> list[str]:
    """Logs this rank's hit summary, then (collective) ``compare_shared_hits``; returns its warnings."""
    from lagom_megatron.nccl.export import plan_hit_summary

    try:
        say(plan_hit_summary(plan, status_reader=status_reader))
    except Exception as exc:  # noqa: BLE001 - a log line is not worth a training run
        say(f"lagom: WARNING: tuner plugin hit summary failed ({type(exc).__name__}: {exc})")
    return compare_shared_hits(plan, groups, status_reader=status_reader)


def compare_shared_hits(plan: Any, groups: Any, *, status_reader: Callable[[], Any] | None = None) -> list[str]:
    """Logs and returns the warning naming rows whose hit counts differ among one communicator's ranks.
    Collective: one all-gather on every rank, also when reading fails. Never raises."""
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
