"""Reading nccl-tests output (``nccl/perf_table.py``): a table written by hand in nccl-tests'
documented format and tables from ``perf_text`` parse to their exact values; every malformed
input is refused naming ``file:line`` and what was expected."""

from __future__ import annotations

import pytest

from lagom_megatron.nccl.perf_table import PerfFormatError, read_perf_run
from tests.nccl.perf_text import channel_line, nccl_info, run_text, sizes

SWEEP = "# lagom-sweep op=all_gather algorithm=Ring protocol=Simple channels=4 threads=256 nodes=1"

# 8 ranks (factor 7/8), sizes 1, 4 and 16 MiB; algbw = size / time, busbw = 0.875 x algbw, rounded
# to 2 decimals as nccl-tests prints them; the footer is the mean of the six busbw cells.
BY_HAND = """\
# lagom-sweep op=all_gather algorithm=Ring protocol=Simple channels=4 threads=256 nodes=1
# nccl-tests version 2.19.6 nccl-headers=22705 nccl-library=22705
# Collective test starting: all_gather_perf
# nThread 1 nGpus 8 minBytes 1048576 maxBytes 16777216 step: 4(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0
#
# Using devices
#  Rank  0 Group  0 Pid  31000 on      gpu07 device  0 [0000:1b:00] NVIDIA A40
#  Rank  1 Group  0 Pid  31000 on      gpu07 device  1 [0000:1c:00] NVIDIA A40
#  Rank  2 Group  0 Pid  31000 on      gpu07 device  2 [0000:3d:00] NVIDIA A40
#  Rank  3 Group  0 Pid  31000 on      gpu07 device  3 [0000:3e:00] NVIDIA A40
#  Rank  4 Group  0 Pid  31000 on      gpu07 device  4 [0000:89:00] NVIDIA A40
#  Rank  5 Group  0 Pid  31000 on      gpu07 device  5 [0000:8a:00] NVIDIA A40
#  Rank  6 Group  0 Pid  31000 on      gpu07 device  6 [0000:b1:00] NVIDIA A40
#  Rank  7 Group  0 Pid  31000 on      gpu07 device  7 [0000:b2:00] NVIDIA A40
NCCL version 2.27.5+cuda12.9
gpu07:31000:31000 [0] NCCL INFO NCCL_PROTO set by environment to Simple
gpu07:31000:31000 [0] NCCL INFO NCCL_NTHREADS set by environment to 256.
gpu07:31000:31000 [0] NCCL INFO 4 coll channels, 4 collnet channels, 0 nvls channels, 4 p2p channels, 1 p2p channels per peer
#
#                                                              out-of-place                       in-place          
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong 
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)         
     1048576         32768     float    none      -1   100.00   10.49    9.18       0   101.00   10.38    9.08       0
gpu07:31000:31007 [3] NCCL INFO Channel 00/0 : 3[3] -> 4[4] via SHM/direct/direct
     4194304        131072     float    none      -1   250.00   16.78   14.68       0   251.00   16.71   14.62       0
    16777216        524288     float    none      -1   850.00   19.74   17.27       0   852.00   19.69   17.23       0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 13.6767 
#
# Collective test concluded: all_gather_perf
"""
ROW_4M = 25  # line of the 4 MiB row in BY_HAND


