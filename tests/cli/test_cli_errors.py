"""Bad paths and interrupted output give one error line (exit 2) or a quiet exit, never a
traceback; files lagom writes are readable by others (the umask's mode, not mkstemp's 0600)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.config.plan_files import load_plan
from lagom_megatron.engine.cluster import available_clusters
from lagom_megatron.engine.files import write_json_atomic, write_text_atomic
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan
from lagom_megatron.engine.search import search

from ..engine.factory import build, profile_from, site


@pytest.fixture()
def saved(tmp_path):
    """A profile and a plan searched from it, saved in tmp_path."""
    profile = profile_from(build())
    profile.save(tmp_path / "profile.json")
    search(profile, rules=build().rules).plan.save(tmp_path / "plan.json")
    return tmp_path


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "argv_of",
    [
        lambda d: ["search", "--profile", str(d / "profile.json"), "-o", str(d)],
        lambda d: ["search", "--profile", str(d), "-o", str(d / "p.json")],
        lambda d: ["plan", "show", str(d)],
        lambda d: ["plan", "export", str(d / "plan.json"), "--format", "env", "-o", str(d)],
    ],
    ids=["search-output-folder", "search-profile-folder", "show-folder", "export-output-folder"],
)
def test_a_folder_where_a_file_is_due_is_one_error_line(saved, capsys, argv_of):
    before = sorted(p.name for p in saved.iterdir())
    assert main(argv_of(saved)) == 2
    assert "is a folder" in _error_line(capsys)
    assert sorted(p.name for p in saved.iterdir()) == before, "a temporary file was left behind"


def test_a_profile_that_is_a_json_list_names_what_was_expected(tmp_path, capsys):
    (tmp_path / "list.json").write_text("[1, 2]")
    assert main(["search", "--profile", str(tmp_path / "list.json"), "-o", str(tmp_path / "p.json")]) == 2
    assert "expected a JSON object (a profile); got a JSON list" in _error_line(capsys)


def test_build_tuner_into_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("keep me")
    assert main(["build-tuner", "-o", str(tmp_path / "f")]) == 2
    assert "is a file; give a folder" in _error_line(capsys)
    assert (tmp_path / "f").read_text() == "keep me"


def test_closed_pipe_exits_quietly(tmp_path):
    problem = build(sites=[site(site_id=f"tp.ag[{i}]") for i in range(1500)])
    search(profile_from(problem), rules=problem.rules).plan.save(tmp_path / "plan.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lagom_megatron", "plan", "show", str(tmp_path / "plan.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`, long before the show (over 64 KiB, a pipe's buffer) ends
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and "Traceback" not in err, err


def test_written_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "a.json", {"x": 1})
        write_text_atomic(tmp_path / "b.txt", "y")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b.txt").stat().st_mode) == 0o644
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.txt"]


def test_special_files_and_symlinks_are_written_through_not_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    write_text_atomic(fifo, "through the pipe\n")
    assert reader.communicate(timeout=10)[0] == b"through the pipe\n"
    assert stat.S_ISFIFO(fifo.stat().st_mode), "the named pipe was replaced by a file"

    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_json_atomic(link, {"a": 1})
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text()) == {"a": 1}

    write_text_atomic(os.devnull, "discarded")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_non_utf8_plan_names_the_file(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_bytes(b"\xff\xfe{}")
    assert main(["plan", "show", str(bad)]) == 2
    assert f"{bad}: not a UTF-8 text file" in _error_line(capsys)


def test_export_refuses_what_validate_refuses_and_rejected_plans_unless_allowed(saved, capsys):
    plan = load_plan(saved / "plan.json")
    site_id = next(iter(plan.entries))
    bad = dataclasses.replace(plan.entries[site_id], config=CommConfig(n_channels=999))
    Plan(**{**_plan_fields(plan), "entries": {**plan.entries, site_id: bad}}).save(saved / "bad.json")
    assert main(["plan", "export", str(saved / "bad.json"), "--format", "nccl-tuner-csv"]) == 2
    err = _error_line(capsys)
    assert site_id in err and "999" in err, err

    plan.with_stats(verification="fell_back", verification_reason="gain below noise").save(saved / "rejected.json")
    assert main(["plan", "export", str(saved / "rejected.json"), "--format", "nccl-tuner-csv"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "rejected by its verification (gain below noise): not exported" in captured.err
    assert (
        main(
            [
                "plan",
                "export",
                str(saved / "rejected.json"),
                "--format",
                "nccl-tuner-csv",
                "--extended",
                "--allow-rejected",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "rejected by its verification (gain below noise)" in captured.err
    assert captured.out.strip(), "the table is still exported"


def _plan_fields(plan):
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--sizes", "abc"], "argument --sizes: 'abc' is not an integer in 1..100000"),
        (["--sizes", "0"], "argument --sizes: 0 is not an integer in 1..100000"),
        # a MemoryError traceback after the table's header before it had a bound
        (["--sizes", "100000000000"], "argument --sizes: 100000000000 is not an integer in 1..100000"),
        (["--instances", "-3"], "argument --instances: -3 is not an integer >= 1"),
        (["--seed", "-1"], "argument --seed: -1 is not an integer >= 0"),
        (
            ["--cluster", "nope"],
            f"cluster 'nope' is neither a file nor one of {available_clusters()} (see lagom bench search --help)",
        ),
        (
            ["--cluster", "cpu-gloo"],
            "cluster 'cpu-gloo' is a gloo cluster; NCCL rules need an NCCL cluster (see lagom bench search --help)",
        ),
    ],
)
def test_bench_search_bad_options_are_one_line_before_anything_runs(argv, expected, capsys):
    assert main(["bench", "search", *argv]) == 2
    err = _error_line(capsys)
    assert err.startswith("lagom bench search: error: ") and expected in err, err
    assert capsys.readouterr().out == ""  # no table started


def test_calibrate_names_a_missing_or_folder_csv_and_an_unwritable_out(tmp_path, capsys):
    assert main(["calibrate", "contention", str(tmp_path / "none.csv")]) == 2
    assert f"{tmp_path / 'none.csv'}: no such file" in _error_line(capsys)
    assert main(["calibrate", "contention", str(tmp_path)]) == 2
    assert f"{tmp_path}: is a folder; give a file" in _error_line(capsys)
    csv = tmp_path / "probe.csv"
    csv.write_text("gpu,sms\n")
    assert main(["calibrate", "contention", str(csv), "--out", str(tmp_path)]) == 2
    assert f"argument --out: {tmp_path}: is a folder; give a file name" in _error_line(capsys)


def test_an_output_naming_an_input_is_refused_and_the_input_kept(saved, tmp_path, capsys):
    plan, profile = saved / "plan.json", saved / "profile.json"
    link = tmp_path / "link.json"
    link.symlink_to(plan)
    before = {p: p.read_bytes() for p in (plan, profile)}
    for argv, expected in [
        (
            ["plan", "export", str(plan), "--format", "env", "-o", str(plan)],
            f"-o {plan} is the same file as plan {plan}",
        ),
        (
            ["plan", "export", str(plan), "--format", "env", "-o", str(link)],
            f"-o {link} is the same file as plan {plan}",
        ),
        (
            ["search", "--profile", str(profile), "-o", str(profile)],
            f"-o {profile} is the same file as --profile {profile}",
        ),
        (
            ["simulate", "--preset", "gpt3-13b-h100x64", "--plan-out", str(plan), "--profile-out", str(plan)],
            f"--plan-out {plan} is the same file as --profile-out {plan}",
        ),
    ]:
        assert main(argv) == 2, argv
        assert expected in _error_line(capsys)
    assert {p: p.read_bytes() for p in (plan, profile)} == before


def test_a_malformed_cluster_yaml_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "cluster.yaml"
    bad.write_text("name: [\n")
    for argv in (
        ["simulate", "--preset", "gpt3-13b-h100x64", "--cluster", str(bad)],
        ["doctor", "--preset", "gpt3-13b-h100x64", "--cluster", str(bad)],
    ):
        assert main(argv) == 2, argv
        err = _error_line(capsys)
        # the file and the line, not PyYAML's "<unicode string>"
        assert err.endswith(
            f"{bad}: malformed YAML at line 2 column 1: expected the node content, but found "
            "'<stream end>' (while parsing a flow node started at line 2 column 1)"
        ), err


def test_a_cluster_yaml_missing_keys_names_them_by_their_yaml_names(tmp_path, capsys):
    bad = tmp_path / "badcl.yaml"
    bad.write_text("name: bad\ngpu: [x,\n  y]\nbackend: gloo\n")
    assert main(["doctor", "--preset", "cpu-tp2-dp2", "--cluster", str(bad), "--", "--mock-data"]) == 2
    err = _error_line(capsys)
    assert err.endswith(
        f"{bad}: missing cluster key(s) sms_per_gpu, hbm_gbps, nvlink_gbps_per_gpu, gpus_per_node, "
        "net_gbps_per_gpu, peak_bf16_tflops, nccl_version, sm_arch, nvswitch; every cluster file sets "
        "name, gpu, sms_per_gpu, hbm_gbps, nvlink_gbps_per_gpu, gpus_per_node, net_gbps_per_gpu, "
        "peak_bf16_tflops, nccl_version, sm_arch, nvswitch"
    ), err
    assert "__init__" not in err


def test_a_folder_given_as_preset_model_or_cluster_says_so(tmp_path, capsys):
    from lagom_megatron.config.presets import load_model

    assert main(["doctor", "--preset", str(tmp_path)]) == 2
    assert _error_line(capsys).startswith(
        f"lagom doctor: error: preset {str(tmp_path)!r} is a folder; give a preset "
        "YAML file or one of: cpu-pp2-dp2, cpu-tp2-dp2, "
    )
    with pytest.raises(
        ValueError, match=f"^model '{tmp_path}' is a folder; give a model YAML file or one of: gpt3-1.3b, "
    ):
        load_model(tmp_path)
    from lagom_megatron.engine.cluster import ClusterSpec

    with pytest.raises(
        ValueError, match=f"^cluster '{tmp_path}' is a folder; give a cluster YAML file or one of: a100-ib100, "
    ):
        ClusterSpec.load(tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--presets", "cpu-tp2-dp2"], "preset 'cpu-tp2-dp2' on cluster 'cpu-gloo': the simulator models GPU clusters"),
        # a GPU preset on the CPU cluster: the cluster is the CPU one, not the preset
        (
            ["--presets", "llama3-8b-h100x8", "--clusters", "cpu-gloo"],
            "lagom bench simulated: error: cluster 'cpu-gloo' is a CPU (gloo) cluster; the simulator models GPU clusters: "
            "a100-ib100, a40-nvlink-ib800, a40-pcie-ib100, a40-pcie-ib200, h100-sxm-ib400, h200-sxm "
            "(see lagom bench simulated --help)",
        ),
        (
            ["--iters", "0"],
            "lagom bench simulated: error: argument --iters: 0 is not an integer >= 1 "
            "(see lagom bench simulated --help)",
        ),
        (
            ["--verify-iters", "0"],
            "lagom bench simulated: error: argument --verify-iters: 0 is not an integer >= 1 "
            "(see lagom bench simulated --help)",
        ),
        (
            ["--microbatches", "x"],
            "lagom bench simulated: error: --microbatches must be 'preset' or an integer >= 1; "
            "got 'x' (see lagom bench simulated --help)",
        ),
    ],
)
def test_bench_simulated_usage_errors_are_one_line(capsys, args, message):
    """`lagom bench simulated` refuses bad options the way every lagom command does: one
    `lagom bench simulated: error: ...` line on stderr, no usage block, exit 2, nothing run."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "simulated", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lagom bench simulated: error: ") and message in err[0], err


