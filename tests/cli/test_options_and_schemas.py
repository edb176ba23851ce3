"""Every option and input of the `lagom` commands is checked before anything runs: one error line,
exit 2; exit codes mean the same in every command; a fall-back is reported as one, never as a gain."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lagom_megatron.cli.main import main

DATA = Path(__file__).resolve().parents[1] / "engine" / "data"
GLOO_PROFILE = DATA / "gloo_tp2_dp2_profile.json"


def _one_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert captured.out == "", "something ran before the checks passed"
    return err[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["simulate", "--preset", "gpt3-13b-h100x64", "--verify-iters", "100000000"],
            "argument --verify-iters: 100000000 is not an integer in 1..200",
        ),
        (["simulate", "--preset", "gpt3-13b-h100x64", "--verify-iters", "0"], "0 is not an integer in 1..200"),
        (
            ["simulate", "--preset", "gpt3-13b-h100x64", "--show", "-1"],
            "argument --show: -1 is not an integer in 0..10000",
        ),
        (["simulate", "--preset", "gpt3-13b-h100x64", "--seed", "abc"], "'abc' is not an integer in 0..4294967295"),
        (["simulate", "--preset", "gpt3-13b-h100x64", "--method", "magic"], "invalid choice: 'magic'"),
        (
            ["simulate", "--preset", "gpt3-13b-h100x64", "--method", "exhaustive"],
            "--method exhaustive: 121 tunable sites need at least 2^121 joint configurations, above the limit of 2,000,000",
        ),
        (
            ["doctor", "--preset", "llama3-8b-h100x8", "--world-size", "0"],
            "argument --world-size: 0 is not an integer in 1..1048576",
        ),
        (["doctor", "--preset", "llama3-8b-h100x8", "--gpus-per-node", "x"], "'x' is not an integer in 1..1024"),
    ],
)
def test_simulate_and_doctor_options_are_bounded(argv, expected, capsys):
    assert main(argv) == 2
    line = _one_error(capsys)
    assert line.startswith(f"lagom {argv[0]}: error: ") and expected in line, line


def test_unwritable_outputs_are_refused_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for argv in (
        ["simulate", "--preset", "gpt3-13b-h100x64", "--plan-out", str(blocker / "plan.json")],
        ["search", "--profile", str(GLOO_PROFILE), "-o", str(blocker / "plan.json")],
        ["build-tuner", "-o", str(blocker / "sub")],
    ):
        assert main(argv) == 2
        assert f"{blocker} is a file, not a folder" in _one_error(capsys)


def _bad_profile(tmp_path: Path, edit) -> str:
    data = json.loads(GLOO_PROFILE.read_text())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda d: d.update(iteration_us=0), "iteration_us: Input should be greater than 0; got 0"),
        (lambda d: d.update(iteration_us=float("inf")), "iteration_us: must be a finite number; got inf"),
        (lambda d: d["sites"].append(d["sites"][0]), "is listed twice (each site once)"),
        (lambda d: d["sites"][0].update(nbytes="1MB"), "sites.0.nbytes: Input should be a valid integer; got '1MB'"),
        (lambda d: d["sites"][0].update(nbytes=1e30), "sites.0.nbytes: Input should be a valid integer"),
        (
            lambda d: d["sites"][0].update(nbytes=2**41),
            "sites.0.nbytes: Input should be less than or equal to 1099511627776",
        ),
        (lambda d: d["samples"][0]["config"].update(n_channels=999), "n_channels"),
        (lambda d: d.update(backend="mpi"), "backend: Input should be 'nccl', 'gloo' or 'sim'; got 'mpi'"),
        (lambda d: d.update(surprise=1), "surprise: Extra inputs are not permitted"),
        (
            lambda d: d["samples"][0].update(calls=[[1.0, 2.0]]),
            "samples.0.calls: calls[0] must be three times [t_comm_us, t_comp_us, t_region_us]; got [1.0, 2.0]",
        ),
        (
            lambda d: d["samples"][0].update(calls=5),
            "samples.0.calls: must be a list of [t_comm_us, t_comp_us, t_region_us]",
        ),
        (
            lambda d: d["samples"][0].update(calls=[[1.0, -2.0, 3.0]]),
            "calls[0] must be three finite times >= 0 (t_comm_us, t_comp_us, t_region_us); got [1.0, -2.0, 3.0]",
        ),
        (
            lambda d: d["sites"][0].update(parts=[["uint8", "4MB"]]),
            "sites.0.parts: parts[0] must be [dtype, bytes] with bytes an integer >= 0; got ['uint8', '4MB']",
        ),
        (
            lambda d: d["sites"][0].update(registered="maybe"),
            "sites.0.registered: Input should be '', 'pool', 'symmetric' or 'fixed'",
        ),
        # accepted before, with a plan written: what the plan is valid for, and what a site can be
        (lambda d: d.pop("fingerprint"), "bad.json: fingerprint: Field required"),
        (
            lambda d: d["fingerprint"].update(world_size=0),
            "fingerprint.world_size: Input should be greater than or equal to 1; got 0",
        ),
        (lambda d: d["fingerprint"].pop("cluster"), "fingerprint.cluster: Field required"),
        (
            lambda d: d["fingerprint"].update(backend="nccl"),
            "fingerprint.backend 'nccl' is not the profile's backend 'gloo'",
        ),
        (
            lambda d: d["sites"][0].update(group_size=1),
            "sites.0.group_size: Input should be greater than or equal to 2; got 1",
        ),
        (
            lambda d: d["sites"][0].update(dtype="float99"),
            "sites.0.dtype: Input should be 'float32', 'float16', 'bfloat16',",
        ),
    ],
)
def test_search_refuses_bad_profiles(tmp_path, capsys, edit, expected):
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", _bad_profile(tmp_path, edit), "-o", str(out)]) == 2
    line = _one_error(capsys)
    assert expected in line and line.count("; got ") <= 1, line
    assert not out.exists()


def test_search_refuses_a_cluster_of_another_backend(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "--profile", str(GLOO_PROFILE), "--cluster", "h100-sxm-ib400", "-o", str(out)]) == 2
    assert "--cluster 'h100-sxm-ib400' is a nccl cluster" in _one_error(capsys) and not out.exists()


@pytest.fixture()
def gloo_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["search", "--profile", str(GLOO_PROFILE), "-o", str(path)]) == 0
    out = capsys.readouterr().out
    # a gloo run is not compared with "NCCL defaults", and the times are in ms like Megatron's log
    assert re.search(
        r"predicted iteration [\d.]+ ms vs defaults \(gloo: 2 worker threads, no split\) [\d.]+ ms", out
    ), out
    assert "NCCL" not in out
    return path


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda d: d.update(backend="mpi"), "backend: Input should be 'nccl', 'gloo' or 'sim'; got 'mpi'"),
        (lambda d: d.update(mechanism="magic"), "mechanism must be one of ['gloo'] for backend 'gloo'; got 'magic'"),
        (
            lambda d: d.update(method="magic"),
            "method: Input should be 'priority', 'autoccl', 'exhaustive' or 'nccl-default'",
        ),
        (
            lambda d: d["fingerprint"].update(world_size=0),
            "fingerprint.world_size: Input should be greater than or equal to 1; got 0",
        ),
        (
            lambda d: next(iter(d["entries"].values())).update(config=None),
            ".config: Input should be a valid dictionary; got None",
        ),
        (
            lambda d: next(iter(d["entries"].values())).update(nbytes="1MB"),
            ".nbytes: Input should be a valid integer; got '1MB'",
        ),
    ],
)
def test_plan_validate_refuses_bad_top_level_fields(gloo_plan, capsys, edit, expected):
    data = json.loads(gloo_plan.read_text())
    edit(data)
    gloo_plan.write_text(json.dumps(data))
    assert main(["plan", "validate", str(gloo_plan)]) == 2
    assert expected in _one_error(capsys)


def test_plan_show_and_diff_name_the_gloo_default_and_the_verification(gloo_plan, tmp_path, capsys):
    assert main(["plan", "show", str(gloo_plan)]) == 0
    out = capsys.readouterr().out
    assert "verification: never verified" in out and "NCCL default" not in out
    data = json.loads(gloo_plan.read_text())
    data["stats"].update(verification="fell_back", verification_reason="gain 1.0 ms, needed > 5.0 ms")
    rejected = tmp_path / "rejected.json"
    rejected.write_text(json.dumps(data))
    assert main(["plan", "diff", str(gloo_plan), str(rejected)]) == 1
    assert capsys.readouterr().out.strip() == (
        "verification: never verified -> fell_back (rejected: gain 1.0 ms, needed > 5.0 ms)"
    )
    assert main(["plan", "export", str(gloo_plan), "--format", "env", "--extended"]) == 2
    assert "--extended is for --format nccl-tuner-csv only" in _one_error(capsys)


def test_simulate_fall_back_is_its_result_and_shows_no_gain(capsys):
    assert main(["simulate", "--preset", "gpt3-13b-h100x64", "--show", "0"]) == 0  # done, whichever the result
    out = capsys.readouterr().out
    m = re.search(
        r"result: (applied|fell_back): gain (-?[\d.]+) ms \(mean of (\d+) paired differences, defaults - "
        r"plan\), needed > ([\d.]+) ms \(the larger of its (?:95%|[\d.]+% \(95% over \d looks\)) bound [\d.]+ ms "
        r"and the minimum gain [\d.]+ ms\)",
        out,
    )
    assert m, out
    assert "FELL_BACK" not in out and "reverted" not in out
    assert (m.group(1) == "applied") == (float(m.group(2)) > float(m.group(4)))  # the line's own statistic decides
    if m.group(1) == "fell_back":
        assert "after tuning                 : the defaults (fell_back); no gain" in out
        # no time after the fall-back line below the measured defaults
        after = out[out.index("after tuning") :]
        assert not [float(x) for x in re.findall(r"([\d.]+) ms", after.split("\n")[0])]


def test_simulate_of_a_cpu_preset_lists_the_gpu_clusters(capsys):
    from lagom_megatron.engine.cluster import ClusterSpec, available_clusters

    gpu = [c for c in available_clusters() if ClusterSpec.load(c).backend == "nccl"]
    assert "h100-sxm-ib400" in gpu and "cpu-gloo" not in gpu
    assert main(["simulate", "--preset", "cpu-tp2-dp2"]) == 2
    assert _one_error(capsys) == (
        "lagom simulate: error: cluster 'cpu-gloo' is a gloo cluster; the simulator models "
        f"GPU clusters (nccl): one of {gpu} or a GPU cluster YAML"
    )


def test_simulate_lists_only_sites_with_a_predicted_saving(capsys):
    from lagom_megatron.cli.simulate import _print_top_sites
    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.engine.plan import Plan, PlanEntry

    def entry(config, default_us, planned_us):
        return PlanEntry(
            config=config,
            predicted_t_comm_us=1.0,
            predicted_t_region_us=planned_us,
            group="dp",
            predicted_default_t_region_us=default_us,
        )

    plan = Plan(
        entries={
            "a": entry(CommConfig(n_channels=8), 12_000.0, 11_000.0),
            "worse": entry(CommConfig(n_channels=8), 12_360.0, 12_370.0),  # shares a's config
            "equal": entry(CommConfig(n_threads=512), 5_000.0, 5_000.0),
            "b": entry(CommConfig(n_channels=4), 9_000.0, 8_500.0),
            "default": entry(CommConfig(), 7_000.0, 7_000.0),
        }
    )
    _print_top_sites(plan, 10)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  largest predicted savings (priority; region time per iteration, model):"
    assert [line.split()[0] for line in lines[1:3]] == ["a", "b"]
    assert lines[1].endswith("12.00 ->    11.00 ms (+1.00)") and lines[2].endswith("9.00 ->     8.50 ms (+0.50)")
    assert lines[3:] == ["  2 other sites changed with no predicted saving of their own (model)"]
    _print_top_sites(plan, 1)
    assert len(capsys.readouterr().out.splitlines()) == 3  # heading, a, the count


def test_simulate_show_lists_no_site_whose_time_grows(capsys):
    # gpt3-175b-h100x512's plan once listed '12.36 -> 12.37 ms (-0.00)' under "largest predicted
    # savings"; sites without a predicted gain now keep NCCL's defaults (engine/priority.py), so it
    # keeps them everywhere, and a preset with real savings lists only those
    assert main(["simulate", "--preset", "gpt3-175b-h100x512", "--show", "10"]) == 0
    assert "(-0.00)" not in capsys.readouterr().out
    assert main(["simulate", "--preset", "llama3-8b-h100x8", "--show", "10"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"([\d.]+) ->\s+([\d.]+) ms \(([+-][\d.]+)\)", out)
    assert listed and all(float(saved) >= 0 and float(b) <= float(a) for a, b, saved in listed), listed
    assert "(-0.00)" not in out
