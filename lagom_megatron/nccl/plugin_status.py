"""Reads, in this process, whether NCCL really loaded lagom's tuner plugin, and its row hit counts.

"Plugin active" is never inferred from the text of ``NCCL_TUNER_PLUGIN``: a value of ``none``, a
foreign plugin, a wrong path or an NCCL older than 2.22 all leave the variable set while no lagom
table is applied. Instead this module asks the dynamic loader whether lagom's library is already
mapped into the process (``dlopen`` with ``RTLD_NOLOAD`` never loads it itself) and, if it is,
calls the status functions the plugin exports:

- ``int lagomTunerAbiVersion(void)``: the tuner ABI version NCCL initialised the plugin with (3-6),
  0 while NCCL has not yet created a communicator through it;
- ``int lagomTunerInitCount(void)``: how many communicators NCCL initialised the plugin for;
- ``int lagomTunerRowHits(unsigned long long *out, int capacity)``: copies up to ``capacity``
  per-row match counters (in the table file's data-row order) and returns the number of rows of
  the loaded table, or -1 when no table is loaded;
- ``int lagomTunerTableFailures(void)``: how many inits found a plan table they could not read or
  parse (optional: a build without it reports 0).

NCCL opens the plugin with ``dlopen(path, RTLD_NOW | RTLD_LOCAL)`` (NCCL v2.30.7
``src/os/linux.cc:52``, called from ``src/plugin/plugin_open.cc:41``) and loads it once per process
at the first communicator (``src/plugin/tuner.cc:39-56``), so the status is per process and covers
every communicator of the process. Counters are in ``nccl/plugin/status.c``.

``summarize_hits`` turns the counters into the controller's log line after a plan is applied.

The library is found through the process's memory map (``/proc/self/maps``), so it is found under
whatever name NCCL resolved ``NCCL_TUNER_PLUGIN`` to.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence


LIBRARY_NAME = "libnccl-tuner-lagom.so"
"""File name of lagom's built plugin (see ``nccl/plugin/build.py``)."""


@dataclass(frozen=True)
class PluginStatus:
    """What lagom's plugin reports from inside this process.

    Attributes:
        path: absolute path of the library as mapped in this process.
        abi_version: tuner ABI version NCCL initialised it with (3-6); 0 before any communicator.
        init_count: number of communicators NCCL initialised the plugin for.
        row_hits: per table row (file order), how many ``getCollInfo`` calls it matched; empty when
            no table is loaded.
        table_loaded: whether a plan table was read and parsed.
        table_failures: inits whose plan table could not be read or parsed (0 when the library
            predates that export).
    """

    path: str
    abi_version: int
    init_count: int
    row_hits: tuple[int, ...]
    table_loaded: bool
    table_failures: int = 0


def loaded_library_path(maps_file: str = "/proc/self/maps") -> str | None:
    """Returns the path of lagom's plugin library if it is mapped into this process, else None.

    Args:
        maps_file: the process memory map to read (Linux ``/proc/<pid>/maps`` format).
    """
    try:
        text = Path(maps_file).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and os.path.basename(parts[5].strip()) == LIBRARY_NAME:
            return parts[5].strip()
    return None


def open_loaded(library: str | None = None) -> ctypes.CDLL | None:
    """lagom's library as already mapped in this process (``library``, else the one in the memory
    map), opened with ``RTLD_NOLOAD`` so that nothing is loaded here; None when it is not mapped."""
    path = library or loaded_library_path()
    if path is None:
        return None
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return None


def read_plugin_status(library: str | None = None, max_rows: int = 4096) -> PluginStatus | None:
    """Returns the status lagom's plugin reports in this process, or None when it is not loaded.

    Args:
        library: path of an already loaded library to query; default: the one found in the
            process's memory map. It is opened with ``RTLD_NOLOAD``, so this never loads a library
            NCCL did not load.
        max_rows: capacity of the hit-counter buffer (rows beyond it are not reported).

    Returns:
        A ``PluginStatus``, or None when the library is not loaded or lacks the status exports
        (an older build of the plugin).

    Raises:
        ValueError: ``max_rows`` < 0.
    """
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0; got {max_rows}")
    path = library or loaded_library_path()
    lib = open_loaded(path) if path is not None else None
    if lib is None:
        return None
    try:
        abi = lib.lagomTunerAbiVersion
        inits = lib.lagomTunerInitCount
        hits_fn = lib.lagomTunerRowHits
    except AttributeError:
        return None
    abi.restype = ctypes.c_int
    inits.restype = ctypes.c_int
    hits_fn.restype = ctypes.c_int
    hits_fn.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]
    failures = getattr(lib, "lagomTunerTableFailures", None)
    if failures is not None:
        failures.restype = ctypes.c_int
    buf = (ctypes.c_ulonglong * max(max_rows, 1))()
    n = hits_fn(buf, max_rows)
    rows = tuple(int(buf[i]) for i in range(min(max(n, 0), max_rows)))
    return PluginStatus(path=path, abi_version=int(abi()), init_count=int(inits()), row_hits=rows,
                        table_loaded=n >= 0, table_failures=int(failures()) if failures is not None else 0)


