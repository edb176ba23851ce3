"""Reads the output of one nccl-tests run as ``scripts/gpu/nccl_sweep.sh`` saves it, for ``lagom calibrate bandwidth``.
Follows NVIDIA/nccl-tests v2.19.6 (``src/util.cu:487-511, 623-640, 667-706, 744-760, 771-780``, ``common.cu:895-896,
936-941, 1831``), checks algbw = size / time, busbw = algbw x factor (doc/PERFORMANCE.md; ``src/all_gather.cu:38-44``,
``all_reduce.cu:59-65``, ``reduce_scatter.cu:37-43``, ``alltoall.cu:48-54``, ``sendrecv.cu:38-44``), and ``SWEEP_TAG``
against NCCL v2.30.7's INFO lines (``src/init.cc:1646-1647``, ``src/graph/tuning.cc:455, 460``,
``src/misc/param.cc:100``, ``debug.cc:343-354``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

SWEEP_TAG = "# lagom-sweep"
PERF_OPS: dict[str, str] = {
    "all_gather": "Ring",
    "reduce_scatter": "Ring",
    "all_reduce": "Ring",
    "alltoall": "P2P",
    "sendrecv": "P2P",
}
"""nccl-tests binary stem (``<op>_perf``) -> the algorithm the sweep pins (Ring; P2P for send/recv and all-to-all)."""
PROTOCOL_NAMES = ("LL", "LL128", "Simple")
MAX_CHANNELS = 64
"""MAXCHANNELS (v2.30.7 src/include/device.h:91), capping NCCL_MIN/MAX_NCHANNELS (src/graph/connect.cc:334-358)."""
WARP_SIZE = 32
"""NCCL_NTHREADS is a multiple of it, 64..512 for Simple and LL (tuning.cc:17-33, 244-256; device.h:90-97); LL128 and
P2P kernels run 640 (tuning.cc:255-256; NCCL_MAX_NTHREADS, src/enqueue.cc:1135)."""
FIXED_THREADS = 640
ROW_COLUMNS = ("size", "count", "type", "redop", "root")
HALF_COLUMNS = ("time", "algbw", "busbw", "#wrong")
ITER_COLUMNS = ("i_min", "i_max", "i_p99", "i_cv%")
EXPECTED_ROW = (
    "a result row: size count type redop root, then time algbw busbw #wrong for out-of-place and "
    "again for in-place (nccl-tests' table), or an NCCL log line"
)

_NCCL_LOG = re.compile(r"\bNCCL (?:INFO|WARN|TRACE|CALL)\b|^(?:\[[^\]]*\]\s*)?NCCL version ")
_DEVICE = re.compile(r"^#\s+Rank\s+(\d+)\s+Group\s+(\d+)\s+Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s*(.*)$")
_STARTING = re.compile(r"^# Collective test starting: (\S+)")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")
_COLL_CHANNELS = re.compile(r"NCCL INFO (\d+) coll channels")
_P2P_CHANNELS = re.compile(r"\b(\d+) p2p channels,")
_ENV = {
    "protocol": re.compile(r"NCCL_PROTO set by environment to (\S+)"),
    "algorithm": re.compile(r"NCCL_ALGO set by environment to (\S+)"),
    "threads": re.compile(r"NCCL_NTHREADS set by environment to (\d+)"),
}
_BAD_THREADS = re.compile(r"Invalid NCCL_NTHREADS \d+[^\n]*")


@dataclass(frozen=True, slots=True)
class PerfRow:
    """One measurement: a row's out-of-place or in-place half."""

    line: int
    size: int
    """Bytes (nccl-tests' size column: the larger of the send and receive buffers)."""
    time_us: float
    """Mean time of one call, us: the time column, or size / algbw where that has more significant digits."""
    algbw: float
    busbw: float
    """GB/s (1e9 bytes per second), as printed."""
    in_place: bool


@dataclass(frozen=True, slots=True)
class PerfRun:
    """One nccl-tests run: its settings (the sweep line, checked against NCCL's own lines) and rows."""

    path: str
    op: str
    algorithm: str
    protocol: str
    channels: int
    """Channels NCCL logged, else ``asked_channels`` (P2P: next power of two, src/graph/paths.cc:984-990)."""
    asked_channels: int
    threads: int
    nodes: int
    ranks: int | None
    """Ranks of one group (``#  Rank`` lines of group 0), or from busbw / algbw; None if unknown."""
    bus_factor: float
    """busbw / algbw of the table (PERFORMANCE.md's factor)."""
    rows: tuple[PerfRow, ...]
    gpu: str | None = None
    nccl_version: str | None = None


