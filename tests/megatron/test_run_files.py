"""A plan this run cannot reuse is moved aside with every file that belongs to it (``run_files.RunFiles``):
same tag, original bytes, nothing replaced, every file named in the log line, and nothing written over
a plan that could not be moved."""

from __future__ import annotations

import errno
import os

import pytest

from lagom_megatron.config.plan_files import load_plan
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.engine.profile import Profile
from lagom_megatron.megatron.control.controller import LagomController
from lagom_megatron.megatron.outputs import run_files
from lagom_megatron.megatron.outputs.run_files import RunFiles, rename_no_replace

SITE = "dp.grad_reduce_scatter[chunk0.bucket0]"
FP_PP2 = {
    "pipeline_model_parallel_size": 2,
    "tensor_model_parallel_size": 1,
    "world_size": 4,
    "backend": "gloo",
    "cluster": "cpu-gloo",
}
FP_TP2 = dict(FP_PP2, pipeline_model_parallel_size=1, tensor_model_parallel_size=2)


def _plan(fingerprint, n_channels=1, env=None):
    entry = PlanEntry(
        config=CommConfig(n_channels=n_channels),
        predicted_t_comm_us=10.0,
        predicted_t_region_us=12.0,
        group="dp",
        op="reduce_scatter",
        nbytes=4096,
        group_size=2,
    )
    return Plan(entries={SITE: entry}, fingerprint=fingerprint, backend="gloo", mechanism="gloo", env=env or {})


def _pp2_run_dir(folder, plan):
    """The files a pp2 run left in its folder; returns name -> bytes."""
    from lagom_megatron.nccl.env_file import write_plan_env_file

    plan.save(folder / "plan.json")
    write_plan_env_file(folder / "plan.json", {"NCCL_NTHREADS": 256})
    contents = {
        "profile.json": b'{"sites": "pp2 profile"}\n',
        "report.md": b"# lagom report: applied (pp2)\n",
        "report.png": b"\x89PNG pp2 figure",
        "report.reused-1.md": b"# lagom report: reused (pp2)\n",
        "report.reused-1.png": b"\x89PNG pp2 reused figure",
        "tuner_table.rank0.csv": b"pp2,table,0\n",
        "tuner_table.rank3.csv": b"pp2,table,3\n",
    }
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _aside(name, tag):
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.{tag}.{suffix}"


def test_another_runs_plan_is_moved_aside_with_its_profile_report_env_and_tables(tmp_path, capsys):
    pp2 = _plan(FP_PP2)
    before = _pp2_run_dir(tmp_path, pp2)
    (tmp_path / "report.unfinished-1.md").write_bytes(b"no plan's report")  # tied to no plan: stays
    (tmp_path / "report.reused-1.abc.md").write_bytes(b"moved earlier")  # not a reused report's name
    files = RunFiles(plan_path=str(tmp_path / "plan.json"))
    assert files.saved_plan(FP_TP2) is None
    tag = pp2.digest()[:12]
    for name, data in before.items():
        assert not (tmp_path / name).exists(), name
        assert (tmp_path / _aside(name, tag)).read_bytes() == data, name
    assert len(before) == 9  # plan, env, profile, two reports, two figures, two tables
    assert (tmp_path / "report.unfinished-1.md").read_bytes() == b"no plan's report"
    assert (tmp_path / "report.reused-1.abc.md").read_bytes() == b"moved earlier"
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "fingerprint differs" in ln]
    expected = ", ".join(
        str(tmp_path / _aside(n, tag))
        for n in (
            "plan.env",
            "profile.json",
            "report.md",
            "report.png",
            "report.reused-1.md",
            "report.reused-1.png",
            "tuner_table.rank0.csv",
            "tuner_table.rank3.csv",
        )
    )
    assert line.endswith(f"(the other plan is kept as {tmp_path / f'plan.{tag}.json'} with {expected})"), line
    # the tp2 run now writes its own files; the pp2 run's stay as they were
    tp2 = _plan(FP_TP2, n_channels=2)
    files.save_plan(tp2)
    files.save_profile(Profile(backend="gloo", cluster="cpu-gloo", iteration_us=1000.0, sites=[], samples=[]))
    assert load_plan(tmp_path / "plan.json").digest() == tp2.digest()
    assert load_plan(tmp_path / f"plan.{tag}.json").digest() == pp2.digest()
    assert (tmp_path / f"profile.{tag}.json").read_bytes() == before["profile.json"]
    assert (tmp_path / "profile.json").read_bytes() != before["profile.json"]


