"""Whether NCCL really loaded lagom's tuner plugin in this process, and its row hits: the library in ``/proc/self/maps``
(NCCL loads it once, v2.30.7 ``src/os/linux.cc:52``, ``src/plugin/plugin_open.cc:41``, ``src/plugin/tuner.cc:39-56``),
opened ``RTLD_NOLOAD``, answers through its ``lagomTuner*`` exports (``nccl/plugin/status.c``)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LIBRARY_NAME = "libnccl-tuner-lagom.so"


@dataclass(frozen=True)
class PluginStatus:
    """lagom's plugin status here: ``abi_version`` 0 before a communicator; ``row_hits``: ``getCollInfo`` matches."""

    path: str
    abi_version: int
    init_count: int
    row_hits: tuple[int, ...]
    table_loaded: bool
    table_failures: int = 0


def loaded_library_path(maps_file: str = "/proc/self/maps") -> str | None:
    """Path of lagom's plugin library if ``maps_file`` (``/proc/<pid>/maps`` format) maps it, else None."""
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
    """lagom's library as mapped in this process, opened ``RTLD_NOLOAD``; None if unmapped."""
    path = library or loaded_library_path()
    if path is None:
        return None
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return None


def read_plugin_status(library: str | None = None, max_rows: int = 4096) -> PluginStatus | None:
    """The status lagom's plugin reports here; None if not loaded or no status exports (ValueError: max_rows < 0)."""
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
    return PluginStatus(
        path=path,
        abi_version=int(abi()),
        init_count=int(inits()),
        row_hits=rows,
        table_loaded=n >= 0,
        table_failures=int(failures()) if failures is not None else 0,
    )


def summarize_hits(status: PluginStatus | None, plan_rows: Sequence[Any], *, max_listed: int = 8) -> str:
    """One log line: which planned rows (``export.tuner_rows(plan, extended=True)``) NCCL matched, which never."""
    if status is None:
        return (
            "lagom: tuner plugin not loaded by NCCL in this process: none of the "
            f"{len(plan_rows)} planned rows can have been applied"
        )
    if status.init_count == 0:
        return (
            "lagom: tuner plugin mapped in this process but NCCL initialised no communicator with it: none "
            f"of the {len(plan_rows)} planned rows can have been applied"
        )
    head = f"lagom: tuner plugin ABI v{status.abi_version}, {status.init_count} communicator(s)"
    if status.table_failures:
        head += f", {status.table_failures} unreadable table load(s)"
    if not status.table_loaded:
        return f"{head}: no plan table loaded; none of the {len(plan_rows)} planned rows applied"
    if len(status.row_hits) != len(plan_rows):
        return (
            f"{head}: the loaded table has {len(status.row_hits)} rows, the plan {len(plan_rows)}: "
            "it is not this plan's table"
        )
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


def shared_hit_mismatches(
    row_groups: Sequence[str],
    reports: Sequence[tuple[Sequence[int] | None, Mapping[str, Sequence[int]]]],
) -> list[tuple[int, dict[int, int]]]:
    """``(row, {rank: hits})`` for each row whose hit counts differ among one communicator's member ranks, in file
    order. ``reports[rank]``: (its ``row_hits`` or None, group -> the ranks of its instance)."""
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


def describe_mismatches(
    mismatches: Sequence[tuple[int, Mapping[int, int]]], plan_rows: Sequence[Any], *, max_listed: int = 8
) -> str:
    """One warning line for ``shared_hit_mismatches`` (each row with its ranks' counts); "" when none."""
    if not mismatches:
        return ""

    def one(i: int, seen: Mapping[int, int]) -> str:
        cells = plan_rows[i].cells
        counts = ", ".join(f"rank {r}: {n}" for r, n in seen.items())
        return f"row {i + 1} ({cells[0]},{cells[1]}-{cells[2]} B, group {cells[11]}) {counts}"

    listed = "; ".join(one(i, seen) for i, seen in mismatches[:max_listed])
    rest = f"; and {len(mismatches) - max_listed} more" if len(mismatches) > max_listed else ""
    return (
        f"lagom: WARNING: ranks of one communicator matched tuner rows a different number of times, so NCCL "
        f"may have chosen differently on them: {listed}{rest}"
    )


