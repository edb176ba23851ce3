"""NCCL environment checks: NCCL_ALGO/NCCL_PROTO grammar as NCCL's parseList reads it, and the
domains of the thread, CTA, buffer, CGA and CTA-policy variables."""

import sys

import pytest

from lagom_megatron.nccl.env_check import check_nccl_env, override_issues
from lagom_megatron.nccl.env_vars import FUNCTIONS, max_ctas, parse_selection


def levels(env, version="2.27.5"):
    return [(i.variable, i.level) for i in check_nccl_env(env, nccl_version=version)]


@pytest.mark.parametrize(
    "value",
    [
        "ring,tree",
        "^tree",
        "ring;allreduce:tree,collnetdirect",
        "allreduce:tree;allgather:ring",
        "Ring,NVLS",
        "RING,tree,",
    ],
)
def test_valid_algorithm_values(value):
    assert levels({"NCCL_ALGO": value}) == []


@pytest.mark.parametrize(
    "value,message",
    [
        ("allreduce:tree;ring", "All entries except the first must have a prefix"),
        ("allreduce:foo", 'Unrecognized element token "foo"'),
        ("all_reduce:ring", 'Unrecognized prefix token "all_reduce"'),
        ("alltoall:ring", 'Unrecognized prefix token "alltoall"'),
    ],
)
def test_invalid_algorithm_values(value, message):
    (issue,) = check_nccl_env({"NCCL_ALGO": value}, nccl_version="2.27.5")
    assert issue.level == "error" and message in issue.what