def _write(tmp_path, text, name="run.txt"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _refused(tmp_path, text, *expected):
    path = _write(tmp_path, text)
    with pytest.raises(PerfFormatError) as info:
        read_perf_run(path)
    for part in expected:
        assert part.format(path=path) in str(info.value), str(info.value)
    return str(info.value)


def test_a_table_written_by_hand_parses_to_its_printed_values(tmp_path):
    run = read_perf_run(_write(tmp_path, BY_HAND))
    assert (run.op, run.algorithm, run.protocol, run.channels, run.asked_channels, run.threads) == (
        "all_gather",
        "Ring",
        "Simple",
        4,
        4,
        256,
    )
    assert (run.ranks, run.nodes, run.gpu, run.nccl_version) == (8, 1, "NVIDIA A40", "2.27.5")
    assert run.bus_factor == 7 / 8  # PERFORMANCE.md's (n-1)/n on the 8 '#  Rank' lines
    assert [(r.line, r.size, r.in_place) for r in run.rows][:3] == [
        (23, 1048576, False),
        (23, 1048576, True),
        (ROW_4M, 4194304, False),
    ]
    assert [r.time_us for r in run.rows] == [100.0, 101.0, 250.0, 251.0, 850.0, 852.0]  # 5 digits beat algbw's 4
    assert [r.busbw for r in run.rows] == [9.18, 9.08, 14.68, 14.62, 17.27, 17.23]


def test_generated_tables_and_tolerated_variants(tmp_path):
    text = run_text(
        op="all_reduce",
        sizes=sizes(1 << 10, 1 << 31),
        busbw=1.3,
        ranks=16,
        hosts=["a", "b"],
        latency_us=30,
        sweep_line=SWEEP.replace("all_gather", "all_reduce").replace("nodes=1", "nodes=2"),
        check=False,
        nccl_lines=[channel_line(h, r, 8, 8) for r, h in enumerate("a" * 8 + "b" * 8)],
        table_nccl_line=nccl_info("a", 0, "Connected all rings"),
    )
    noisy = "Warning: Permanently added 'b' (ECDSA) to the list of known hosts.\n" + text
    run = read_perf_run(_write(tmp_path, noisy))
    assert (run.ranks, run.nodes, run.channels, run.asked_channels) == (16, 2, 8, 4)  # NCCL's count wins
    assert run.bus_factor == pytest.approx(2 * 15 / 16, rel=1e-3)
    big = [r for r in run.rows if r.size == 1 << 31][0]
    assert big.time_us == pytest.approx(30 + 2 * 15 / 16 * 2**31 / 1.3e3, rel=1e-3)  # time column '3.1e+06': algbw used
    # point-to-point without NCCL's lines: channels rounded up to a power of two; ranks from busbw / algbw
    p2p = run_text(
        op="alltoall",
        sizes=sizes(),
        busbw=5.0,
        ranks=4,
        hosts=["a"],
        latency_us=10,
        sweep_line="# lagom-sweep op=alltoall algorithm=P2P protocol=Simple channels=3 threads=640 nodes=1",
    )
    p2p = "\n".join(line for line in p2p.splitlines() if not line.startswith("#  Rank"))
    run = read_perf_run(_write(tmp_path, p2p, "p2p.txt"))
    assert (run.channels, run.asked_channels, run.ranks) == (4, 3, 4)


def test_per_iteration_and_timestamp_columns(tmp_path):
    head = BY_HAND.split("#       size")[0]
    text = head + (
        "#       size         count      type   redop    root     time   algbw   busbw  #wrong    i_min    i_max    i_p99"
        "    i_cv%     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%           timestamp\n"
        "    16777216        524288     float    none      -1   850.00   19.74   17.27       0   840.10   870.20   869.00"
        "     1.10   852.00   19.69   17.23       0   845.00   861.30   860.90     0.90 2026-03-01 10:00:00\n"
        "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 17.25 \n"
    )
    run = read_perf_run(_write(tmp_path, text))
    assert [r.time_us for r in run.rows] == [850.0, 852.0]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda t: t.replace(SWEEP + "\n", ""), "{path}:1: no '# lagom-sweep' line"),
        (
            lambda t: t.replace("channels=4 threads", "channels=0 threads"),
            "{path}:1: # lagom-sweep line: channels must be an integer in 1..64; got '0'",
        ),
        (
            lambda t: t.replace("threads=256", "threads=100"),
            "{path}:1: # lagom-sweep line: threads must be a multiple of 32",
        ),
        (lambda t: t.replace("nodes=1", "nodes=1 algo=Ring"), "must have exactly the keys"),
        (
            lambda t: t.replace("op=all_gather algorithm=Ring", "op=sendrecv algorithm=Ring"),
            "algorithm must be P2P for this op",
        ),
        (
            lambda t: t.replace("   250.00   16.78   14.68       0", "   250.00   16.78   14.68"),
            "{path}:25: expected a result row: size count type redop root, then time algbw busbw #wrong",
        ),
        (
            lambda t: t.replace("   250.00   16.78", "      abc   16.78"),
            "{path}:25: out-of-place time must be a finite number >= 0; got 'abc'",
        ),
        (
            lambda t: t.replace("14.62       0", "  nan       0"),
            "{path}:25: in-place busbw must be a finite number >= 0; got 'nan'",
        ),
        (
            lambda t: t.replace("14.68       0", "14.68       3"),
            "{path}:25: out-of-place #wrong is 3: NCCL returned wrong data",
        ),
        (
            lambda t: t.replace("   250.00   16.78", "   250.00   26.78"),
            "{path}:25: out-of-place: size / time = 16.78 GB/s but algbw is 26.78",
        ),
        (
            lambda t: t.replace("16.78   14.68", "16.78   12.68"),
            "{path}:25: busbw 12.68 is not 0.8750 x algbw 16.78 (all_gather on 8 ranks",
        ),
        (lambda t: t.split("# Out of bounds")[0], "the table has no '# Avg bus bandwidth' footer: the run stopped"),
        (lambda t: t.split("#       size")[0], "no result table"),
        (
            lambda t: t.replace("13.6767", "12.1"),
            "{path}:28: Avg bus bandwidth 12.1 is not the mean 13.68 of the table's busbw",
        ),
        (
            lambda t: t.replace("environment to Simple", "environment to LL"),
            "{path}:16: NCCL says it ran protocol LL but the sweep line says protocol=Simple",
        ),
        (lambda t: t.replace("environment to 256.", "environment to 512."), "{path}:17: NCCL says it ran threads 512"),
        (
            lambda t: t.replace(
                "NCCL version 2.27.5+cuda12.9",
                "gpu07:1:1 [5] NCCL INFO 2 coll channels, 2 p2p channels, 1 p2p channels per peer",
            ),
            "ranks report different coll channel counts: 2 (line 15), 4 (line 18)",
        ),
        (
            lambda t: t.replace(
                "gpu07:31000:31007 [3] NCCL INFO Channel", "srun: error: gpu07: task 3: Killed Channel"
            ),
            "{path}:24: expected a result row",
        ),
        (
            lambda t: t.replace("starting: all_gather_perf", "starting: all_reduce_perf"),
            "{path}:3: the run is all_reduce_perf but the sweep line says op=all_gather",
        ),
        (
            lambda t: t.replace("nodes=1", "nodes=2"),
            "{path}:1: the sweep line says nodes=2 but the '#  Rank' lines name 1 hosts",
        ),
        (
            lambda t: (
                t.replace("algorithm=Ring protocol=Simple", "algorithm=Ring protocol=Simple")
                .replace("op=all_gather algorithm", "op=all_reduce algorithm")
                .replace("starting: all_gather_perf", "starting: all_reduce_perf")
            ),
            "busbw / algbw = 0.8749, but all_reduce on 8 ranks has factor 1.7500",
        ),
        (
            lambda t: t + t.split("# Collective test starting: all_gather_perf\n")[1],
            "a second result table: one nccl-tests run per file",
        ),
    ],
)
def test_malformed_input_names_the_line_and_what_was_expected(tmp_path, edit, expected):
    _refused(tmp_path, edit(BY_HAND), expected)


def test_every_problem_of_a_file_is_listed(tmp_path):
    text = BY_HAND.replace("   250.00   16.78", "      abc   16.78").replace("17.27       0", "17.27       1")
    message = _refused(tmp_path, text, "{path}:25: out-of-place time", "{path}:26: out-of-place #wrong is 1")
    assert message.count("run.txt:") == 2


def test_a_binary_file_is_refused(tmp_path):
    path = tmp_path / "core.txt"
    path.write_bytes(b"\x7fELF\x02\x01\x01\xff\xfe")
    with pytest.raises(PerfFormatError, match=f"{path}: not a text file"):
        read_perf_run(path)
