"""SLURM host lists and tasks per node parsed as SLURM defines them, and allocations the launch
cannot honour refused before srun (``launch/slurm.py``)."""

import pytest

from lagom_megatron.launch.slurm import check_allocation, expand_hostlist, main, parse_tasks_per_node


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node-a07", ["node-a07"]),
        ("node-a[07-08]", ["node-a07", "node-a08"]),
        ("gpu[1,3-4],login1", ["gpu1", "gpu3", "gpu4", "login1"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # the low bound's zero padding is kept
        ("rack[1-2]-gpu[1-2]", ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]),
    ],
)
def test_hostlist_expansion(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, fault",
    [
        ("node[1-2", "'[' without ']'"),
        ("node1-2]", "']' without '['"),
        ("node[2-1]", "range '2-1' runs backwards"),
        ("node[a-b]", "holds 'a-b', not a number or a range LOW-HIGH"),
        ("node1,,node2", "an empty entry between commas"),
        ("", "empty host list"),
    ],
)
def test_malformed_hostlists_are_refused(text, fault):
    with pytest.raises(ValueError) as info:
        expand_hostlist(text)
    assert fault in str(info.value)


@pytest.mark.parametrize("text, counts", [("8", [8]), ("8(x2)", [8, 8]), ("8(x2),4", [8, 8, 4]), ("1(x3)", [1, 1, 1])])
def test_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["8x2", "8(2)", "(x2)", "8(x0)", "a"])
def test_malformed_tasks_per_node(text):
    with pytest.raises(ValueError, match="is not N or N\\(xM\\)"):
        parse_tasks_per_node(text)


def test_allocation_the_launch_cannot_honour():
    ok = {"SLURM_JOB_NODELIST": "g[01-02]", "SLURM_TASKS_PER_NODE": "8(x2)"}
    check_allocation(ok, nodes=2, tasks_per_node=8, name="p")
    with pytest.raises(ValueError, match=r"SLURM_JOB_NODELIST='g\[01-03\]' names 3 nodes but preset 'p' needs 2"):
        check_allocation({"SLURM_JOB_NODELIST": "g[01-03]"}, nodes=2, tasks_per_node=8, name="p")
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='8,4': the launch needs 8 task\(s\) on every node"):
        check_allocation(
            {"SLURM_JOB_NODELIST": "g[01-02]", "SLURM_TASKS_PER_NODE": "8,4"}, nodes=2, tasks_per_node=8, name="p"
        )
    with pytest.raises(ValueError, match="one torchrun per node"):
        check_allocation({"SLURM_TASKS_PER_NODE": "8(x2)"}, nodes=2, tasks_per_node=1, name="p")


def test_launch_stops_on_a_bad_allocation(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-3")
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    assert main(["--preset", "llama3-8b-h100x8"]) == 2
    assert capsys.readouterr().err.strip() == "lagom launch: error: host list 'node[1-3': '[' without ']'"