class PerfFormatError(ValueError):
    """Not readable as nccl-tests output; ``problems`` lists each ``file:line: problem``."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


def read_perf_run(path: str | Path) -> PerfRun:
    """Parses one run's saved output, rows in file order; PerfFormatError (every ``file:line: problem``) or OSError."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise PerfFormatError(f"{path}: not a text file (byte {exc.start}: {exc.reason})") from None
    return _Parser(str(path), lines).run()


class _Parser:
    def __init__(self, path: str, lines: list[str]) -> None:
        self.path, self.lines, self.problems, self.timestamp = path, lines, [], False
        self.settings, self.settings_line = None, 0

    def bad(self, n: int, message: str) -> None:
        self.problems.append(f"{self.path}:{n}: {message}")

    def run(self) -> PerfRun:
        devices, channels, env, version, starting = [], {"coll": {}, "p2p": {}}, [], None, None
        header: list[str] | None = None
        rows: list[PerfRow] = []
        busbw_cells: list[str] = []
        avg = None
        for n, line in enumerate(self.lines, start=1):
            text = line.strip()
            if _NCCL_LOG.search(text):
                version = version or (m.group(1) if (m := _VERSION.search(text)) else None)
                for kind, rx in (("coll", _COLL_CHANNELS), ("p2p", _P2P_CHANNELS)):
                    if m := rx.search(text):
                        channels[kind].setdefault(int(m.group(1)), n)
                env += [(n, key, m.group(1).rstrip(".")) for key, rx in _ENV.items() if (m := rx.search(text))]
                if m := _BAD_THREADS.search(text):
                    self.bad(n, f"NCCL refused the thread count: {m.group(0)!r}")
                continue
            if text.startswith(SWEEP_TAG):
                self._sweep_line(n, text)
            elif header is None or avg is not None:
                if m := _DEVICE.match(text):
                    devices.append((int(m.group(1)), int(m.group(2)), m.group(3), m.group(4).strip()))
                elif m := _STARTING.match(text):
                    starting = (n, m.group(1))
                elif text.startswith("#") and {"size", "count", "busbw"} <= set(text[1:].split()):
                    if header is None:
                        header = self._header(n, text)
                    else:
                        self.bad(n, "a second result table: one nccl-tests run per file")
            elif m := _AVG.match(text):
                avg = (n, m.group(1))
            elif text.startswith("#") or not text:
                continue
            else:
                rows += self._row(n, text, header, busbw_cells)
        return self._finish(header, rows, busbw_cells, avg, devices, channels, env, version, starting)

    def _sweep_line(self, n: int, text: str) -> None:
        if self.settings is not None:
            self.bad(n, f"a second {SWEEP_TAG!r} line (the first is line {self.settings_line}); one run per file")
            return
        fields: dict[str, str] = {}
        for token in text[len(SWEEP_TAG) :].split():
            key, eq, value = token.partition("=")
            if not eq or key in fields:
                self.bad(n, f"{SWEEP_TAG} line: expected key=value tokens, each key once; got {token!r}")
                return
            fields[key] = value
        want = ("op", "algorithm", "protocol", "channels", "threads", "nodes")
        if sorted(fields) != sorted(want):
            self.bad(n, f"{SWEEP_TAG} line must have exactly the keys {list(want)}; got {sorted(fields)}")
            return
        checks = [
            ("op", fields["op"] in PERF_OPS, f"one of {list(PERF_OPS)}"),
            (
                "algorithm",
                fields["algorithm"] == PERF_OPS.get(fields["op"]),
                f"{PERF_OPS.get(fields['op'], 'Ring or P2P')} for this op",
            ),
            (
                "protocol",
                fields["protocol"] in PROTOCOL_NAMES
                and (fields["algorithm"] != "P2P" or fields["protocol"] == "Simple"),
                f"one of {list(PROTOCOL_NAMES)} (Simple for P2P)",
            ),
            ("channels", _int_in(fields["channels"], 1, MAX_CHANNELS), f"an integer in 1..{MAX_CHANNELS}"),
            (
                "threads",
                _threads_ok(fields["threads"], fields["protocol"], fields["algorithm"]),
                f"a multiple of {WARP_SIZE} in 64..512 for Simple and LL, {FIXED_THREADS} for LL128 and P2P",
            ),
            ("nodes", _int_in(fields["nodes"], 1, None), "an integer >= 1"),
        ]
        for key, ok, allowed in checks:
            if not ok:
                self.bad(n, f"{SWEEP_TAG} line: {key} must be {allowed}; got {fields[key]!r}")
                return
        self.settings, self.settings_line = fields, n

    def _header(self, n: int, text: str) -> list[str]:
        names = [c.replace("cputime", "time") for c in text[1:].split() if c != "timestamp"]
        half = list(HALF_COLUMNS) + (list(ITER_COLUMNS) if "i_min" in names else [])
        if names != list(ROW_COLUMNS) + half + half:
            self.bad(n, f"table header: expected columns {' '.join(ROW_COLUMNS + tuple(half) * 2)}; got {text!r}")
        self.timestamp = "timestamp" in text.split()
        return half + half

    def _row(self, n: int, text: str, header: list[str], busbw_cells: list[str]) -> list[PerfRow]:
        """The row's usable halves; every printed busbw goes to ``busbw_cells`` (the footer's mean counts them all)."""
        tokens = text.split()
        want = len(ROW_COLUMNS) + len(header) + (2 if self.timestamp else 0)
        if len(tokens) != want or not (tokens[0].isdigit() and tokens[1].isdigit() and tokens[4].lstrip("-").isdigit()):
            self.bad(
                n,
                f"expected {EXPECTED_ROW}: {want} columns, size, count and root integers; "
                f"got {len(tokens)} columns: {text[:80]!r}",
            )
            return []
        size = int(tokens[0])
        out = []
        for half, start in ((False, len(ROW_COLUMNS)), (True, len(ROW_COLUMNS) + _last(header, "time"))):
            cells = dict(zip(HALF_COLUMNS, tokens[start : start + 4]))
            where = "in-place" if half else "out-of-place"
            values = {}
            for key in ("time", "algbw", "busbw"):
                value = _float(cells[key])
                if value is None or value < 0:
                    self.bad(n, f"{where} {key} must be a finite number >= 0; got {cells[key]!r}")
                    return []
                values[key] = value
            busbw_cells.append(cells["busbw"])
            wrong = cells["#wrong"]
            if wrong != "N/A" and (_float(wrong) is None or _float(wrong) != 0):
                self.bad(
                    n,
                    f"{where} #wrong is {wrong}: NCCL returned wrong data for this size (expected 0 or N/A); "
                    "its time says nothing about a working configuration",
                )
                return []
            t, alg = values["time"], values["algbw"]
            if size == 0 or t == 0:
                continue
            t_alg = size / (alg * 1e3) if alg > 0 else math.inf
            tol = 2.0 * (_rel_ulp(cells["time"], t) + _rel_ulp(cells["algbw"], alg)) + 0.01
            if alg > 0 and abs(t_alg - t) > tol * t:
                self.bad(
                    n,
                    f"{where}: size / time = {size / (t * 1e3):.4g} GB/s but algbw is {cells['algbw']} "
                    "(nccl-tests prints algbw = size / time)",
                )
                return []
            better = t_alg if alg > 0 and _rel_ulp(cells["algbw"], alg) < _rel_ulp(cells["time"], t) else t
            out.append(PerfRow(line=n, size=size, time_us=better, algbw=alg, busbw=values["busbw"], in_place=half))
        return out

    def _finish(self, header, rows, busbw_cells, avg, devices, channels, env, version, starting) -> PerfRun:
        last = len(self.lines)
        if self.settings is None and not any(SWEEP_TAG in p for p in self.problems):
            self.bad(
                1,
                f"no {SWEEP_TAG!r} line: nccl-tests does not print the NCCL settings of a run; "
                f"scripts/gpu/nccl_sweep.sh writes it (format: '{SWEEP_TAG} op=all_gather algorithm=Ring "
                "protocol=Simple channels=8 threads=256 nodes=1')",
            )
        if header is None:
            self.bad(
                last,
                "no result table: no '#  size  count  type  redop  root  time  algbw  busbw  #wrong ...' "
                "header line (did the run fail before its first size?)",
            )
        elif avg is None:
            self.bad(last, "the table has no '# Avg bus bandwidth' footer: the run stopped before its last size")
        if self.problems:
            raise PerfFormatError(self.problems)
        s = self.settings
        self._check_nccl_lines(s, env, starting)
        avg_value = _float(avg[1])
        if avg_value is None:
            self.bad(avg[0], f"Avg bus bandwidth must be a number; got {avg[1]!r}")
        elif busbw_cells:
            mean = sum(float(c) for c in busbw_cells) / len(busbw_cells)
            tol = max(_ulp(c) for c in busbw_cells) + 1e-3 * max(mean, avg_value) + 1e-6
            if abs(mean - avg_value) > tol:
                self.bad(
                    avg[0],
                    f"Avg bus bandwidth {avg[1]} is not the mean {mean:.4g} of the table's busbw "
                    "columns: rows are missing or were edited",
                )
        group = [d for d in devices if d[1] == 0]
        ranks = len(group) or None
        nodes = len({d[2] for d in group}) if group else int(s["nodes"])
        if group and nodes != int(s["nodes"]):
            self.bad(
                self.settings_line,
                f"the sweep line says nodes={s['nodes']} but the '#  Rank' lines name "
                f"{nodes} hosts: {sorted({d[2] for d in group})}",
            )
        factor, ranks = self._bus_factor(rows, s["op"], ranks)
        kind = "p2p" if s["algorithm"] == "P2P" else "coll"
        if len(channels[kind]) > 1:
            where = ", ".join(f"{v} (line {ln})" for v, ln in sorted(channels[kind].items()))
            self.bad(
                min(channels[kind].values()),
                f"ranks report different {kind} channel counts: {where}; "
                "the channel variables did not reach every rank",
            )
        if self.problems:
            raise PerfFormatError(self.problems)
        asked = int(s["channels"])
        ran = next(iter(channels[kind]), None) or (1 << (asked - 1).bit_length() if kind == "p2p" else asked)
        return PerfRun(
            path=self.path,
            op=s["op"],
            algorithm=s["algorithm"],
            protocol=s["protocol"],
            channels=ran,
            asked_channels=asked,
            threads=int(s["threads"]),
            nodes=nodes,
            ranks=ranks,
            bus_factor=factor or 0.0,
            rows=tuple(rows),
            gpu=", ".join(sorted({d[3] for d in group})) or None,
            nccl_version=version,
        )

    def _check_nccl_lines(self, s, env, starting) -> None:
        if starting and not starting[1].startswith(s["op"] + "_perf"):
            self.bad(starting[0], f"the run is {starting[1]} but the sweep line says op={s['op']}")
        for n, key, value in env:
            if key == "threads" and (s["protocol"] == "LL128" or s["algorithm"] == "P2P"):
                continue  # LL128 and P2P kernels do not read NCCL_NTHREADS
            if key != "threads" and s["algorithm"] == "P2P":
                continue  # point-to-point picks its own protocol (src/enqueue.cc:931-933)
            if value.lower() != s[key].lower():
                self.bad(n, f"NCCL says it ran {key} {value} but the sweep line says {key}={s[key]}")

    def _bus_factor(self, rows, op, ranks) -> tuple[float | None, int | None]:
        """PERFORMANCE.md's factor for ``op``, checked on each row, and the ranks (inferred without ``#  Rank``)."""
        usable = [r for r in rows if r.algbw > 0]
        if not usable:
            return None, ranks
        ratio = sum(r.busbw * r.algbw for r in usable) / sum(r.algbw**2 for r in usable)
        if ranks is None:
            ranks = _ranks_from_factor(op, ratio)
        factor = ratio if ranks is None else _factor(op, ranks)
        off = [r for r in usable if abs(r.busbw - factor * r.algbw) > 0.02 + 0.01 * r.busbw]
        if 2 * len(off) > len(usable):
            self.bad(
                usable[-1].line,
                f"busbw / algbw = {ratio:.4f}, but {op} on {ranks} ranks has factor {factor:.4f} "
                "(nccl-tests doc/PERFORMANCE.md)",
            )
        for r in off if 2 * len(off) <= len(usable) else ():
            self.bad(
                r.line,
                f"busbw {r.busbw} is not {factor:.4f} x algbw {r.algbw} ({op} on {ranks} ranks, "
                "nccl-tests doc/PERFORMANCE.md)",
            )
        return (None if off else factor), ranks


def _factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    return 1.0 if op == "sendrecv" else (n - 1) / n


def _ranks_from_factor(op: str, factor: float) -> int | None:
    if op == "sendrecv" or factor <= 0:
        return None
    share = factor / 2.0 if op == "all_reduce" else factor  # (n - 1) / n
    return round(1.0 / (1.0 - share)) if share < 0.999 else None


def _last(header: list[str], name: str) -> int:
    return len(header) - 1 - header[::-1].index(name)


def _float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _ulp(text: str) -> float:
    """Half the value of the last printed digit of ``text`` (its rounding error)."""
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (-decimals + (int(exponent) if exponent else 0))


def _rel_ulp(text: str, value: float) -> float:
    return _ulp(text) / value if value > 0 else math.inf


def _int_in(text: str, lo: int, hi: int | None) -> bool:
    return text.isdigit() and int(text) >= lo and (hi is None or int(text) <= hi)


def _threads_ok(text: str, protocol: str, algorithm: str) -> bool:
    if not text.isdigit():
        return False
    if protocol == "LL128" or algorithm == "P2P":
        return int(text) == FIXED_THREADS
    return int(text) % WARP_SIZE == 0 and 64 <= int(text) <= 512
