"""The plugin's status exports read back through ctypes, with the library loaded the way NCCL
loads it: ``dlopen(path, RTLD_NOW | RTLD_LOCAL)`` (NCCL v2.30.7 ``src/os/linux.cc:52``), then
``dlsym("ncclTunerPlugin_v6")`` (``src/plugin/tuner/tuner_v6.cc:15``) and calls through that struct:
``init(&ctx, commHash, nRanks, nNodes, logger, nvlDomainInfo, constants)`` (``src/init.cc:1641``) and
``getCollInfo(ctx, func, nBytes, numPipeOps, costTable, NCCL_NUM_ALGORITHMS, NCCL_NUM_PROTOCOLS,
regBuff, &nChannels)`` (``src/enqueue.cc:2147``). Each case runs in a fresh interpreter so that the
process-wide counters start at zero."""

import shutil
import subprocess
import sys
import textwrap

import pytest

from lagom_megatron.nccl.plugin import build_tuner
from tests.timeouts import COMMAND_S

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="gcc is not installed: the tuner plugin is built with gcc"
)

DRIVER = textwrap.dedent("""
    import ctypes, json, os, sys
    from lagom_megatron.nccl.plugin_status import read_plugin_status

    lib_path, table, tag = sys.argv[1], sys.argv[2], sys.argv[3]
    calls = json.loads(sys.argv[4])
    n_ranks, n_nodes = json.loads(sys.argv[5]) if len(sys.argv) > 5 else (8, 1)
    out = {"before_load": read_plugin_status() is None}
    lib = ctypes.CDLL(lib_path, mode=os.RTLD_NOW | os.RTLD_LOCAL)   # as NCCL dlopens it

    LOGGER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p)
    INIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64, ctypes.c_size_t,
                            ctypes.c_size_t, LOGGER, ctypes.c_void_p, ctypes.c_void_p)
    COLL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
    FIN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    CHUNK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.POINTER(ctypes.c_size_t))

    class TunerV6(ctypes.Structure):
        _fields_ = [("name", ctypes.c_char_p), ("init", INIT), ("getCollInfo", COLL), ("finalize", FIN),
                    ("getChunkSize", CHUNK)]

    status = read_plugin_status()
    out["before_init"] = None if status is None else [status.abi_version, status.init_count,
                                                      list(status.row_hits), status.table_loaded]
    tuner = TunerV6.in_dll(lib, "ncclTunerPlugin_v6")
    logger = LOGGER(lambda *a: None)
    os.environ["LAGOM_TUNER_CONFIG"] = table
    os.environ["LAGOM_TUNER_COMM_TAG"] = tag
    ctx = ctypes.c_void_p()
    assert tuner.init(ctypes.byref(ctx), 0x1234, n_ranks, n_nodes, logger, None, None) == 0
    cost = (ctypes.c_float * 21)(*([1.0] * 21))
    channels = []
    for coll, nbytes in calls:
        n = ctypes.c_int(0)
        assert tuner.getCollInfo(ctx, coll, nbytes, 1, ctypes.cast(ctypes.pointer(ctypes.pointer(cost)), ctypes.c_void_p),
                                 7, 3, 0, ctypes.byref(n)) == 0
        channels.append(n.value)
    status = read_plugin_status()
    out["after"] = [status.abi_version, status.init_count, list(status.row_hits), status.table_loaded,
                    status.table_failures, status.path == os.path.realpath(lib_path)]
    out["channels"] = channels
    tuner.finalize(ctx)
    print(json.dumps(out))
""")


