"""Applied = observed on NCCL, from the profiler half's own records: the C harness plays each scenario
in NCCL's calling order for profiler ABI v1-v7 (``nccl/plugin/test/test_observed.c``), prints the
records it leaves, and the Python side (``profiler_status.parse_snapshot``, ``nccl.observed``)
compares them with the plan the scenario's table row holds: all-reduce of 4 MiB on communicator
``dp`` (8 ranks) with ring / simple, 8 channels, chunk 256 KiB. Each ABI runs under an NCCL release that
looks it up first (``NCCL_OF_ABI``), whose channel rule the check applies."""

import dataclasses
import shutil
import subprocess

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.nccl.observed import (
    NEWEST_RULE_READ,
    matching_ops,
    nccl_coll_channels,
    observe_site,
    op_bytes,
    p2p_task_channels,
    unread_rule_note,
)
from lagom_megatron.nccl.plugin import build_harness, build_tuner
from lagom_megatron.nccl.plugin_status import ObservedOp, parse_snapshot, profiler_state, read_observed, set_recording

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed: the plugin is built with it")

PLAN = CommConfig(algorithm="Ring", protocol="Simple", n_channels=8, chunk_size=262144)
VERSIONS = range(1, 8)
NCCL_OF_ABI = {1: (2, 23, 4), 2: (2, 25, 1), 3: (2, 26, 6), 4: (2, 27, 7), 5: (2, 28, 9), 6: (2, 30, 7), 7: (2, 31, 2)}
"""A release whose source lagom read per profiler ABI it takes first (``plugin_launch.PROFILER_SYMBOLS_BY_NCCL``)."""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("observed")
    return build_tuner(out), build_harness(out)