STATES = {0: "not initialised", 1: "lagom", 2: "foreign", 3: "none"}
"""``lagomProfilerState`` values (``plugin_internal.h``, ``LAGOM_PROFILER_STATE_*``)."""


@dataclass(frozen=True)
class ObservedOp:
    """The calls NCCL ran with one shape and choice; ``kind``: ``coll`` or ``p2p`` (SM kernels) or ``ce`` (copy
    engines, ABI v6+: ``algo`` ``CE``, no protocol, 0 channels and warps, no kernel time; ``copies`` and
    ``copy_bytes``: the copies of its batches, ``nccl/plugin/observed.c``); ``count``: elements of NCCL's task
    (all-gather: per rank; reduce-scatter: the output's; all-gather, broadcast: ``ncclInt8``, v2.30.7
    ``src/enqueue.cc:2785-2789``, the same for a CE all-gather); ``channels``: ABI v1-v3 NCCL's maximum, p2p before v4
    0; ``chunk``: largest proxy chunk, bytes; ``kernel_ns``: GPU time of the ``kernel_calls`` fully timed calls."""

    kind: str
    func: str
    count: int
    dtype: str
    algo: str | None
    proto: str | None
    channels: int
    warps: int
    calls: int
    chunk: int
    kernel_ns: int
    kernel_calls: int
    abi: int = 0
    n_ranks: int = 0
    n_nodes: int = 0
    copies: int = 0
    copy_bytes: int = 0


@dataclass(frozen=True)
class ObservedComm:
    """A communicator's records (-1/None before ABI v4); ``dropped``: untimed calls; ``overflow``: untracked shapes."""

    comm_hash: int
    rank: int
    n_ranks: int
    n_nodes: int
    abi: int
    tag: str | None
    name: str | None
    dropped: int
    overflow: int
    ops: tuple[ObservedOp, ...]

    def keys(self) -> set[str]:
        """The names the communicator is known by: its tag and its commName."""
        return {k for k in (self.tag, self.name) if k}


def _fields(line: str, n: int) -> tuple[str, dict[str, str]]:
    parts = line.split()
    try:
        return parts[0], dict(p.split("=", 1) for p in parts[2:])
    except ValueError:
        raise ValueError(f"profiler snapshot line {n}: expected key=value fields; got {line!r}") from None


def parse_snapshot(text: str) -> list[ObservedComm]:
    """The communicators of a ``lagomProfilerSnapshot`` text; ValueError names a bad line."""
    comms: list[dict] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        kind, kv = _fields(line, n)
        try:
            if kind == "comm":
                comms.append(
                    {
                        "comm_hash": int(kv["hash"], 16),
                        "rank": int(kv["rank"]),
                        "n_ranks": int(kv["nranks"]),
                        "n_nodes": int(kv["nnodes"]),
                        "abi": int(kv["abi"]),
                        "tag": None if kv["tag"] == "-" else kv["tag"],
                        "name": None if kv["name"] == "-" else kv["name"],
                        "dropped": int(kv["dropped"]),
                        "overflow": int(kv["overflow"]),
                        "ops": [],
                    }
                )
            elif kind in ("coll", "p2p", "ce"):
                if not comms:
                    raise ValueError("an op line before any comm line")
                comms[-1]["ops"].append(
                    ObservedOp(
                        kind=kind,
                        func=kv["func"],
                        count=int(kv["count"]),
                        dtype=kv["dtype"],
                        algo=None if kv["algo"] == "-" else kv["algo"],
                        proto=None if kv["proto"] == "-" else kv["proto"],
                        channels=int(kv["channels"]),
                        warps=int(kv["warps"]),
                        calls=int(kv["calls"]),
                        chunk=int(kv["chunk"]),
                        kernel_ns=int(kv["kernel_ns"]),
                        kernel_calls=int(kv["kernel_calls"]),
                        abi=comms[-1]["abi"],
                        n_ranks=comms[-1]["n_ranks"],
                        n_nodes=comms[-1]["n_nodes"],
                        copies=int(kv.get("copies", 0)),
                        copy_bytes=int(kv.get("copy_bytes", 0)),
                    )
                )
            else:
                raise ValueError(f"unknown record kind {kind!r} (comm, coll, p2p or ce)")
        except KeyError as exc:
            raise ValueError(f"profiler snapshot line {n}: missing field {exc.args[0]!r} in {line!r}") from None
        except ValueError as exc:
            raise ValueError(f"profiler snapshot line {n}: {exc} in {line!r}") from None
    return [ObservedComm(**{**c, "ops": tuple(c["ops"])}) for c in comms]