def test_parse_selection_semantics():
    sel = parse_selection("ring,collnetdirect;allreduce:tree;broadcast:^ring", "algorithm")
    assert sel["AllReduce"] == {"Tree"}
    assert sel["AllGather"] == {"Ring", "CollNetDirect"}
    assert sel["Broadcast"] == {"Tree", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT"}
    proto = parse_selection("^LL128;allreduce:LL", "protocol")
    assert proto["ReduceScatter"] == {"LL", "Simple"} and proto["AllReduce"] == {"LL"}
    assert set(sel) == set(FUNCTIONS)


@pytest.mark.parametrize("value", ["NVLS", "^ring", "tree,pat"])
def test_global_algorithm_without_ring_is_an_error(value):
    issues = check_nccl_env({"NCCL_ALGO": value}, nccl_version="2.27.5")
    assert [i.level for i in issues] == ["error"] and "Ring" in issues[0].what


def test_per_function_restriction_keeps_ring_elsewhere():
    assert levels({"NCCL_ALGO": "allreduce:nvls"}) == []


@pytest.mark.parametrize(
    "env,version,needle",
    [
        ({"NCCL_ALGO": "ring;allreduce:tree"}, "2.21.5", "needs NCCL 2.24+"),
        ({"NCCL_ALGO": "ring,pat"}, "2.21.5", "PAT, which needs NCCL 2.23+"),
        ({"NCCL_ALGO": "ring,nvls"}, "2.16.2", "NVLS, which needs NCCL 2.17+"),
        ({"NCCL_CTA_POLICY": "1"}, "2.26.2", "needs NCCL 2.27+"),
        ({"NCCL_CTA_POLICY": "EFFICIENCY"}, "2.27.5", "need NCCL 2.29+"),
    ],
)
def test_version_dependent_rules(env, version, needle):
    issues = check_nccl_env(env, nccl_version=version)
    assert len(issues) == 1 and issues[0].level == "error" and needle in issues[0].what
    assert check_nccl_env(env, nccl_version="2.29.1") == []


@pytest.mark.parametrize(
    "value,bad",
    [
        ("LL,LL128,Simple", True),
        ("LL128", True),
        ("^LL128;allreduce:LL128", True),
        ("^LL128", False),
        ("Simple", False),
        ("allreduce:^LL", False),
        ("^LL", False),
    ],
)
def test_forcing_ll128(value, bad):
    assert levels({"NCCL_PROTO": value}) == ([("NCCL_PROTO", "error")] if bad else [])


@pytest.mark.parametrize(
    "value,ok", [("64", True), ("512", True), ("480", False), ("32", False), ("1024", False), ("lots", False)]
)
def test_nthreads(value, ok):
    assert levels({"NCCL_NTHREADS": value}) == ([] if ok else [("NCCL_NTHREADS", "error")])


def test_ll128_nthreads():
    assert levels({"NCCL_LL128_NTHREADS": "640"}) == []
    assert levels({"NCCL_LL128_NTHREADS": "700"}) == [("NCCL_LL128_NTHREADS", "error")]


def test_cta_ranges():
    assert levels({"NCCL_MIN_CTAS": "4", "NCCL_MAX_CTAS": "16"}) == []
    assert levels({"NCCL_MIN_CTAS": "16", "NCCL_MAX_CTAS": "4"}) == [("NCCL_MIN_CTAS", "error")]
    assert levels({"NCCL_MAX_CTAS": "0", "NCCL_MIN_CTAS": "1"}) == [("NCCL_MAX_CTAS", "error")]
    assert levels({"NCCL_MIN_CTAS": "4"}) == [("NCCL_MIN_CTAS", "warning")]
    assert levels({"NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "64"}, "2.27.5") == []
    assert levels({"NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "64"}, "2.21.5") == [("NCCL_MAX_CTAS", "error")]
    assert (max_ctas("2.24.3"), max_ctas("2.25.1"), max_ctas(None)) == (32, 64, 64)


@pytest.mark.parametrize(
    "var,value,level",
    [
        ("NCCL_BUFFSIZE", "4194304", None),
        ("NCCL_BUFFSIZE", "1000000", "error"),
        ("NCCL_BUFFSIZE", "4M", "error"),
        ("NCCL_LL128_BUFFSIZE", "131072", "warning"),
        ("NCCL_P2P_NET_CHUNKSIZE", "2097152", None),
        ("NCCL_P2P_NET_CHUNKSIZE", "3000000", "error"),
        ("NCCL_CHUNK_SIZE", "65536", "warning"),
        ("NCCL_CGA_CLUSTER_SIZE", "4", None),
        ("NCCL_CGA_CLUSTER_SIZE", "9", "error"),
        ("NCCL_CGA_CLUSTER_SIZE", "-1", "error"),
        ("NCCL_CTA_POLICY", "3", "error"),
        ("NCCL_CTA_POLICY", "0", None),
        ("NCCL_NVLS_ENABLE", "3", "error"),
        ("NCCL_NVLS_ENABLE", "0", None),
    ],
)
def test_domains(var, value, level):
    assert levels({var: value}) == ([] if level is None else [(var, level)])


def test_cta_policy_names_combine():
    assert levels({"NCCL_CTA_POLICY": "efficiency|ZERO"}, "2.29.1") == []
    issues = check_nccl_env({"NCCL_CTA_POLICY": "EFFICIENCY|fast"}, nccl_version="2.29.1")
    assert [i.level for i in issues] == ["error"] and "'fast'" in issues[0].what


def test_overrides():
    env = {
        "NCCL_MAX_CTAS": "8",
        "NCCL_PROTO": "^LL128",
        "NCCL_TUNER_PLUGIN": "libnccl-tuner-other.so",
        "NCCL_NTHREADS": "256",
    }
    found = {(i.variable, i.level) for i in override_issues(env)}
    assert found == {("NCCL_MAX_CTAS", "warning"), ("NCCL_PROTO", "warning"), ("NCCL_TUNER_PLUGIN", "warning")}
    assert override_issues({"NCCL_TUNER_PLUGIN": "liblagom_tuner.so"}) == []


def test_engine_module_needs_no_torch():
    import subprocess

    code = "import sys; sys.modules['torch'] = None; import lagom_megatron.nccl.env_check"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_tuner_plugin_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "nonexist.so")
    (issue,) = check_nccl_env({"NCCL_TUNER_PLUGIN": missing})
    assert (issue.level, issue.variable) == ("error", "NCCL_TUNER_PLUGIN")
    assert issue.what == f"NCCL_TUNER_PLUGIN={missing!r}: the file does not exist"
    assert "silently uses its internal tuner" in issue.why
    assert override_issues({"NCCL_TUNER_PLUGIN": missing}) == []  # reported once, as the error above
    present = tmp_path / "libnccl-tuner-other.so"
    present.write_bytes(b"")
    assert check_nccl_env({"NCCL_TUNER_PLUGIN": str(present)}) == []
    assert [i.level for i in override_issues({"NCCL_TUNER_PLUGIN": str(present)})] == ["warning"]
    assert check_nccl_env({"NCCL_TUNER_PLUGIN": "libnccl-tuner-other.so"}) == []  # a name: the loader searches
