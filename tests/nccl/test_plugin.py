"""Builds the NCCL tuner plugin and its C harness with gcc, runs the harness, and checks the
plugin's answers for tables written here (the expected values are worked out from the table)."""

import ctypes
import shutil
import subprocess

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.nccl.plugin import PLUGIN_DIR, build_harness, build_tuner
from tests.timeouts import COMMAND_S

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="gcc is not installed: the tuner plugin is built with gcc"
)

ALGOS = ["tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"]
PROTOS = ["ll", "ll128", "simple"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuner")
    return build_tuner(out), build_harness(out)


def _query(built, table, tag, n_ranks, n_nodes, coll, nbytes):
    lib, harness = built
    proc = subprocess.run(
        [str(harness), str(lib), "--query", str(table), tag, str(n_ranks), str(n_nodes), coll, str(nbytes)],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 0, proc.stderr
    fields = dict(kv.split("=") for kv in proc.stdout.split())
    algo, proto = int(fields["algo"]), int(fields["proto"])
    return {
        "algo": ALGOS[algo] if algo >= 0 else None,
        "proto": PROTOS[proto] if proto >= 0 else None,
        "channels": int(fields["channels"]),
        "chunk": int(fields["chunk"]),
        "log": proc.stderr,
    }


def test_harness_passes_every_case(built):
    lib, harness = built
    listed = subprocess.run([str(harness), str(lib), "--list"], capture_output=True, text=True, check=True)
    names = listed.stdout.split()
    assert {"several_comms", "malformed_tables", "empty_table", "missing_table", "older_abis"} <= set(names)
    # tuner ABI v7 (NCCL 2.32) in NCCL's order (nccl/plugin/test/test_calls.c)
    assert "tuner_v7" in names
    # the profiler half in NCCL's order for ABI v1-v7 (nccl/plugin/test/test_observed.c)
    assert {
        "profiler_match_plan",
        "profiler_clamped_channels",
        "profiler_other_algorithm",
        "profiler_p2p",
        "profiler_missing_comm_name",
        "profiler_user_plugin",
        "profiler_comm_name_keys_rows",
        "profiler_activation_mask",
        "profiler_bounded",
        "profiler_small_call",
        "profiler_proxy_before_host_stop",
        "profiler_v7_fields",
        # copy-engine collectives, ABI v6-v7, in NCCL's order (nccl/plugin/test/test_ce.c)
        "profiler_ce_allgather",
    } <= set(names)
    proc = subprocess.run([str(harness), str(lib)], capture_output=True, text=True, timeout=COMMAND_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("PASS ")]
    assert passed == names, f"got {passed} but should be {names}"


def test_harness_under_address_sanitizer(tmp_path):
    """Same cases with ASan/UBSan/LeakSanitizer: every error path must free what it allocated."""
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    probe = subprocess.run(
        ["gcc", *flags, "-x", "c", "-", "-o", str(tmp_path / "probe")],
        input="int main(void){return 0;}",
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip("gcc here has no AddressSanitizer runtime")
    lib = build_tuner(tmp_path, extra_cflags=flags)
    harness = build_harness(tmp_path, extra_cflags=flags)
    proc = subprocess.run([str(harness), str(lib)], capture_output=True, text=True, timeout=COMMAND_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR: " not in proc.stderr, proc.stderr


def test_exports_only_the_abi_structs_and_status(built):
    lib = ctypes.CDLL(str(built[0]))
    for version in (3, 4, 5, 6, 7):
        assert hasattr(lib, f"ncclTunerPlugin_v{version}")
    for version in (1, 2, 3, 4, 5, 6, 7):
        assert hasattr(lib, f"ncclProfiler_v{version}")
    for status in (
        "lagomTunerAbiVersion",
        "lagomTunerInitCount",
        "lagomTunerRowHits",
        "lagomTunerTableFailures",
        "lagomProfilerSnapshot",
        "lagomProfilerSetActive",
        "lagomProfilerReset",
        "lagomProfilerState",
        "lagomProfilerInitCount",
        "lagomProfilerAbiVersion",
        "lagomProfilerForeign",
    ):
        assert hasattr(lib, status), f"status export {status} missing"
    for internal in (
        "lagomInit",
        "lagomGetCollInfo",
        "loadTable",
        "parseRow",
        "statusTableHits",
        "takeSlice",
        "observedStart",
        "observedNewComm",
        "findBucket",
        "initAny",
    ):
        assert not hasattr(lib, internal), f"{internal} should be hidden"


def test_nm_lists_the_profiler_and_tuner_symbols(built):
    """The dynamic symbol table, as NCCL's dlsym sees it: ncclProfiler_v1..v7 (v7: what NCCL 2.31.2 looks up
    first, ``src/plugin/profiler.cc:123`` @8898068) and ncclTunerPlugin_v3 up to the newest tuner ABI lagom
    declares (v7: NCCL 2.32's first lookup, ``src/plugin/tuner.cc:76`` @2449986f), and no other ``nccl*``
    symbol: no ``ncclProfiler_v8`` (NCCL 2.32.6's, whose header lagom has not read)."""
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    from lagom_megatron.nccl.plugin_launch import NEWEST_TUNER_ABI

    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(built[0])], capture_output=True, text=True, check=True
    ).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    nccl = {n for n in names if n.startswith("nccl")}
    assert nccl == {f"ncclProfiler_v{v}" for v in range(1, 8)} | {
        f"ncclTunerPlugin_v{v}" for v in range(3, NEWEST_TUNER_ABI + 1)
    }
    assert NEWEST_TUNER_ABI == 7


def test_extended_table_per_communicator(built, tmp_path):
    table = tmp_path / "plan.csv"
    table.write_text(
        "# collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff,chunkSize,commTag\n"
        "reducescatter,0,33554432,ring,simple,4,-1,8,-1,-1,262144,dp_cp\n"
        "allgather,0,-1,ring,ll,2,-1,8,-1,-1,-1,dp_cp\n"
        "allgather,0,-1,nvls,simple,6,1,4,-1,-1,-1,tp\n"
        "allreduce,0,-1,tree,ll128,12,-1,-1\n"
    )
    rs = _query(built, table, "dp_cp", 8, 1, "reducescatter", 33554432)
    assert (rs["algo"], rs["proto"], rs["channels"], rs["chunk"]) == ("ring", "simple", 4, 262144)
    rs_big = _query(built, table, "dp_cp", 8, 1, "reducescatter", 33554433)
    assert (rs_big["algo"], rs_big["channels"], rs_big["chunk"]) == (None, 0, -1)
    ag = _query(built, table, "dp_cp", 8, 1, "allgather", 1 << 20)
    assert (ag["algo"], ag["proto"], ag["channels"], ag["chunk"]) == ("ring", "ll", 2, -1)
    tp = _query(built, table, "tp", 4, 1, "allgather", 1 << 20)
    assert (tp["algo"], tp["proto"], tp["channels"]) == ("nvls", "simple", 6)
    tp_entry = _query(built, table, "tp/plugin_any_2", 4, 1, "allgather", 1 << 20)
    assert (tp_entry["algo"], tp_entry["channels"]) == ("nvls", 6), "a pool entry of tp gets tp's rows"
    tp_cp = _query(built, table, "tp_cp", 4, 1, "allgather", 1 << 20)
    assert tp_cp["channels"] == 0, "tp_cp is another group"
    tp_two_nodes = _query(built, table, "tp", 4, 2, "allgather", 1 << 20)
    assert tp_two_nodes["channels"] == 0 and tp_two_nodes["algo"] is None
    any_comm = _query(built, table, "-", 16, 2, "allreduce", 100)
    assert (any_comm["algo"], any_comm["proto"], any_comm["channels"]) == ("tree", "ll128", 12)
    assert "1 of 4 rows" in any_comm["log"]


def test_ten_column_table_of_nccl_example_format(built, tmp_path):
    """The 10-column rows NCCL's example plugin reads are accepted unchanged."""
    table = tmp_path / "nccl_tuner.conf"
    table.write_text("allreduce,65537,1048576,ring,simple,4,1,8,1,0\n")
    hit = _query(built, table, "-", 8, 1, "allreduce", 65537)
    assert (hit["algo"], hit["proto"], hit["channels"]) == ("ring", "simple", 4)
    miss = _query(built, table, "-", 8, 1, "allreduce", 65536)
    assert (miss["algo"], miss["channels"]) == (None, 0)


def test_malformed_table_keeps_nccl_choice(built, tmp_path):
    table = tmp_path / "bad.csv"
    table.write_text("allreduce,0,-1,ring,simple,4,-1,-1\nallreduce,0,-1,ring,simple,4,-1,-1,x\n")
    res = _query(built, table, "-", 8, 1, "allreduce", 4096)
    assert (res["algo"], res["channels"]) == (None, 0)
    assert "line 2: numPipeOps 'x'" in res["log"] and "the whole table is ignored" in res["log"]


def test_makefile_build_and_test_targets(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(
        ["make", "-C", str(PLUGIN_DIR), "test", f"BUILD_DIR={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 failed" in proc.stdout
    assert (tmp_path / "libnccl-tuner-lagom.so").is_file()


def test_build_tuner_command(tmp_path, capsys):
    assert main(["build-tuner", "-o", str(tmp_path / "out")]) == 0
    lib = tmp_path / "out" / "libnccl-tuner-lagom.so"
    assert capsys.readouterr().out.splitlines()[0] == str(lib.resolve())
    assert hasattr(ctypes.CDLL(str(lib)), "ncclTunerPlugin_v6")


def test_the_export_hint_is_a_shell_command_for_a_folder_with_spaces(tmp_path, capsys):
    """The hint was ``export NCCL_TUNER_PLUGIN=<tmp>/dir with space/...``: three words for the shell."""
    out = tmp_path / "dir with space"
    assert main(["build-tuner", "-o", str(out)]) == 0
    lib, hint = capsys.readouterr().out.splitlines()
    command = hint.removeprefix("# use it with:").split("  (")[0].strip()
    shown = subprocess.run(
        [
            "bash",
            "-c",
            f'{command}; printf "%s|%s|%s" "$NCCL_TUNER_PLUGIN" "$NCCL_PROFILER_PLUGIN" "$LAGOM_TUNER_CONFIG"',
        ],
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert shown.returncode == 0 and shown.stdout == f"{lib}|{lib}|TABLE.csv", shown.stderr
    assert lib == str((out / "libnccl-tuner-lagom.so").resolve())


def test_missing_compiler_is_a_clear_error(tmp_path, capsys):
    assert main(["build-tuner", "-o", str(tmp_path), "--cc", "no-such-cc-lagom"]) == 2
    err = capsys.readouterr().err
    assert "C compiler 'no-such-cc-lagom' not found on PATH" in err and "gcc" in err


def test_gpu_check_script_fails_gracefully_without_a_gpu(tmp_path):
    """check.sh where the steps' imports are missing (a torch that cannot be imported stands in for a machine
    without CUDA torch): one line naming what is missing, exit 1, and a summary.md that lists every step as not
    run and says what one GPU cannot show; the rehearsal (tests/nccl/test_gpu_rehearsal.py) runs the steps."""
    import os
    import sys

    script = PLUGIN_DIR.parents[2] / "scripts" / "gpu" / "check.sh"
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "torch.py").write_text("raise ImportError('torch hidden by the test')\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(shadow)}
    proc = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=COMMAND_S, env=env
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert "no Python has what the steps import" in line and "missing torch (ImportError)" in line
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"| imports | FAILED | {sys.executable}: missing torch (ImportError)" in summary
    for step in ("environment", "contention probe", "build tuner plugin", "NCCL pool + tuner plugin"):
        assert f"| {step} | not run |" in summary, step
    assert "What one GPU cannot show" in summary


def test_exported_plan_table_is_read_by_the_plugin(built, tmp_path):
    """Contract with `lagom plan export --format nccl-tuner-csv --extended`: every exported row is
    accepted, and each entry's call gets the entry's algorithm, protocol, channels and chunk."""
    export = pytest.importorskip("lagom_megatron.nccl.export", reason="the plan exporter is not in this checkout")
    import inspect

    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.engine.plan import Plan, PlanEntry

    if "extended" not in inspect.signature(export.export_plan).parameters:
        pytest.skip("export_plan has no extended= parameter")
    entries = {
        "dp.grad_reduce_scatter[bucket0]": PlanEntry(
            config=CommConfig(algorithm="Ring", protocol="Simple", n_channels=4, chunk_size=131072),
            predicted_t_comm_us=100.0,
            predicted_t_region_us=120.0,
            group="dp",
            op="reduce_scatter",
            nbytes=8 << 20,
            group_size=8,
            n_nodes=1,
        ),
        "tp.sp_all_gather[layer0]": PlanEntry(
            config=CommConfig(algorithm="Ring", protocol="LL", n_channels=2),
            predicted_t_comm_us=10.0,
            predicted_t_region_us=30.0,
            group="tp",
            op="all_gather",
            nbytes=1 << 16,
            group_size=4,
            n_nodes=1,
        ),
    }
    text = export.export_plan(Plan(entries=entries), "nccl-tuner-csv", extended=True)
    table = tmp_path / "plan.csv"
    table.write_text(text if isinstance(text, str) else str(text))
    rows = [line.split(",") for line in table.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert rows, "the exporter wrote no rows"
    colls = {"reduce_scatter": "reducescatter", "all_gather": "allgather"}
    for site, entry in entries.items():
        row = next(
            r
            for r in rows
            if r[0] == colls[entry.op] and int(r[1]) <= entry.nbytes and (int(r[2]) == -1 or entry.nbytes <= int(r[2]))
        )
        tag = row[11].strip() if len(row) > 11 and row[11].strip() not in ("", "*") else "-"
        # the group's own communicator, and a pool entry of that group (tagged "<group>/<key>")
        for comm in (tag, f"{tag}/plugin_any_any" if tag != "-" else "-"):
            got = _query(built, table, comm, entry.group_size, entry.n_nodes, colls[entry.op], entry.nbytes)
            assert "ignored" not in got["log"], got["log"]
            cfg = entry.config
            assert (got["algo"], got["proto"]) == (cfg.algorithm.lower(), cfg.protocol.lower()), (site, comm)
            assert got["channels"] == cfg.n_channels, (site, comm)
            assert got["chunk"] == (cfg.chunk_size or -1), (site, comm)


def _nccl_example_decision(table_text, n_ranks, n_nodes, coll, nbytes):
    """What NCCL's example tuner plugin decides for one call, from its source (NCCL v2.30.7
    plugins/tuner/example/plugin.c): lines starting with '#' skipped (:199), at most 10
    comma-separated fields (:216), 8-10 accepted (:229); unknown algorithm -> ring (:81-91),
    unknown protocol -> simple (:107-112), channels by atoi (:236); every call first presets one
    channel (:361); the first matching row sets its cost entry to 0 and its channels unless -1
    (:382-409)."""
    algos = {name: i for i, name in enumerate(ALGOS)}
    protos = {name: i for i, name in enumerate(PROTOS)}
    channels, choice = 1, (None, None)
    for line in table_text.splitlines():
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",") if f != ""][:10]
        if not 8 <= len(fields) <= 10:
            continue
        c_nodes, c_ranks = int(fields[6]), int(fields[7])
        if (
            fields[0] == coll
            and int(fields[1]) <= nbytes <= int(fields[2])
            and c_nodes in (-1, n_nodes)
            and c_ranks in (-1, n_ranks)
        ):
            algo = fields[3] if fields[3] in algos else "ring"
            proto = fields[4] if fields[4] in protos else "simple"
            if int(fields[5]) != -1:
                channels = int(fields[5])
            choice = (algo, proto)
            break
    return choice[0], choice[1], channels


def test_ten_column_export_gives_the_same_decisions_in_nccl_example_plugin(built, tmp_path):
    """The 10-column export holds only rows both plugins read alike; only unmatched calls differ:
    NCCL's example runs them on 1 channel, lagom's plugin leaves NCCL's choice (docs/nccl.md)."""
    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.engine.plan import Plan, PlanEntry
    from lagom_megatron.nccl.export import export_plan

    def entry(cfg, op, nbytes, group_size, n_nodes):
        return PlanEntry(
            config=cfg,
            predicted_t_comm_us=1.0,
            predicted_t_region_us=1.0,
            group="dp",
            op=op,
            nbytes=nbytes,
            group_size=group_size,
            n_nodes=n_nodes,
        )

    plan = Plan(
        entries={
            "dp.rs[0]": entry(
                CommConfig(algorithm="Ring", protocol="Simple", n_channels=12), "reduce_scatter", 41943040, 8, 1
            ),
            "dp.ag[0]": entry(CommConfig(algorithm="PAT", protocol="LL", n_channels=2), "all_gather", 1 << 20, 16, 2),
            "dp.ar[0]": entry(CommConfig(algorithm="Tree", protocol="LL128", n_channels=16), "all_reduce", 4096, 16, 2),
        }
    )
    text = export_plan(plan, "nccl-tuner-csv")
    table = tmp_path / "nccl_tuner.conf"
    table.write_text(text)
    colls = {"reduce_scatter": "reducescatter", "all_gather": "allgather", "all_reduce": "allreduce"}
    for e in plan.entries.values():
        ours = _query(built, table, "-", e.group_size, e.n_nodes, colls[e.op], e.nbytes)
        theirs = _nccl_example_decision(text, e.group_size, e.n_nodes, colls[e.op], e.nbytes)
        assert (ours["algo"], ours["proto"], ours["channels"]) == theirs
        assert theirs == (e.config.algorithm.lower(), e.config.protocol.lower(), e.config.n_channels)
    miss_ours = _query(built, table, "-", 8, 1, "allreduce", 12345)
    assert (miss_ours["algo"], miss_ours["channels"]) == (None, 0)
    assert _nccl_example_decision(text, 8, 1, "allreduce", 12345) == (None, None, 1)