def _records(built, version, scenario):
    lib, harness = built
    proc = subprocess.run(
        [str(harness), str(lib), "--snapshot", str(version), scenario], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    return parse_snapshot(proc.stdout)


def _site(comms, planned=PLAN, op="all_reduce", nbytes=4 << 20, nccl=None):
    ops = matching_ops(comms, "dp", op, nbytes, 8)
    version = nccl or NCCL_OF_ABI[comms[0].abi]
    return observe_site(
        "dp.grad_all_reduce[0]", planned, op=op, nbytes=nbytes, group_size=8, ops=ops, nccl_version=version
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_a_stream_that_matches_the_plan_is_applied(built, version):
    obs = _site(_records(built, version, "match"))
    assert obs.status == "applied" and obs.calls == 1, obs
    assert obs.observed == {"algorithm": "Ring", "protocol": "Simple", "n_channels": 8, "chunk_size": 262144}
    assert obs.planned == PLAN.to_dict()


@pytest.mark.parametrize("version", VERSIONS)
def test_clamped_channels_differ(built, version):
    """4 MiB on 8 planned channels: NCCL's split of the call gives all 8 (``nccl_coll_channels``),
    so 4 is not NCCL's own rule at work; v1-v3 report the tuner's value, so 4 differs there too."""
    obs = _site(_records(built, version, "clamped"))
    assert (obs.status, obs.knobs, obs.observed["n_channels"]) == ("differs", ("n_channels",), 4)
    rule = " (NCCL's split of the call gives 8)" if version >= 4 else ""
    assert obs.note == f"clamped: NCCL ran 4 of the 8 planned channels{rule}"


@pytest.mark.parametrize("version", VERSIONS)
def test_a_small_call_nccl_splits_over_fewer_channels_is_applied(built, version):
    """64 KiB of float32 all-reduce on 8 ranks, 8 planned channels. NCCL 2.29-2.31 (ABI v6, v7) cut its
    2 x 64 KiB of traffic into 32 KiB cells (v2.30.7 ``src/enqueue.cc:585``, :659-664), one channel
    per cell: 4 channels, NCCL's rule, not a refusal of the plan; 2.27-2.28 (v4, v5) use 16 KiB
    cells, 8 channels; v1-v3 report the tuner's ``nMaxChannels``, 8."""
    obs = _site(_records(built, version, "small"), nbytes=65536)
    want = 4 if version >= 6 else 8
    assert (obs.status, obs.knobs, obs.observed["n_channels"], obs.calls) == ("applied", (), want, 1), obs
    assert obs.note == (
        "split: NCCL ran the 8 planned channels' call on 4, as its traffic cells give for these bytes"
        if version >= 6
        else ""
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_another_algorithm_differs(built, version):
    obs = _site(_records(built, version, "other_algo"))
    assert obs.status == "differs" and obs.knobs == ("algorithm", "protocol")
    assert (obs.observed["algorithm"], obs.observed["protocol"]) == ("Tree", "LL")
    assert "chunk_size" not in obs.observed, "no proxy op (no network transfer): the chunk is not observable"


@pytest.mark.parametrize("version", VERSIONS)
def test_p2p_channels_against_the_bound(built, version):
    comms = _records(built, version, "p2p")  # a send of 64 Ki bf16 on 2 channels
    bound2 = _site(comms, CommConfig(n_channels=2), op="send", nbytes=131072)
    bound1 = _site(comms, CommConfig(n_channels=1), op="send", nbytes=131072)
    assert bound2.status == "applied" and bound2.calls == 1
    if version >= 4:  # p2p.nChannels is in the descriptor from v4
        assert bound2.observed == {"n_channels": 2}
        assert bound1.status == "differs" and "more than the 1 its bound allows" in bound1.note
    else:
        assert bound1.status == "applied" and bound1.observed == {}, "v1-v3 p2p events carry no channel count"


@pytest.mark.parametrize("version", [4, 5, 6, 7])
def test_a_nameless_communicator_is_found_by_its_tag(built, version):
    comms = _records(built, version, "no_name")
    assert [(c.tag, c.name) for c in comms] == [("dp", None)]
    assert _site(comms).status == "applied"


def test_records_of_another_communicator_or_shape_leave_the_site_unobserved(built):
    comms = _records(built, 6, "match")
    assert (
        observe_site(
            "s",
            PLAN,
            op="all_reduce",
            nbytes=4 << 20,
            group_size=8,
            ops=matching_ops(comms, "tp", "all_reduce", 4 << 20, 8),
            nccl_version=(2, 30, 7),
        ).status
        == "unobserved"
    )
    assert _site(comms, nbytes=2 << 20).status == "unobserved"
    assert _site(comms, op="all_gather").status == "unobserved"


def _coll(func, count, dtype, proto="SIMPLE", abi=6, algo="RING", n_nodes=1):
    return ObservedOp("coll", func, count, dtype, algo, proto, 0, 16, 1, 0, 0, 0, abi, 8, n_nodes)


@pytest.mark.parametrize(
    "op, planned, nccl, want",
    [
        # 4 MiB: 8 MiB of traffic / 8 = 1 MiB per channel, 32 cells of 32 KiB each: all 8 channels
        (_coll("AllReduce", 1 << 20, "ncclFloat32"), 8, (2, 30, 7), 8),
        # 64 KiB: 128 KiB of traffic in 32 KiB cells: 4 cells, one per channel (2.29+)
        (_coll("AllReduce", 16384, "ncclFloat32"), 8, (2, 30, 7), 4),
        # the same under 2.31.2 (src/enqueue/enqueue.cc scheduleCollTasksToPlan @8898068: the same cells)
        (_coll("AllReduce", 16384, "ncclFloat32", abi=7), 8, (2, 31, 2), 4),
        # the same call under 2.27-2.28 (ABI v4, v5): 16 KiB cells, 8 of them
        (_coll("AllReduce", 16384, "ncclFloat32", abi=5), 8, (2, 28, 9), 8),
        # LL counts 4x the traffic (:461, :658): 512 KiB, 4 KiB cells, 2 per channel: 8 channels
        (_coll("AllReduce", 16384, "ncclFloat32", proto="LL"), 8, (2, 30, 7), 8),
        # 17 cells of 16 KiB on 16 planned channels: 34816 B per channel -> 2 cells each -> 1 + 7 + 1
        (_coll("AllReduce", 69632, "ncclFloat32"), 16, (2, 30, 7), 9),
        # a 4 KiB-per-rank all-gather on 8 ranks (NCCL counts its bytes as ncclInt8): one cell, 1 channel
        (_coll("AllGather", 4096, "ncclInt8"), 8, (2, 30, 7), 1),
        # records that carry no channel count of NCCL's split: ABI v3, CollNet, multi-node NVLS
        (_coll("AllReduce", 16384, "ncclFloat32", abi=3), 8, (2, 26, 6), None),
        (_coll("AllReduce", 16384, "ncclFloat32", algo="COLLNET_DIRECT"), 8, (2, 30, 7), None),
        (_coll("AllReduce", 16384, "ncclFloat32", algo="NVLS", n_nodes=2), 8, (2, 30, 7), None),
        # an NCCL whose scheduling was not read (2.32.6; 2.28.10 between two read ranges), or an unknown one
        (_coll("AllReduce", 16384, "ncclFloat32", abi=7), 8, (2, 32, 6), None),
        (_coll("AllReduce", 16384, "ncclFloat32", abi=5), 8, (2, 28, 10), None),
        (_coll("AllReduce", 16384, "ncclFloat32"), 8, None, None),
    ],
)
def test_nccl_coll_channels_follows_nccls_split(op, planned, nccl, want):
    """Expected numbers worked by hand from ``scheduleCollTasksToPlan`` (v2.30.7
    ``src/enqueue.cc:576-704``; v2.28.9 :529-638 for ABI v4/v5)."""
    assert nccl_coll_channels(op, planned, 8, nccl) == want


def test_nccl_coll_channels_refuses_bad_counts():
    with pytest.raises(ValueError, match="n_channels \\(0\\) and n_ranks \\(8\\) must be >= 1"):
        nccl_coll_channels(_coll("AllReduce", 16, "ncclFloat32"), 0, 8, (2, 30, 7))


def test_multi_node_nvls_channels_are_not_compared():
    site = observe_site(
        "s",
        CommConfig(n_channels=8),
        op="all_reduce",
        nbytes=65536,
        group_size=8,
        ops=[_coll("AllReduce", 16384, "ncclFloat32", algo="NVLS", n_nodes=2)],
        nccl_version=(2, 30, 7),
    )
    assert (site.status, site.observed) == ("applied", {})


def _observe(planned, ops, nccl, op="all_reduce", nbytes=4 << 20):
    return observe_site("s", planned, op=op, nbytes=nbytes, group_size=8, ops=ops, nccl_version=nccl)


def test_a_channel_mismatch_reverts_only_under_an_nccl_whose_rule_was_read():
    """4 MiB of all-reduce planned on 8 channels ran on 4 (NCCL's 32 KiB cells give 8, so 4 is no split of
    NCCL's). Under 2.31.2, whose scheduling was read, the site differs; under 2.32.6 (newer than the newest
    read) and an unknown NCCL it is applied with the count reported: a rule that may have changed never
    reverts a site on channels alone."""
    ran = dataclasses.replace(_coll("AllReduce", 1 << 20, "ncclFloat32", abi=7), channels=4)
    planned = CommConfig(algorithm="Ring", protocol="Simple", n_channels=8)
    read = _observe(planned, [ran], (2, 31, 2))
    assert (read.status, read.knobs) == ("differs", ("n_channels",))
    for nccl in ((2, 32, 6), None):
        unread = _observe(planned, [ran], nccl)
        assert (unread.status, unread.knobs, unread.observed["n_channels"]) == ("applied", (), 4), nccl
        assert unread.note == "NCCL ran 4 of the 8 planned channels (not counted: this NCCL's channel rule is not read)"
    send = ObservedOp("p2p", "Send", 65536, "ncclBfloat16", None, None, 2, 0, 1, 0, 0, 0, 7, 8, 1)
    bound1 = CommConfig(n_channels=1)
    assert _observe(bound1, [send], (2, 31, 2), op="send", nbytes=131072).status == "differs"
    assert _observe(bound1, [send], (2, 32, 6), op="send", nbytes=131072).status == "applied"


def test_algorithm_and_protocol_still_count_under_an_unread_nccl():
    ran = _coll("AllReduce", 1 << 20, "ncclFloat32", abi=7, algo="TREE", proto="LL")
    site = _observe(CommConfig(algorithm="Ring", protocol="Simple", n_channels=8), [ran], (2, 32, 6))
    assert (site.status, site.knobs) == ("differs", ("algorithm", "protocol"))


def test_the_unread_rule_note_names_both_versions():
    assert NEWEST_RULE_READ == (2, 31, 2)
    assert unread_rule_note((2, 31, 2)) is None and unread_rule_note((2, 23, 4)) is None
    assert unread_rule_note((2, 32, 6)) == (
        "lagom: note: the observed check runs on NCCL 2.32.6; the newest NCCL whose channel scheduling lagom has "
        "read is 2.31.2, so a site whose channel count differs is reported, never reverted for it (algorithm, "
        "protocol, threads and chunk size are still checked)"
    )
    assert "an NCCL of unknown version" in unread_rule_note(None)


def test_plan_bytes_of_per_rank_counts():
    """ncclAllGather's count is per rank and ncclReduceScatter's is the output's: the plan counts the
    whole buffer (the all-gather's output, the reduce-scatter's input), nRanks times that."""

    def op(func, count, dtype):
        return ObservedOp("coll", func, count, dtype, "RING", "SIMPLE", 4, 16, 1, 0, 0, 0)

    assert op_bytes(op("AllGather", 1000, "ncclBfloat16"), 8) == 16000
    assert op_bytes(op("ReduceScatter", 1000, "ncclFloat32"), 4) == 16000
    assert op_bytes(op("AllReduce", 1000, "ncclFloat32"), 4) == 4000
    assert op_bytes(op("AllReduce", 1000, "ncclNoSuchType"), 4) is None


def test_snapshot_errors_name_the_line():
    with pytest.raises(ValueError, match="line 1: an op line before any comm line"):
        parse_snapshot(
            "coll 0 func=AllReduce count=1 dtype=ncclInt8 algo=RING proto=LL channels=1 warps=1 calls=1 "
            "chunk=0 kernel_ns=0 kernel_calls=0\n"
        )
    with pytest.raises(ValueError, match="line 1: missing field 'abi'"):
        parse_snapshot("comm 0 hash=1 rank=0 nranks=2 nnodes=1 tag=- name=- dropped=0 overflow=0\n")


def test_in_process_reader_of_the_loaded_library(built):
    """The ctypes side against the real library, mapped in this process: empty records, events on
    and off, and the state before NCCL initialised anything."""
    import ctypes

    lib = ctypes.CDLL(str(built[0]))
    assert lib is not None
    assert read_observed(library=str(built[0])) == []
    assert set_recording(True, reset=True, library=str(built[0])) and set_recording(False, library=str(built[0]))
    assert profiler_state(library=str(built[0])) == ("not initialised", "")
    assert read_observed(library="/no/such/libnccl-tuner-lagom.so") is None


H200, PCIE = ClusterSpec.load("h200-sxm"), ClusterSpec.load("a40-pcie-ib100")


def _send(nbytes, channels=0, n_ranks=2):
    return ObservedOp("p2p", "Send", nbytes // 2, "ncclBfloat16", None, None, channels, 0, 1, 0, 0, 0, 7, n_ranks, 1)


@pytest.mark.parametrize(
    "cluster, group, nbytes, bound, want",
    [
        # NVLink on H200: 2 x (450 // 20.6) = 42 channels per peer, rounded up to 64 (paths.cc:918-954), so the
        # bound decides: p2pnChannels 8, nChannelsMin 4 (4 x 2 ranks <= 8, enqueue.cc:1146); 128 KiB in parts of
        # 512 KiB / 8 = 64 KiB (:920-922): 2 channels
        (H200, 2, 131072, 8, 2),
        # 8 ranks: nChannelsMin halved 8 -> 4 -> 2 -> 1 (8 x 1 <= 8): 1 channel
        (H200, 8, 131072, 8, 1),
        # bound 16: 16 -> 8 -> 4 -> 2 (2 x 8 <= 16): 2 channels
        (H200, 8, 131072, 16, 2),
        # 8 MiB: min(nChannelsMin, 128 parts) = nChannelsMin, 8 (bound 16) or 4 (bound 8); parts <= 16 MiB
        (H200, 2, 8 << 20, 16, 8),
        (H200, 2, 8 << 20, 8, 4),
        # PCIe: 2 channels per peer whatever the bound (paths.cc:918-954); parts 4 MiB <= 128 KiB x 32
        (PCIE, 2, 8 << 20, 16, 2),
    ],
)
def test_p2p_task_channels_follow_nccls_rule(cluster, group, nbytes, bound, want):
    """Worked by hand from NCCL v2.30.7 ``ncclTopoComputeP2pChannels`` (``src/graph/paths.cc:977-1003``),
    ``scheduleP2pTasksToPlan`` (``src/enqueue.cc:1143-1146``) and ``addP2pToPlan`` (:914-929), P2P chunk 512 KiB on
    NVLink and 128 KiB on PCIe (``src/init.cc:818-820``)."""
    op = _send(nbytes, n_ranks=group)
    assert p2p_task_channels(cluster, op, bound=bound, group_size=group, n_nodes=1) == want


def test_a_p2p_site_that_ran_fewer_channels_than_planned_is_not_applied():
    """An 8 MiB send planned on a bound of 16 runs on 8 channels by NCCL's rule on H200's NVLink; NCCL's record of
    4 (a topology giving 4 per peer) is not the plan. Under an NCCL whose rule lagom read it differs; under 2.32.6
    it is reported, never reverted for it; without the cluster only the upper bound (16) is tested. On PCIe the
    same 2 channels are what the rule gives, so 2 there is applied."""
    ran = _send(8 << 20, channels=4)
    planned = CommConfig(n_channels=16)

    def site(nccl, cluster=H200, op=ran):
        expected = (
            None if cluster is None else lambda o: p2p_task_channels(cluster, o, bound=16, group_size=2, n_nodes=1)
        )
        return observe_site(
            "pp.send[0]",
            planned,
            op="send",
            nbytes=8 << 20,
            group_size=2,
            ops=[op],
            nccl_version=nccl,
            p2p_expected=expected,
        )

    read = site((2, 30, 7))
    assert (read.status, read.knobs, read.observed) == ("differs", ("n_channels",), {"n_channels": 4})
    assert read.note == "P2P ran on 4 channels where NCCL's rule gives 8 for the planned bound 16"
    unread = site((2, 32, 6))
    assert (unread.status, unread.note) == (
        "applied",
        read.note + " (not counted: this NCCL's channel rule is not read)",
    )
    assert site((2, 30, 7), cluster=None).status == "applied"
    assert site((2, 30, 7), op=dataclasses.replace(ran, channels=8)).status == "applied"
    assert site((2, 30, 7), cluster=PCIE, op=dataclasses.replace(ran, channels=2)).status == "applied"


@pytest.mark.parametrize("version", [4, 6, 7])
def test_the_harness_p2p_record_against_nccls_exact_count(built, version):
    """The harness's send of 64 Ki bf16 on 2 channels on an 8-rank communicator: a bound of 16 gives exactly 2 on
    H200 (``test_p2p_task_channels_follow_nccls_rule``), a bound of 8 gives 1, which 2 is not."""
    comms = _records(built, version, "p2p")

    def check(bound):
        ops = matching_ops(comms, "dp", "send", 131072, 8)
        return observe_site(
            "s",
            CommConfig(n_channels=bound),
            op="send",
            nbytes=131072,
            group_size=8,
            ops=ops,
            nccl_version=NCCL_OF_ABI[version],
            p2p_expected=lambda o: p2p_task_channels(H200, o, bound=bound, group_size=8, n_nodes=1),
        )

    assert check(16).status == "applied"
    assert (check(8).status, check(8).knobs) == ("differs", ("n_channels",))


def test_an_all_to_all_is_its_send_and_receive_tasks_and_a_coalesced_call_its_parts():
    """NCCL enqueues an all-to-all as a send and a receive per peer (v2.30.7 ``src/enqueue.cc:3070-3082``), and
    reports each tensor of a coalesced call as a task of its own: neither has a record of the site's total bytes."""
    comm = parse_snapshot(
        "comm 0 hash=1 rank=0 nranks=4 nnodes=1 abi=6 tag=ep name=- dropped=0 overflow=0\n"
        "p2p 0 func=Send count=1024 dtype=ncclBfloat16 algo=- proto=- channels=1 warps=0 calls=4 chunk=0 "
        "kernel_ns=0 kernel_calls=0\n"
        "p2p 0 func=Recv count=3072 dtype=ncclBfloat16 algo=- proto=- channels=1 warps=0 calls=4 chunk=0 "
        "kernel_ns=0 kernel_calls=0\n"
        "coll 0 func=AllReduce count=1000 dtype=ncclFloat32 algo=RING proto=LL channels=1 warps=8 calls=1 chunk=0 "
        "kernel_ns=0 kernel_calls=0\n"
        "coll 0 func=AllReduce count=500 dtype=ncclBfloat16 algo=RING proto=LL channels=1 warps=8 calls=1 chunk=0 "
        "kernel_ns=0 kernel_calls=0\n"
    )
    a2a = matching_ops(comm, "ep", "all_to_all", 8192, 4)
    assert [(o.func, o.count) for o in a2a] == [("Send", 1024), ("Recv", 3072)], "uneven splits included"
    parts = (("float32", 4000), ("bfloat16", 1000))
    assert [o.count for o in matching_ops(comm, "ep", "all_reduce", 5000, 4, parts)] == [1000, 500]
    assert matching_ops(comm, "ep", "all_reduce", 5000, 4) == []


ZERO = CommConfig(cta_policy="ZERO")
CE_NOTE = "no symmetric window or no NVLink domain (or a CUDA driver before 12.5)"


def _all_gather(comms, planned, nbytes=8 << 20):
    """The harness's communicator ``dp`` (8 ranks): an all-gather of 1 MiB per rank is 8 MiB as the plan counts it."""
    ops = matching_ops(comms, "dp", "all_gather", nbytes, 8)
    return observe_site(
        "dp.param_all_gather[0]",
        planned,
        op="all_gather",
        nbytes=nbytes,
        group_size=8,
        ops=ops,
        nccl_version=NCCL_OF_ABI[comms[0].abi],
    )


@pytest.mark.parametrize("version", [6, 7])
def test_a_zero_site_nccl_ran_on_copy_engines_is_applied(built, version):
    """The harness plays two CE all-gathers of 1 MiB per rank in NCCL's order (``test_ce.c``): NCCL enqueues the
    count in bytes as ncclInt8 (v2.30.7 ``src/enqueue.cc:2785-2788``), and each call's batch is 8 copies of 1 MiB
    (the rank's own share, then one per peer: ``src/ce_coll.cc:514-530``), so 16 copies, 16 MiB."""
    comms = _records(built, version, "ce")
    (op,) = comms[0].ops
    assert (op.kind, op.func, op.count, op.dtype, op.algo, op.proto, op.channels, op.warps) == (
        "ce",
        "AllGather",
        1 << 20,
        "ncclInt8",
        "CE",
        None,
        0,
        0,
    )
    assert (op.calls, op.copies, op.copy_bytes, op.kernel_ns) == (2, 16, 16 << 20, 0)
    assert op_bytes(op, 8) == 8 << 20
    obs = _all_gather(comms, ZERO)
    assert (obs.status, obs.knobs, obs.calls, obs.note) == ("applied", (), 2, "")
    assert (obs.planned, obs.observed) == ({"engine": "CE"}, {"engine": "CE"})


@pytest.mark.parametrize("version", [6, 7])
def test_a_zero_site_nccl_ran_on_sms_differs(built, version):
    """The same calls as an SM ring / simple kernel on 8 channels: NCCL fell back (``ncclCeAvailable`` false,
    ``src/enqueue.cc:3054``), so the ZERO site differs on ``cta_policy`` and is reverted."""
    obs = _all_gather(_records(built, version, "ce_fallback"), ZERO)
    assert (obs.status, obs.knobs, obs.calls) == ("differs", ("cta_policy",), 2)
    assert (obs.planned, obs.observed) == ({"engine": "CE"}, {"engine": "SM"})
    assert obs.note == f"planned copy engines (CTA policy ZERO), NCCL ran RING/SIMPLE on 8 CTAs: {CE_NOTE}"


def test_copy_engines_the_plan_did_not_ask_for_differ(built):
    """A site planned as ring / simple on 8 channels whose calls NCCL ran on copy engines differs on
    ``cta_policy`` alone: the CE record's 0 channels and algorithm CE are not judged as SM knobs."""
    obs = _all_gather(_records(built, 7, "ce"), CommConfig(algorithm="Ring", protocol="Simple", n_channels=8))
    assert (obs.status, obs.knobs, obs.calls) == ("differs", ("cta_policy",), 2)
    assert (obs.planned, obs.observed) == ({"engine": "SM"}, {"engine": "CE"})
    assert obs.note.startswith("NCCL ran copy engines, which the plan did not ask for (no CTA policy ZERO)")
    assert obs.note.endswith(" (2 calls)")
    sm = _all_gather(_records(built, 7, "ce_fallback"), CommConfig(algorithm="Ring", protocol="Simple", n_channels=8))
    assert (sm.status, sm.observed) == ("applied", {"algorithm": "Ring", "protocol": "Simple", "n_channels": 8})


def test_a_zero_site_some_of_whose_calls_fell_back_differs():
    comm = parse_snapshot(
        "comm 0 hash=ce rank=0 nranks=8 nnodes=1 abi=6 tag=dp name=dp dropped=0 overflow=0\n"
        "ce 0 func=AllGather count=1048576 dtype=ncclInt8 algo=CE proto=- channels=0 warps=0 calls=2 chunk=0 "
        "kernel_ns=0 kernel_calls=0 copies=16 copy_bytes=16777216\n"
        "coll 0 func=AllGather count=1048576 dtype=ncclInt8 algo=NVLS proto=SIMPLE channels=16 warps=16 calls=1 "
        "chunk=0 kernel_ns=0 kernel_calls=0\n"
    )
    assert [o.copies for o in comm[0].ops] == [16, 0], "a coll line has no copies"
    obs = _all_gather(comm, ZERO)
    assert (obs.status, obs.knobs, obs.calls, obs.observed) == ("differs", ("cta_policy",), 3, {"engine": ("CE", "SM")})
    assert (
        obs.note
        == f"planned copy engines (CTA policy ZERO), NCCL ran NVLS/SIMPLE on 16 CTAs for 1 of 3 calls: {CE_NOTE}"
    )


def test_an_all_to_all_on_copy_engines_is_its_alltoall_record():
    """On copy engines an all-to-all is one ``AlltoAll`` record per call (``ncclFuncToString``, v2.30.7
    ``src/collectives.cc:20-21``; ``src/plugin/profiler.cc:834``); on SMs its send and receive tasks."""
    comm = parse_snapshot(
        "comm 0 hash=1 rank=0 nranks=4 nnodes=1 abi=7 tag=ep name=- dropped=0 overflow=0\n"
        "ce 0 func=AlltoAll count=1024 dtype=ncclBfloat16 algo=CE proto=- channels=0 warps=0 calls=3 chunk=0 "
        "kernel_ns=0 kernel_calls=0 copies=12 copy_bytes=24576\n"
        "p2p 0 func=Send count=1024 dtype=ncclBfloat16 algo=- proto=- channels=1 warps=0 calls=4 chunk=0 "
        "kernel_ns=0 kernel_calls=0\n"
    )
    ops = matching_ops(comm, "ep", "all_to_all", 8192, 4)
    assert [(o.kind, o.func) for o in ops] == [("ce", "AlltoAll"), ("p2p", "Send")]
    obs = observe_site("ep.a2a[0]", ZERO, op="all_to_all", nbytes=8192, group_size=4, ops=ops, nccl_version=(2, 31, 2))
    assert (obs.status, obs.calls) == ("differs", 7)
    assert (
        obs.note
        == f"planned copy engines (CTA policy ZERO), NCCL ran send/receive tasks on up to 1 CTA for 4 of 7 calls: {CE_NOTE}"
    )
    only_ce = observe_site(
        "ep.a2a[0]", ZERO, op="all_to_all", nbytes=8192, group_size=4, ops=ops[:1], nccl_version=(2, 31, 2)
    )
    assert (only_ce.status, only_ce.calls) == ("applied", 3)