def summarize_hits(status: PluginStatus | None, plan_rows: Sequence[Any], *, max_listed: int = 8) -> str:
    """One log line: how many planned tuner-table rows NCCL matched at least once, and which never.

    Args:
        status: from ``read_plugin_status()`` (None = the plugin is not loaded in this process).
        plan_rows: the table's data rows as exported (``nccl.export.tuner_rows(plan, extended=True)``),
            in file order, which is the order of ``status.row_hits``.
        max_listed: rows named at most (the rest are counted).

    Returns:
        A line starting with ``lagom: tuner plugin``; it says when the plugin is not loaded, when
        no table is loaded, or when the loaded table has another row count than the plan's.
    """
    if status is None:
        return ("lagom: tuner plugin not loaded by NCCL in this process: none of the "
                f"{len(plan_rows)} planned rows can have been applied")
    if status.init_count == 0:
        return ("lagom: tuner plugin mapped in this process but NCCL initialised no communicator with it: none "
                f"of the {len(plan_rows)} planned rows can have been applied")
    head = f"lagom: tuner plugin ABI v{status.abi_version}, {status.init_count} communicator(s)"
    if status.table_failures:
        head += f", {status.table_failures} unreadable table load(s)"
    if not status.table_loaded:
        return f"{head}: no plan table loaded; none of the {len(plan_rows)} planned rows applied"
    if len(status.row_hits) != len(plan_rows):
        return (f"{head}: the loaded table has {len(status.row_hits)} rows, the plan {len(plan_rows)}: "
                "it is not this plan's table")
    never = [i for i, n in enumerate(status.row_hits) if n == 0]
    line = f"{head}: {len(plan_rows) - len(never)}/{len(plan_rows)} planned rows matched at least once"
    if never:
        def name(i: int) -> str:
            sites = plan_rows[i].sites
            more = f" +{len(sites) - 1} more" if len(sites) > 1 else ""
            return f"row {i + 1} ({','.join(plan_rows[i].cells[:3])}; {sites[0]}{more})"

        listed = ", ".join(name(i) for i in never[:max_listed])
        rest = f", and {len(never) - max_listed} more" if len(never) > max_listed else ""
        line += f"; never matched: {listed}{rest}"
    return line


def shared_hit_mismatches(row_groups: Sequence[str], reports: Sequence[tuple[Sequence[int] | None, Mapping[str, Sequence[int]]]],
                          ) -> list[tuple[int, dict[int, int]]]:
    """Rows whose hit counts differ among the ranks of one communicator.

    A row tagged with group ``g`` matches the calls of ``g``'s communicator and of its pool entries
    (``pool.pool_entry_tag``); every member rank of one communicator makes the same calls, so its
    counter must be the same on all of them. Instances of ``g`` over other ranks (another
    pipeline stage's ``tp``) may differ and are not compared with each other.

    Args:
        row_groups: the group tag of each table row, in file order (``TunerRow.cells[11]``).
        reports: per rank (index = global rank): its ``PluginStatus.row_hits`` (None: no status or
            a table with another row count, left out) and, per group name, the global ranks of
            that rank's instance of the group (``GroupInfo.ranks``).

    Returns:
        ``(row index, {rank: hits})`` per row and communicator whose members disagree (all members
        that reported, in rank order), rows in file order.
    """
    out: list[tuple[int, dict[int, int]]] = []
    for i, group in enumerate(row_groups):
        by_comm: dict[tuple[int, ...], dict[int, int]] = {}
        for rank, (hits, groups) in enumerate(reports):
            members = groups.get(group)
            if hits is None or members is None or i >= len(hits):
                continue
            by_comm.setdefault(tuple(sorted(members)), {})[rank] = int(hits[i])
        for comm in sorted(by_comm):
            seen = by_comm[comm]
            if len(set(seen.values())) > 1:
                out.append((i, dict(sorted(seen.items()))))
    return out


def describe_mismatches(mismatches: Sequence[tuple[int, Mapping[int, int]]], plan_rows: Sequence[Any],
                        *, max_listed: int = 8) -> str:
    """One warning line for ``shared_hit_mismatches``: each row (1-based, its op, bytes and group)
    with the ranks and their counts; empty string when there is none."""
    if not mismatches:
        return ""

    def one(i: int, seen: Mapping[int, int]) -> str:
        cells = plan_rows[i].cells
        counts = ", ".join(f"rank {r}: {n}" for r, n in seen.items())
        return f"row {i + 1} ({cells[0]},{cells[1]}-{cells[2]} B, group {cells[11]}) {counts}"
    listed = "; ".join(one(i, seen) for i, seen in mismatches[:max_listed])
    rest = f"; and {len(mismatches) - max_listed} more" if len(mismatches) > max_listed else ""
    return (f"lagom: WARNING: ranks of one communicator matched tuner rows a different number of times, so NCCL "
            f"may have chosen differently on them: {listed}{rest}")