def test_a_name_taken_by_an_earlier_move_is_not_replaced(tmp_path, capsys):
    pp2 = _plan(FP_PP2)
    before = _pp2_run_dir(tmp_path, pp2)
    tag = pp2.digest()[:12]
    (tmp_path / f"profile.{tag}.json").write_bytes(b"moved aside by an earlier run")
    assert RunFiles(plan_path=str(tmp_path / "plan.json")).saved_plan(FP_TP2) is None
    assert (tmp_path / f"profile.{tag}.json").read_bytes() == b"moved aside by an earlier run"
    for name, data in before.items():  # the whole set under one free tag
        assert (tmp_path / _aside(name, f"{tag}-2")).read_bytes() == data, name
    assert f"kept as {tmp_path / f'plan.{tag}-2.json'} with " in capsys.readouterr().out


def test_an_invalid_plan_takes_its_env_file_and_profile_along(tmp_path, capsys):
    bad = _plan({"cluster": "cpu-gloo"}, n_channels=999)  # gloo allows 1..16 worker threads
    before = _pp2_run_dir(tmp_path, bad)
    files = RunFiles(plan_path=str(tmp_path / "plan.json"))
    assert files.saved_plan({"cluster": "cpu-gloo"}, ClusterSpec.load("cpu-gloo")) is None
    tag = "invalid-" + bad.digest()[:12]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(_aside(n, tag) for n in before)
    assert (tmp_path / f"plan.{tag}.env").read_bytes() == before["plan.env"]
    assert b"export NCCL_NTHREADS=256" in before["plan.env"]
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "cannot reuse plan" in ln]
    assert (
        f"kept as {tmp_path / f'plan.{tag}.json'} with {tmp_path / f'plan.{tag}.env'}, "
        f"{tmp_path / f'profile.{tag}.json'}, {tmp_path / f'report.{tag}.md'}," in line
    ), line
    # the next plan's env file does not meet the invalid plan's
    files.save_plan(_plan({"cluster": "cpu-gloo"}))
    assert "NCCL_NTHREADS" not in (tmp_path / "plan.env").read_text()


def test_a_plan_that_cannot_be_moved_keeps_all_its_files_and_gets_none_written_over(tmp_path, capsys, monkeypatch):
    pp2 = _plan(FP_PP2)
    before = _pp2_run_dir(tmp_path, pp2)
    real = run_files.rename_no_replace

    def refuse_the_profile(src, dst):
        if src.name == "profile.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        real(src, dst)

    monkeypatch.setattr(run_files, "rename_no_replace", refuse_the_profile)
    files = RunFiles(plan_path=str(tmp_path / "plan.json"))
    assert files.saved_plan(FP_TP2) is None
    # plan.json and plan.env were moved first, then moved back: all or nothing
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert files.keep_user_file
    assert [
        files.may_write(tmp_path / n)
        for n in ("plan.json", "plan.env", "profile.json", "report.md", "report.png", "report.reused-1.md")
    ] == [False] * 6
    files.save_plan(_plan(FP_TP2, n_channels=2))
    files.save_profile(Profile(backend="gloo", cluster="cpu-gloo", iteration_us=1000.0, sites=[], samples=[]))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    ctl = LagomController(plan_path=str(tmp_path / "plan.json"))
    ctl.files, ctl.mode = files, "tune"  # a tuning run's report would go to report.md
    ctl.write_report()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    out = capsys.readouterr().out
    assert f"lagom: WARNING: report not written: {tmp_path / 'report.md'} belongs to plan" in out
    assert "it stays, and this run saves no plan, profile or report over it" in out
    assert f"lagom: WARNING: profile not saved: {tmp_path / 'profile.json'} belongs to plan" in out


