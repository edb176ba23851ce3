"""Reads, in this process, what NCCL reported to the profiler half of lagom's plugin: per
communicator, the collectives and point-to-point operations it ran, with the algorithm, protocol,
channels and warps it chose, the proxy's chunk size and the GPU kernel time.

The records are kept by ``nccl/plugin/observed.c`` in the library NCCL loaded (one library holds
the tuner and the profiler halves; NCCL loads it as its profiler when ``NCCL_PROFILER_PLUGIN``
names it, NVIDIA/nccl v2.30.7 ``src/plugin/profiler.cc:46-111``). As for the tuner's status
(``plugin_status``), the library is never loaded here: it is found in the process's memory map
and opened with ``RTLD_NOLOAD``, then these exports are called through ctypes:

- ``int lagomProfilerSnapshot(char *buf, int capacity)``: the records as text (``parse_snapshot``);
- ``void lagomProfilerSetActive(int on)``: NCCL's activation mask to lagom's events, or to 0 (no
  event at all: the cost outside the phases that read the records is nothing);
- ``void lagomProfilerReset(void)``: forget every record (call with no collective in flight);
- ``int lagomProfilerState(void)``, ``const char *lagomProfilerForeign(void)``: whether NCCL
  initialised lagom's profiler half, or ``NCCL_PROFILER_PLUGIN`` names another library (kept);
- ``int lagomProfilerAbiVersion(void)``, ``int lagomProfilerInitCount(void)``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from lagom_megatron.nccl.plugin_status import open_loaded

STATES = {0: "not initialised", 1: "lagom", 2: "foreign", 3: "none"}
"""``lagomProfilerState`` values (``plugin_internal.h``, ``LAGOM_PROFILER_STATE_*``): NCCL has not
initialised lagom's profiler half (yet); it has; ``NCCL_PROFILER_PLUGIN`` names another library;
it is unset or ``none``."""


@dataclass(frozen=True)
class ObservedOp:
    """One bucket of a communicator's records: every call NCCL ran with the same shape and choice.

    Attributes:
        kind: ``coll`` or ``p2p``.
        func: NCCL's name (``AllReduce``, ``AllGather``, ``ReduceScatter``, ``Send``, ...).
        count: elements of the call as NCCL's task holds them (all-gather: per rank;
            reduce-scatter: the output's). For all-gather and broadcast NCCL counts bytes and
            names the datatype ``ncclInt8`` (``src/enqueue.cc:2785-2789`` at v2.30.7, the same
            since 2.23), so ``count`` x the datatype's size is the call's bytes either way.
        dtype: NCCL's name (``ncclBfloat16``, ...).
        algo, proto: NCCL's names (``RING``, ``SIMPLE``, ...); None for p2p.
        channels: channels the task ran on (v1-v3: the maximum NCCL allowed it; p2p before v4: 0).
        warps: warps per CTA (threads / 32); 0 for p2p.
        calls: calls of this shape.
        chunk: the largest proxy chunk seen, bytes (chunk size x slice steps; 0 = no network proxy op).
        kernel_ns: summed kernel time of the calls whose channels all reported, ns (GPU globaltimer).
        kernel_calls: how many calls that sum covers.
        abi, n_ranks, n_nodes: the profiler ABI and the sizes of the communicator the record is
            of (``ObservedComm``; 0 where the record was built without one), which the channel
            rule of ``nccl.observed.nccl_coll_channels`` needs.
    """

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


@dataclass(frozen=True)
class ObservedComm:
    """The records of one communicator. ``tag`` is lagom's ``LAGOM_TUNER_COMM_TAG`` at its creation,
    ``name`` NCCL's commName (profiler ABI v4+); None where absent. ``rank``, ``n_ranks``,
    ``n_nodes`` are -1 before profiler ABI v4. ``dropped``: calls whose kernel time was not kept
    (no free slot); ``overflow``: calls of more distinct shapes than the record keeps."""

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
    """(record kind, its key=value fields) of ``<kind> <index> key=value ...``."""
    parts = line.split()
    try:
        return parts[0], dict(p.split("=", 1) for p in parts[2:])
    except ValueError:
        raise ValueError(f"profiler snapshot line {n}: expected key=value fields; got {line!r}") from None


def parse_snapshot(text: str) -> list[ObservedComm]:
    """The communicators of a ``lagomProfilerSnapshot`` text (format in ``nccl/plugin/observed.c``).

    Raises:
        ValueError: a line that is not a ``comm``, ``coll`` or ``p2p`` record, a missing or
            non-integer field, or an op line before any communicator (names the line).
    """
    comms: list[dict] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        kind, kv = _fields(line, n)
        try:
            if kind == "comm":
                comms.append({"comm_hash": int(kv["hash"], 16), "rank": int(kv["rank"]), "n_ranks": int(kv["nranks"]),
                              "n_nodes": int(kv["nnodes"]), "abi": int(kv["abi"]),
                              "tag": None if kv["tag"] == "-" else kv["tag"],
                              "name": None if kv["name"] == "-" else kv["name"],
                              "dropped": int(kv["dropped"]), "overflow": int(kv["overflow"]), "ops": []})
            elif kind in ("coll", "p2p"):
                if not comms:
                    raise ValueError("an op line before any comm line")
                comms[-1]["ops"].append(ObservedOp(
                    kind=kind, func=kv["func"], count=int(kv["count"]), dtype=kv["dtype"],
                    algo=None if kv["algo"] == "-" else kv["algo"], proto=None if kv["proto"] == "-" else kv["proto"],
                    channels=int(kv["channels"]), warps=int(kv["warps"]), calls=int(kv["calls"]),
                    chunk=int(kv["chunk"]), kernel_ns=int(kv["kernel_ns"]), kernel_calls=int(kv["kernel_calls"]),
                    abi=comms[-1]["abi"], n_ranks=comms[-1]["n_ranks"], n_nodes=comms[-1]["n_nodes"]))
            else:
                raise ValueError(f"unknown record kind {kind!r} (comm, coll or p2p)")
        except KeyError as exc:
            raise ValueError(f"profiler snapshot line {n}: missing field {exc.args[0]!r} in {line!r}") from None
        except ValueError as exc:
            raise ValueError(f"profiler snapshot line {n}: {exc} in {line!r}") from None
    return [ObservedComm(**{**c, "ops": tuple(c["ops"])}) for c in comms]


def _library(library: str | None) -> ctypes.CDLL | None:
    lib = open_loaded(library)
    return lib if lib is not None and hasattr(lib, "lagomProfilerSnapshot") else None


def read_observed(library: str | None = None) -> list[ObservedComm] | None:
    """This process's records (``parse_snapshot``), or None when lagom's library is not loaded or
    predates the profiler half. ``library``: the path of an already loaded library (default: the one
    in the memory map)."""
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


def set_recording(on: bool, *, reset: bool = False, library: str | None = None) -> bool:
    """Switches NCCL's profiler events for lagom on (``on``) or off (activation mask 0); with
    ``reset``, forgets the records first. Returns False when lagom's library is not loaded."""
    lib = _library(library)
    if lib is None:
        return False
    if reset:
        lib.lagomProfilerReset()
    lib.lagomProfilerSetActive(ctypes.c_int(1 if on else 0))
    return True


