"""One writer per output folder, whatever names it: the default ``lagom_out/<preset>/``, another plan
name in the same folder, a symlink to it, or a report folder (``preflight.files``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from lagom_megatron.megatron.outputs.run_files import RunFiles
from lagom_megatron.preflight.files import LOCK_NAME, folder_in_use, hold_run_locks, release_folder_lock, run_folders
from tests.training.preflight_harness import doctor, hold_lock_elsewhere, train

CPU = ["--preset", "cpu-tp2-dp2", "--mock-data"]


@pytest.fixture
def other():
    """Another run holding a folder's lock until the test ends (it holds its plan's folder)."""
    procs = []
    yield lambda folder: procs.append(hold_lock_elsewhere(folder / "plan.json")) or procs[-1]
    for p in procs:
        p.kill()
        p.wait()


def test_the_default_folder_is_locked_too(tmp_path, monkeypatch, capsys, other):
    monkeypatch.chdir(tmp_path)
    holder = other(tmp_path / "lagom_out" / "cpu-tp2-dp2")
    t = train([*CPU, "--lagom"], monkeypatch, capsys)
    assert (t.code, t.started) == (2, False)
    (line,) = t.errors
    assert line.startswith(
        "pretrain_gpt.py: error: --lagom-plan 'lagom_out/cpu-tp2-dp2/plan.json (the default, "
        f"without --lagom-plan)' is in use by another run (pid {holder.pid} on host "
        f"{socket.gethostname()}, job 4242, since "
    )
    assert line.endswith(
        "one run writes a folder at a time (lagom_out/cpu-tp2-dp2): wait for it, or give this run another --lagom-plan"
    )


def test_a_run_holds_the_default_folder_against_a_second(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    held = hold_run_locks({"lagom": True, "preset_name": "cpu-tp2-dp2"})
    try:
        assert held == [tmp_path / "lagom_out" / "cpu-tp2-dp2" / LOCK_NAME]
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "from lagom_megatron.preflight.files import "
                "folder_in_use; print(folder_in_use('lagom_out/cpu-tp2-dp2'))",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        assert probe.stdout.startswith(f"pid {os.getpid()} on host ")
    finally:
        release_folder_lock(tmp_path / "lagom_out" / "cpu-tp2-dp2")
    assert folder_in_use(tmp_path / "lagom_out" / "cpu-tp2-dp2") is None


@pytest.mark.parametrize("name", ["another plan name", "a symlink to the folder", "the report's folder"])
def test_every_name_of_a_folder_in_use_is_refused(name, tmp_path, monkeypatch, capsys, other):
    busy = tmp_path / "busy"
    busy.mkdir()
    other(busy)
    if name == "another plan name":
        extra = ["--lagom-plan", str(busy / "other-plan.json")]
    elif name == "a symlink to the folder":
        (tmp_path / "link").symlink_to(busy)
        extra = ["--lagom-plan", str(tmp_path / "link" / "plan.json")]
    else:
        extra = ["--lagom-plan", str(tmp_path / "free" / "plan.json"), "--lagom-report", str(busy / "r.md")]
    t = train([*CPU, "--lagom", *extra], monkeypatch, capsys)
    assert (t.code, t.started) == (2, False) and len(t.errors) == 1
    assert "is in use by another run (pid " in t.errors[0]
    assert (f", that is {busy})" if name == "a symlink to the folder" else f"({busy})") in t.errors[0]
    assert not (tmp_path / "free").exists()  # nothing taken or created for a refused run


def test_a_report_folder_in_use_names_the_report_flag(tmp_path, monkeypatch, capsys, other):
    busy = tmp_path / "busy"
    busy.mkdir()
    other(busy)
    report = str(busy / "r.md")
    t = train(
        [*CPU, "--lagom", "--lagom-plan", str(tmp_path / "free" / "plan.json"), "--lagom-report", report],
        monkeypatch,
        capsys,
    )
    (line,) = t.errors
    assert line.startswith(f"pretrain_gpt.py: error: --lagom-report {report!r} is in use by another run (pid ")
    assert line.endswith(f"({busy}): wait for it, or give this run another --lagom-report")


def test_the_folders_of_a_run():
    args = {"lagom": True, "preset_name": "cpu-pp2-dp2", "lagom_report": "lagom_out/cpu-pp2-dp2/r.md"}
    assert [(f, str(p)) for f, _, p in run_folders(args)] == [("--lagom-plan", "lagom_out/cpu-pp2-dp2")]
    args["lagom_report"] = "/elsewhere/r.md"
    assert [str(p) for _, _, p in run_folders(args)] == ["lagom_out/cpu-pp2-dp2", "/elsewhere"]
    assert run_folders({"preset_name": "cpu-pp2-dp2"}) == []  # without --lagom nothing is written


def test_a_report_named_as_the_plan_is_refused_before_any_rank(tmp_path, monkeypatch, capsys):
    plan = str(tmp_path / "rc" / "plan.json")
    line = (
        f"--lagom-report {plan!r} is the same file as --lagom-plan {plan!r}: one would replace the other; "
        "give --lagom-report another file name"
    )
    t = train([*CPU, "--lagom", "--lagom-plan", plan, "--lagom-report", plan], monkeypatch, capsys)
    assert (t.code, t.started, t.errors) == (2, False, [f"pretrain_gpt.py: error: {line}"])
    d = doctor([*CPU, "--lagom", "--lagom-plan", plan, "--lagom-report", plan], monkeypatch, capsys)
    assert d.code != 0 and line in d.errors  # the doctor's verdict on the same line
    assert not (tmp_path / "rc").exists()


@pytest.mark.parametrize(
    "flag, name, other",
    [
        ("--lagom-plan", "profile.json", "lagom's profile {p} (lagom writes it in the plan's folder)"),
        ("--lagom-plan", "report.md", "the default report {p} (without --lagom-report)"),
        ("--lagom-plan", "report.png", "the report's figure {p} (lagom writes it beside the report)"),
        ("--lagom-plan", "plan.env", "the plan's env file {p} (lagom writes it beside the plan)"),
        ("--lagom-report", "profile.json", "lagom's profile {p} (lagom writes it in the plan's folder)"),
        ("--lagom-report", "plan.env.json", None),  # a name of its own: passes
    ],
)
def test_a_name_of_lagoms_own_files_is_refused(flag, name, other, tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "pp" / name)
    extra = [flag, path] if flag == "--lagom-plan" else ["--lagom-plan", str(tmp_path / "pp" / "plan.json"), flag, path]
    t = train([*CPU, "--lagom", *extra], monkeypatch, capsys)
    if other is None:
        assert (t.code, t.started, t.errors) == (0, True, [])
        return
    want = (
        f"pretrain_gpt.py: error: {flag} {path!r} is the same file as {other.format(p=repr(path))}: one would "
        f"replace the other; give {flag} another file name"
    )
    assert (t.code, t.started, t.errors) == (2, False, [want])


@pytest.mark.parametrize(
    "name, what",
    [
        (
            "tuner_table.rank0.csv",
            "the name of a tuner table lagom writes in the plan's folder (tuner_table.rank<r>.csv)",
        ),
        (
            "report.reused-1.md",
            "the name of a report lagom writes for a run that does not tune "
            "(report.<reused|unfinished|interrupted>-<n>.md)",
        ),
        (LOCK_NAME, "the name of the lock file a run keeps in each folder it writes"),
    ],
)
def test_a_plan_named_as_a_numbered_output_or_the_lock_is_refused(name, what, tmp_path, monkeypatch, capsys):
    path = str(tmp_path / name)
    t = train([*CPU, "--lagom", "--lagom-plan", path], monkeypatch, capsys)
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        f"pretrain_gpt.py: error: --lagom-plan {path!r} is {what}: "
        + (
            "give --lagom-plan another file name"
            if name == LOCK_NAME
            else "one would replace the other; give --lagom-plan another file name"
        )
    ]


def test_a_symlink_to_the_plan_is_the_same_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "alias.md").symlink_to(tmp_path / "plan.json")
    files = RunFiles(plan_path=str(tmp_path / "plan.json"), report_path=str(tmp_path / "alias.md"))
    assert files.name_clash().startswith(
        f"--lagom-report {str(tmp_path / 'alias.md')!r} is the same file as "
        f"--lagom-plan {str(tmp_path / 'plan.json')!r}"
    )
    assert RunFiles(plan_path=str(tmp_path / "plan.json"), report_path=str(tmp_path / "r.md")).name_clash() is None
