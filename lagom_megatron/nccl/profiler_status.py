"""Reads, in this process, what NCCL reported to the profiler half of lagom's plugin (``nccl/plugin/observed.c``): per
communicator, each op's algorithm, protocol, channels, warps, proxy chunk and kernel time. NCCL loads it through
``NCCL_PROFILER_PLUGIN`` (v2.30.7 ``src/plugin/profiler.cc:46-111``); opened ``RTLD_NOLOAD``."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from lagom_megatron.nccl.plugin_status import open_loaded

STATES = {0: "not initialised", 1: "lagom", 2: "foreign", 3: "none"}
"""``lagomProfilerState`` values (``plugin_internal.h``, ``LAGOM_PROFILER_STATE_*``)."""


@dataclass(frozen=True)
class ObservedOp:
    """One bucket of a communicator's records: the calls NCCL ran with one shape and choice.

    ``count``: elements of NCCL's task (all-gather: per rank; reduce-scatter: the output's; all-gather and broadcast
    as ``ncclInt8`` bytes, ``src/enqueue.cc:2785-2789`` @v2.30.7); ``channels``: ABI v1-v3 NCCL's maximum, p2p before
    v4 0; ``chunk``: largest proxy chunk, bytes; ``kernel_ns``: GPU time of the ``kernel_calls`` fully timed calls."""

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
    """One communicator's records; ``rank`` / ``n_ranks`` / ``n_nodes`` -1 and ``name`` None before ABI v4; ``dropped``:
    calls without kernel time; ``overflow``: calls of shapes beyond the record's capacity."""

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


def set_recording(on: bool, *, reset: bool = False, library: str | None = None) -> bool:
    """Turns lagom's profiler events on or off, optionally resetting the records; False if the library is not loaded."""
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
        return (f"lagom: note: NCCL_PROFILER_PLUGIN={foreign!r} is another profiler plugin; lagom leaves it in "
                "place and checks only the tuner's row hits, not what NCCL ran")
    return (f"lagom: note: lagom's profiler half is not loaded by NCCL in this process ({state}; "
            "NCCL_PROFILER_PLUGIN unset or none, or NCCL < 2.23): what NCCL ran is not checked")