def profiler_state(library: str | None = None) -> tuple[str, str]:
    """(``STATES`` value, the other library ``NCCL_PROFILER_PLUGIN`` names or "") of this process;
    ("not loaded", "") when lagom's library is not mapped."""
    lib = _library(library)
    if lib is None:
        return "not loaded", ""
    lib.lagomProfilerState.restype = ctypes.c_int
    lib.lagomProfilerForeign.restype = ctypes.c_char_p
    foreign = lib.lagomProfilerForeign() or b""
    return STATES.get(int(lib.lagomProfilerState()), "not initialised"), foreign.decode("utf-8", "replace")


def not_recording_note(state: str, foreign: str) -> str:
    """The log line saying why lagom's profiler half records nothing in this process, from
    ``profiler_state``: another profiler plugin is kept, or NCCL loaded none of lagom's."""
    if state == "foreign":
        return (f"lagom: note: NCCL_PROFILER_PLUGIN={foreign!r} is another profiler plugin; lagom leaves it in "
                "place and checks only the tuner's row hits, not what NCCL ran")
    return (f"lagom: note: lagom's profiler half is not loaded by NCCL in this process ({state}; "
            "NCCL_PROFILER_PLUGIN unset or none, or NCCL < 2.23): what NCCL ran is not checked")
