"""Writes text in the format of nccl-tests' output (NVIDIA/nccl-tests v2.19.6 ``src/util.cu``
printf formats, lines cited beside each), from a bandwidth model chosen by the caller: the tests'
input for ``nccl/perf_table.py`` and ``lagom calibrate bandwidth``, and the output of the
stand-in ``*_perf`` binary (``perf_standin.py``). Nothing here is copied from a published log.

The model of one run: bus bandwidth ``B = ((n * c * tf)^-p + C^-p)^(-1/p)`` with ``c`` GB/s per
channel, ``tf = (threads / 512)^e`` and ceiling ``C``; ``t = latency + factor * size / B``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,
}
"""nccl-tests doc/PERFORMANCE.md's busbw / algbw per collective."""
REDOP = {"all_reduce": "sum", "reduce_scatter": "sum"}


@dataclass
class Truth:
    """The bandwidth shape a synthetic run follows (GB/s, us)."""

    per_channel: dict[str, float] = field(default_factory=lambda: {"LL": 2.5, "LL128": 4.0, "Simple": 5.5, "P2P": 6.0})
    ceiling: dict[str, float] = field(default_factory=lambda: {"LL": 10.0, "LL128": 18.0, "Simple": 20.5, "P2P": 21.0})
    p: float = 3.0
    e: float = 0.5
    latency_us: float = 12.0

    def busbw(self, kind: str, channels: int, threads: int) -> float:
        tf = (threads / 512.0) ** self.e if kind in ("LL", "Simple") else 1.0
        rate = channels * self.per_channel[kind] * tf
        return (rate**-self.p + self.ceiling[kind] ** -self.p) ** (-1.0 / self.p)


def float_cell(value: float, width: int) -> str:
    """nccl-tests' getFloatStr (util.cu:487-492): 2 decimals, then 1, then 0, then exponent form."""
    for fmt in ("%*.2f", "%*.1f", "%*.0f"):
        text = fmt % (width, value)
        if len(text) <= width:
            return text
    return ("%*.1e" if width >= 7 else "%*.0e") % (width, value)


def device_lines(ranks: int, hosts: list[str], gpu: str) -> list[str]:
    """``# Using devices`` and one line per rank (util.cu:667, 687-688), ranks spread over hosts in order."""
    per_host = ranks // len(hosts)
    return ["# Using devices"] + [
        "#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] %s"
        % (r, 0, 4000 + r // per_host, hosts[r // per_host], r % per_host, 0, 0x17 + r % per_host, 0, gpu)
        for r in range(ranks)
    ]


def run_text(
    *,
    op: str,
    sizes: list[int],
    busbw: float,
    ranks: int,
    hosts: list[str],
    latency_us: float,
    sweep_line: str | None,
    nccl_lines: list[str] = (),
    gpu: str = "NVIDIA A40",
    check: bool = True,
    table_nccl_line: str | None = None,
    iters: int = 20,
    warmup: int = 5,
) -> str:
    """The whole output of one run at bus bandwidth ``busbw`` (GB/s): header, devices, NCCL's
    lines, the table and its footer, each line in nccl-tests' format."""
    factor = FACTORS[op](ranks)
    step = sizes[1] // sizes[0] if len(sizes) > 1 else 1
    program = f"{op}_perf"
    lines = [sweep_line] if sweep_line else []
    lines += [
        "# nccl-tests version 2.19.6 nccl-headers=22705 nccl-library=22705",  # util.cu:623-625
        f"# Collective test starting: {program}",
        "# nThread %d nGpus %d minBytes %ld maxBytes %ld step: %ld(%s) warmup iters: %d iters: %d agg iters: %d "
        "validation: %d graph: %d unalign: %d"
        % (1, ranks // len(hosts), sizes[0], sizes[-1], step, "factor", warmup, iters, 1, int(check), 0, 0),
        "#",
    ]
    lines += device_lines(ranks, hosts, gpu)
    lines += list(nccl_lines)
    lines += [
        "#",  # util.cu:744, 756-760
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
        % ("", "", "", "", ""),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
        % (
            "size",
            "count",
            "type",
            "redop",
            "root",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            "time",
            "algbw",
            "busbw",
            "#wrong",
            0,
            "",
        ),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %*s"
        % ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", 0, ""),
    ]
    printed = []
    for i, size in enumerate(sizes):
        count = size // 4 // (ranks if op in ("all_gather", "reduce_scatter", "alltoall") else 1)
        row = "%12li  %12li  %8s  %6s  %6s" % (size, count, "float", REDOP.get(op, "none"), "-1")  # util.cu:457
        for in_place in (0, 1):
            t = latency_us + factor * size / (busbw * 1e3) * (1.0 + 0.002 * in_place)
            alg = size / (t * 1e3)
            time_s, alg_s, bus_s = float_cell(t, 7), float_cell(alg, 6), float_cell(alg * factor, 6)
            printed.append(float(bus_s))
            row += (
                "  %7s  %6s  %6s  %6g" % (time_s, alg_s, bus_s, 0)
                if check
                else "  %7s  %6s  %6s    N/A" % (time_s, alg_s, bus_s)
            )  # util.cu:507-510
        lines.append(row)
        if i == 0 and table_nccl_line:
            lines.append(table_nccl_line)
    avg = sum(printed) / len(printed)
    lines += [
        "# %-20s : %d %s" % ("Out of bounds values", 0, "OK"),  # util.cu:777-780
        "# %-20s : %g %s" % ("Avg bus bandwidth", avg, ""),
        "#",
        f"# Collective test concluded: {program}",
        "",
    ]
    return "\n".join(lines)


def nccl_info(host: str, rank: int, message: str) -> str:
    """An NCCL INFO line (NCCL v2.30.7 src/debug.cc:329-354: host:pid:tid [dev] NCCL INFO msg)."""
    return f"{host}:{4000 + rank}:{4100 + rank} [{rank}] NCCL INFO {message}"


def channel_line(host: str, rank: int, coll: int, p2p: int) -> str:
    """NCCL's channel summary of one rank (v2.30.7 src/init.cc:1646-1647)."""
    return nccl_info(
        host,
        rank,
        f"{coll} coll channels, {coll} collnet channels, 0 nvls channels, {p2p} p2p channels, "
        f"{max(1, p2p // 4)} p2p channels per peer",
    )


def sizes(lo: int = 1 << 20, hi: int = 1 << 29) -> list[int]:
    """lo, 2 lo, ... hi (nccl-tests -b lo -e hi -f 2)."""
    out = [lo]
    while out[-1] * 2 <= hi:
        out.append(out[-1] * 2)
    return out