def _drive(lib, table, tag, calls, *, n_ranks=8, n_nodes=1):
    """Runs DRIVER in a fresh interpreter: ``init`` with ``n_ranks`` / ``n_nodes`` (what NCCL passes:
    ``comm->nRanks``, ``comm->nNodes``), then ``getCollInfo`` for each (func, nBytes) of ``calls``."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(lib), str(table), tag, json.dumps(calls), json.dumps([n_ranks, n_nodes])],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build_tuner(tmp_path_factory.mktemp("tuner_status"))


ALLREDUCE, ALLGATHER, REDUCESCATTER = 4, 2, 3


def test_hit_counters_read_back_through_ctypes(lib, tmp_path):
    table = tmp_path / "plan.csv"
    table.write_text(
        "# lagom plan table\n"
        "allreduce,1048576,1048576,ring,simple,4,1,8,-1,-1,-1,dp\n"
        "\n"
        "allgather,65536,65536,ring,ll,2,1,8,-1,-1,-1,dp\n"
        "reducescatter,4096,4096,ring,simple,3,1,8,-1,-1,-1,tp\n"
        "allreduce,4096,4096,tree,simple,6,1,8,-1,-1,-1,dp\n"
    )
    calls = [[ALLREDUCE, 1048576]] * 3 + [[ALLREDUCE, 4096], [ALLREDUCE, 777], [REDUCESCATTER, 4096]]
    got = _drive(lib, table, "dp/plugin_entry", calls)
    assert got["before_load"] is True, "not loaded yet: no status"
    assert got["before_init"] == [0, 0, [], False], "loaded by NCCL, no communicator yet"
    # rows in file order: AR 1 MiB matched 3x, AG never, RS (tp row) not this comm's, AR 4 KiB once
    assert got["after"] == [6, 1, [3, 0, 0, 1], True, 0, True]
    assert got["channels"] == [4, 4, 4, 6, 0, 0]


def test_unreadable_table_is_reported(lib, tmp_path):
    got = _drive(lib, tmp_path / "missing.csv", "dp", [[ALLREDUCE, 4096]])
    assert got["after"] == [6, 1, [], False, 1, True]
    assert got["channels"] == [0]


def test_not_loaded_library_reads_none(lib):
    """A library this process never loaded is not opened by the reader (RTLD_NOLOAD)."""
    from lagom_megatron.nccl.plugin_status import read_plugin_status

    assert read_plugin_status(str(lib)) is None
    with pytest.raises(ValueError, match="max_rows"):
        read_plugin_status(str(lib), max_rows=-1)


def _rows():
    from lagom_megatron.nccl.export import TunerRow

    return [
        TunerRow(cells=("allreduce", "4096", "4096"), sites=("dp.ar[0]",)),
        TunerRow(cells=("reducescatter", "41943040", "41943040"), sites=("tp.rs[0]", "tp.rs[1]", "tp.rs[2]")),
        TunerRow(cells=("allgather", "1024", "1024"), sites=("tp.ag[0]",)),
    ]


def test_summarize_hits_names_rows_never_matched():
    from lagom_megatron.nccl.plugin_status import PluginStatus, summarize_hits

    status = PluginStatus(
        path="/x/libnccl-tuner-lagom.so", abi_version=6, init_count=12, row_hits=(5, 0, 0), table_loaded=True
    )
    assert summarize_hits(status, _rows()) == (
        "lagom: tuner plugin ABI v6, 12 communicator(s): 1/3 planned rows matched at least once; never matched: "
        "row 2 (reducescatter,41943040,41943040; tp.rs[0] +2 more), row 3 (allgather,1024,1024; tp.ag[0])"
    )
    assert summarize_hits(status, _rows(), max_listed=1).endswith("tp.rs[0] +2 more), and 1 more")
    all_hit = PluginStatus(path="p", abi_version=5, init_count=3, row_hits=(1, 2, 3), table_loaded=True)
    assert (
        summarize_hits(all_hit, _rows())
        == "lagom: tuner plugin ABI v5, 3 communicator(s): 3/3 planned rows matched at least once"
    )


def test_summarize_hits_when_nothing_can_have_applied():
    from lagom_megatron.nccl.plugin_status import PluginStatus, summarize_hits

    assert summarize_hits(None, _rows()) == (
        "lagom: tuner plugin not loaded by NCCL in this process: none of the 3 planned rows can have been applied"
    )
    no_table = PluginStatus(path="p", abi_version=6, init_count=2, row_hits=(), table_loaded=False, table_failures=2)
    assert summarize_hits(no_table, _rows()) == (
        "lagom: tuner plugin ABI v6, 2 communicator(s), 2 unreadable table "
        "load(s): no plan table loaded; none of the 3 planned rows applied"
    )
    idle = PluginStatus(path="p", abi_version=0, init_count=0, row_hits=(), table_loaded=False)
    assert summarize_hits(idle, _rows()) == (
        "lagom: tuner plugin mapped in this process but NCCL initialised no "
        "communicator with it: none of the 3 planned rows can have been applied"
    )
    other = PluginStatus(path="p", abi_version=6, init_count=2, row_hits=(1,), table_loaded=True)
    assert "the loaded table has 1 rows, the plan 3: it is not this plan's table" in summarize_hits(other, _rows())


def test_plan_hit_summary_in_a_process_without_the_plugin(monkeypatch):
    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.engine.plan import Plan, PlanEntry
    from lagom_megatron.nccl import plugin_status
    from lagom_megatron.nccl.export import plan_hit_summary

    monkeypatch.setattr(plugin_status, "read_plugin_status", lambda: None)  # other tests may have loaded it here
    entry = PlanEntry(
        config=CommConfig(algorithm="Ring", n_channels=4),
        predicted_t_comm_us=1.0,
        predicted_t_region_us=1.0,
        group="dp",
        op="all_reduce",
        nbytes=4096,
        group_size=8,
        n_nodes=1,
    )
    assert plan_hit_summary(Plan(entries={"dp.ar[0]": entry})).startswith(
        "lagom: tuner plugin not loaded by NCCL in this process: none of the 1 planned rows"
    )