def test_bench_simulated_out_that_is_a_file_is_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    for out, message in (
        (afile, f"--out {str(afile)!r} is a file; give a folder"),
        (afile / "sub", f"--out {afile} is a file, not a folder, so {afile / 'sub'} cannot be created"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "simulated", "--presets", "llama3-8b-h100x8", "--out", str(out)])
        assert exc.value.code == 2
        assert capsys.readouterr().err == (
            f"lagom bench simulated: error: {message} (see lagom bench simulated --help)\n"
        )
    assert afile.read_text() == "mine\n"


def test_an_existing_file_that_is_not_lagom_s_output_of_the_kind_is_kept_unless_force(saved, tmp_path, capsys):
    """`lagom search -o ../precious.json` replaced a user's file: every command writing a file keeps
    one that is not its own kind of output unless --force, and replaces its own output."""
    profile, plan = saved / "profile.json", saved / "plan.json"
    precious = tmp_path / "precious.json"
    cases = [
        (["search", "--profile", str(profile), "-o", str(precious)], "lagom search", "-o", "a lagom plan"),
        (
            ["plan", "export", str(plan), "--format", "env", "-o", str(precious)],
            "lagom plan",
            "-o",
            "a lagom env export",
        ),
        (
            ["simulate", "--preset", "llama3-8b-h100x8", "--show", "0", "--plan-out", str(precious)],
            "lagom simulate",
            "--plan-out",
            "a lagom plan",
        ),
        (
            ["simulate", "--preset", "llama3-8b-h100x8", "--show", "0", "--profile-out", str(precious)],
            "lagom simulate",
            "--profile-out",
            "a lagom profile",
        ),
    ]
    for argv, prog, flag, what in cases:
        precious.write_text('{"my": "notes"}\n')
        assert main(argv) == 2, argv
        assert _error_line(capsys) == (
            f"{prog}: error: {flag} {precious}: exists and is not {what}; pass --force to "
            "replace it, or give another file name"
        )
        assert precious.read_text() == '{"my": "notes"}\n'
    assert main(cases[0][0] + ["--force"]) == 0
    assert load_plan(precious).entries
    capsys.readouterr()
    assert main(cases[0][0]) == 0  # a plan: search replaces it
    assert main(["plan", "export", str(plan), "--format", "env", "-o", str(precious)]) == 2  # a plan is no env file
    assert "exists and is not a lagom env export" in _error_line(capsys)
    env = tmp_path / "plan.env"
    assert main(["plan", "export", str(plan), "--format", "env", "-o", str(env)]) == 0
    assert main(["plan", "export", str(plan), "--format", "env", "-o", str(env)]) == 0  # its own export again
    table = tmp_path / "plan.csv"
    assert main(["plan", "export", str(plan), "--format", "nccl-tuner-csv", "--extended", "-o", str(table)]) == 0
    assert main(["plan", "export", str(plan), "--format", "nccl-tuner-csv", "--extended", "-o", str(table)]) == 0
    assert main(["plan", "export", str(plan), "--format", "megatron-yaml", "-o", str(table)]) == 2
    assert "exists and is not a lagom megatron-yaml export" in _error_line(capsys)