def _library(library: str | None) -> ctypes.CDLL | None:
    lib = open_loaded(library)
    return lib if lib is not None and hasattr(lib, "lagomProfilerSnapshot") else None


def read_observed(library: str | None = None) -> list[ObservedComm] | None:
    """This process's records; None when lagom's library (default: the mapped one) is absent or has no profiler half."""
    lib = _library(library)
    if lib is None:
        return None
    fn = lib.lagomProfilerSnapshot
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(buf, size)
        if n < size:
            return parse_snapshot(buf.value.decode("utf-8", "replace"))
        size = n + 4096  # records grew between the calls at most by a little


def set_next_comm(tag: str | None, table: str | None, library: str | None = None) -> bool:
    """Names the communicators NCCL creates next in this process for lagom's plugin (``tag`` keys their rows,
    ``table`` is the plan table or ``"none"``) until called with two Nones, through the mapped library's
    ``lagomSetNextComm`` rather than the environment: ``setenv`` races with ``getenv`` in torch's and NCCL's threads.
    False when the library is not mapped here (NCCL loaded no lagom plugin) or refused a value longer than it keeps."""
    lib = open_loaded(library)
    fn = getattr(lib, "lagomSetNextComm", None) if lib is not None else None
    if fn is None:
        return False
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p]
    return fn(*(v.encode() if v is not None else None for v in (tag, table))) == 0


def set_recording(on: bool, *, reset: bool = False, library: str | None = None) -> bool:
    """Turns lagom's profiler events on (what NCCL ran, level 1: coll, p2p, proxyOp and, ABI v6+, the copy-engine
    collectives and their batches; never KernelCh, whose proxy ops would change what is timed:
    ``nccl/plugin/observed.c``) or off, optionally resetting the records; False if the library is absent."""
    lib = _library(library)
    if lib is None:
        return False
    if reset:
        lib.lagomProfilerReset()
    lib.lagomProfilerSetActive(ctypes.c_int(1 if on else 0))
    return True


def profiler_state(library: str | None = None) -> tuple[str, str]:
    """(``STATES`` value, the other library ``NCCL_PROFILER_PLUGIN`` names or ""); ("not loaded", "") if unmapped."""
    lib = _library(library)
    if lib is None:
        return "not loaded", ""
    lib.lagomProfilerState.restype = ctypes.c_int
    lib.lagomProfilerForeign.restype = ctypes.c_char_p
    foreign = lib.lagomProfilerForeign() or b""
    return STATES.get(int(lib.lagomProfilerState()), "not initialised"), foreign.decode("utf-8", "replace")


def not_recording_note(state: str, foreign: str) -> str:
    """The log line saying why lagom's profiler half records nothing in this process (from ``profiler_state``)."""
    if state == "foreign":
        return (
            f"lagom: note: NCCL_PROFILER_PLUGIN={foreign!r} is another profiler plugin; lagom leaves it in "
            "place and checks only the tuner's row hits, not what NCCL ran"
        )
    return (
        f"lagom: note: lagom's profiler half is not loaded by NCCL in this process ({state}; "
        "NCCL_PROFILER_PLUGIN unset or none, or NCCL < 2.23): what NCCL ran is not checked"
    )