def test_rename_no_replace_never_replaces(tmp_path, monkeypatch):
    src, dst = tmp_path / "a.json", tmp_path / "b.json"
    src.write_bytes(b"a")
    dst.write_bytes(b"b")
    with pytest.raises(FileExistsError):
        rename_no_replace(src, dst)
    assert (src.read_bytes(), dst.read_bytes()) == (b"a", b"b")

    # a file system without hard links: renamed after the check, still never over a file
    def no_links(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(FileExistsError):
        rename_no_replace(src, dst)
    assert (src.read_bytes(), dst.read_bytes()) == (b"a", b"b")
    rename_no_replace(src, tmp_path / "c.json")
    assert not src.exists() and (tmp_path / "c.json").read_bytes() == b"a"


def test_the_report_is_written_where_no_unmovable_plan_holds_it(tmp_path, capsys):
    ctl = LagomController(plan_path=str(tmp_path / "plan.json"))
    ctl.mode = "tune"
    ctl.write_report()
    assert (tmp_path / "report.md").read_text().startswith("# lagom report: tune")


def test_without_a_plan_the_files_there_are_moved_aside_before_any_is_written(tmp_path, capsys):
    mine = {
        "report.md": b"# my own notes\n",
        "report.png": b"\x89PNG mine",
        "profile.json": b'{"mine": 1}\n',
        "plan.env": b"export MINE=1\n",
        "notes.txt": b"not lagom's name: stays\n",
    }
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
    tag = "earlier-" + run_files._file_sha(tmp_path / "plan.env")  # the first of plan_files' order
    files = RunFiles(plan_path=str(tmp_path / "plan.json"))
    assert files.saved_plan(FP_TP2) is None
    for name, data in mine.items():
        kept = tmp_path / (name if name == "notes.txt" else _aside(name, tag))
        assert kept.read_bytes() == data, name
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "no plan at" in ln]
    assert line == (
        f"lagom: WARNING: no plan at {tmp_path / 'plan.json'}, but this run would write over 4 file(s) "
        f"there: moved aside as {tmp_path / f'plan.{tag}.env'}, {tmp_path / f'profile.{tag}.json'}, "
        f"{tmp_path / f'report.{tag}.md'}, {tmp_path / f'report.{tag}.png'}; searching a new plan"
    )
    files.save_plan(_plan(FP_TP2))  # this run's files now take the free names
    assert (tmp_path / "plan.json").is_file() and b"MINE" not in (tmp_path / "plan.env").read_bytes()


def test_without_a_plan_files_that_cannot_be_moved_stay_and_are_not_written(tmp_path, capsys, monkeypatch):
    (tmp_path / "report.md").write_bytes(b"# my own notes\n")
    (tmp_path / "plan.env").write_bytes(b"export MINE=1\n")
    real = run_files.rename_no_replace

    def refuse_the_report(src, dst):
        if src.name == "report.md":
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        real(src, dst)

    monkeypatch.setattr(run_files, "rename_no_replace", refuse_the_report)
    files = RunFiles(plan_path=str(tmp_path / "plan.json"))
    assert files.saved_plan(FP_TP2) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.env", "report.md"]  # plan.env was moved back
    assert "could not be moved aside: they stay, and this run writes none of them" in capsys.readouterr().out
    files.save_plan(_plan(FP_TP2))  # the plan had no file: it is saved; the env file beside it is not
    assert (tmp_path / "plan.json").is_file()
    assert (tmp_path / "plan.env").read_bytes() == b"export MINE=1\n"
    ctl = LagomController(plan_path=str(tmp_path / "plan.json"))
    ctl.files, ctl.mode = files, "tune"
    ctl.write_report()
    assert (tmp_path / "report.md").read_bytes() == b"# my own notes\n"