def test_calibrate_contention_keeps_a_file_it_did_not_write(tmp_path, capsys):
    from tests.sim.test_calibrate import _synthetic

    src = tmp_path / "probe.csv"
    _synthetic(src, kappa_mem=1.5, kappa_compute=0.9)
    fit = tmp_path / "probe.fit.yaml"
    fit.write_text("mine: 1\n")
    assert main(["calibrate", "contention", str(src)]) == 2
    assert _error_line(capsys) == (
        f"lagom calibrate: error: output {fit}: exists and is not a lagom contention fit; "
        "pass --force to replace it, or give another file name"
    )
    assert main(["calibrate", "contention", str(src), "--force"]) == 0
    assert main(["calibrate", "contention", str(src)]) == 0  # its own fit: replaced
    assert main(["calibrate", "contention", str(src), "--out", str(src)]) == 2
    assert _error_line(capsys).endswith(
        f"--out {src} is the same file as csv {src}: one would replace the other; give another file name"
    )


def test_simulate_verify_max_iters_below_verify_iters_is_usage_exit_2(tmp_path, capsys):
    plan_out = tmp_path / "plan.json"
    argv = ["simulate", "--preset", "gpt3-13b-h100x64", "--verify-iters", "50", "--verify-max-iters", "10"]
    assert main([*argv, "--plan-out", str(plan_out)]) == 2
    line = _error_line(capsys)
    assert line.startswith("lagom simulate: error: --verify-max-iters:"), line
    assert "10 is below verify_iters 50" in line and "allowed: 50 or more" in line, line
    assert not plan_out.exists()
