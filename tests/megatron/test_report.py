"""The report's numbers: iteration-level verdict figures, per-site columns that add up to the
iteration, tuned = changed, the real default, one file per non-tuning run."""

import math
import re

import pytest

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import PlanEntry
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.engine.verify import verdict
from lagom_megatron.megatron.outputs.report import (
    column_totals,
    default_config_text,
    is_tuned,
    render_markdown,
    report_path_for,
    site_rows,
    verdict_summary,
    write_report,
)


def _entry(cfg, pred, pred_default, op="all_gather", group="tp"):
    return PlanEntry(
        config=cfg,
        predicted_t_comm_us=1.0,
        predicted_t_region_us=pred,
        predicted_default_t_region_us=pred_default,
        group=group,
        op=op,
        nbytes=131072,
    )


def _fixture():
    entries = {
        "tp.sp_all_gather[0]": _entry(CommConfig(n_channels=1), 1000.0, 1000.0),
        "dp.grad_all_reduce[b0]": _entry(CommConfig(n_channels=2), 5000.0, 6000.0, "all_reduce", "dp"),
    }
    sites = {
        "tp.sp_all_gather[0]": CollectiveSite(
            site_id="tp.sp_all_gather[0]",
            op="all_gather",
            nbytes=131072,
            dtype="float32",
            group="tp",
            group_size=2,
            calls_per_iter=2,
        )
    }
    rows = site_rows(
        entries,
        sites,
        {"tp.sp_all_gather[0]": [1100, 1200, 1300], "dp.grad_all_reduce[b0]": [7000, 7100]},
        {"tp.sp_all_gather[0]": [1000, 1050], "dp.grad_all_reduce[b0]": [6500]},
        backend="gloo",
    )
    vd, vp = [300e3, 310e3, 320e3], [290e3, 305e3]
    v = verdict(vp, vd, min_gain=0.01, noise_rule="half-range")
    summary = dict(
        phase="fell_back",
        reason=v.text,
        run_kind="tuned",
        method="priority",
        backend="gloo",
        cluster="cpu-gloo",
        verify_default_us=vd,
        verify_plan_us=vp,
        measured_default_us=v.default_us,
        measured_plan_us=v.plan_us,
        predicted_iteration_us=299e3,
        predicted_default_iteration_us=300e3,
        default_iteration_us=350e3,
        **verdict_summary(vp, vd, min_gain=0.01, noise_rule="half-range"),
    )
    assert (summary["spread_default_us"], summary["spread_plan_us"], summary["needed_us"]) == (10e3, 7.5e3, v.needed_us)
    return rows, summary


def test_gloo_default_is_two_threads_and_only_changes_count_as_tuned():
    assert default_config_text("gloo").startswith("n_channels=2")
    assert default_config_text("nccl") == "NCCL's choice"
    assert not is_tuned({"n_channels": 2}, "gloo") and is_tuned({"n_channels": 1}, "gloo")
    assert is_tuned({"n_channels": 2}, "nccl") and not is_tuned({}, "nccl")
    assert is_tuned({"n_channels": 2, "chunk_size": 1048576}, "gloo")


def test_markdown_columns_add_up_to_the_verdict_medians(tmp_path):
    rows, summary = _fixture()
    path = tmp_path / "report.md"
    written = write_report(path, rows, summary)
    assert written == [path, tmp_path / "report.png"] and written[1].stat().st_size > 5000
    text = path.read_text()
    # the verdict kept the defaults: nothing ran tuned; n_channels=2 on gloo is the default, not a change
    assert (
        "- sites tuned: 0 of 2 (the defaults were kept: n_channels=2 (gloo worker threads), no split); the plan "
        "would change 1 (0 with a predicted gain), tuned 'not applied' below"
    ) in text
    # the half-range rule: max(half range 10 ms, 1% of 310 ms); the figures are the verdict line's own
    assert (
        "- gain (defaults - plan): 12.5 ms (median of the defaults 310.0 ms - median of the plan 297.5 ms, 3 and "
        "2 iterations), needed > 10.0 ms (the larger of half the wider arm's range 10.0 ms and the minimum gain "
        "3.1 ms)\n"
    ) in text
    assert (
        "- rule: half-range: the plan is kept when the medians' difference is more than the larger of half the "
        "wider arm's range (max - min: 10.0 ms) and the minimum gain (1.0% of the defaults' median: 3.1 ms)\n" in text
    )
    assert "| measured median (3 / 2 iterations" in text and "| 310.0 | 297.5 |" in text
    table = {}
    for line in text.splitlines():
        m = re.match(r"\| \*\*(.+?)\*\* \|", line)
        if m:
            table[m.group(1)] = [float(x) for x in line.strip("| ").split(" | ")[-4:]]
    sums, rest, it = table["sum of the sites"], table["rest of the iteration"], table["iteration"]
    assert it == [310.0, 297.5, 300.0, 299.0]
    assert sums == [8.25, 7.53, 7.0, 6.0]  # medians 1.2 + 7.05, 1.025 + 6.5, ...
    for s, r, i in zip(sums, rest, it):
        assert math.isclose(s + r, i, abs_tol=0.011)
    # the tuned column agrees with the header: the defaults ran, so no row says yes
    assert (
        "| tp.sp_all_gather[0] | all_gather | tp | 128.0 KiB | 2 | n_channels=2 (gloo worker threads), no split | n_channels=1 | not applied | 1.20 | 1.02 |"
        in text
    )
    assert "| yes |" not in text
    # predicted iteration = default iteration - sum(default regions) + sum(plan regions) (engine/problem.py)
    t = column_totals(rows, summary)
    assert math.isclose(t["predicted_default"][1], t["predicted_plan"][1])


def test_an_applied_plan_counts_its_changed_sites(tmp_path):
    rows, summary = _fixture()
    summary["phase"] = "applied"
    write_report(tmp_path / "r.md", rows, summary, figure=False)
    text = (tmp_path / "r.md").read_text()
    assert "- sites tuned: 1 of 2 (config differs from the default: n_channels=2" in text
    assert text.count(" | yes | ") == 1 and "not applied" not in text  # the header's 1 is the column's one yes


@pytest.mark.parametrize(
    "phase, tuned", [("applied", ["no", "yes"]), ("fell_back", ["no", "not applied"])]
)  # rows by site id: dp, tp
def test_csv_and_json_tuned_columns_follow_the_verdict(tmp_path, phase, tuned):
    import csv
    import json

    rows, summary = _fixture()
    summary["phase"] = phase
    write_report(tmp_path / "r.csv", rows, summary, figure=False)
    write_report(tmp_path / "r.json", rows, summary, figure=False)
    with open(tmp_path / "r.csv") as f:
        assert [r["tuned"] for r in csv.DictReader(f)] == tuned
    assert [r["tuned"] for r in json.loads((tmp_path / "r.json").read_text())["rows"]] == tuned


def test_runs_without_a_verification_never_replace_the_tuned_report(tmp_path):
    path = tmp_path / "report.md"
    assert report_path_for(path, "tuned") == path
    first = report_path_for(path, "reused")
    assert first == tmp_path / "report.reused-1.md"
    first.write_text("x")
    assert report_path_for(path, "reused") == tmp_path / "report.reused-2.md"
    assert report_path_for(path, "interrupted") == tmp_path / "report.interrupted-1.md"


def test_a_run_without_files_says_so(tmp_path):
    rows, summary = _fixture()
    summary.update(
        plan_path=None,
        profile_path=None,
        run_kind="unfinished",
        reason="--train-iters 8 ended while lagom was probing: tuning needs 18 iterations; defaults kept",
    )
    write_report(tmp_path / "r.md", rows, summary, figure=False)
    text = (tmp_path / "r.md").read_text()
    assert "- plan: none written by this run" in text and "- profile: none written by this run" in text
    assert "tuning needs 18 iterations" in text


def test_the_report_explains_the_paired_verdict_it_shows():
    """The verdict the tuner uses by default (paired differences, 95% bound): the report quotes its
    figures and names its rule, not the half-range rule it replaced."""
    vd = [300e3, 302e3, 299e3, 301e3, 300e3, 303e3, 298e3, 300e3]
    vp = [297e3, 300e3, 299e3, 296e3, 297e3, 301e3, 294e3, 298e3]  # differences 3, 2, 0, 5, 3, 2, 4, 2 ms
    v = verdict(vp, vd, min_gain=0.002, noise_rule="paired")
    s = verdict_summary(vp, vd, min_gain=0.002, noise_rule="paired")
    # mean 2.625 ms; sd 1.5059 ms; bound t(0.95, 7) x sd / sqrt(8) = 1.895 x 1.5059 / 2.828 = 1.009 ms > 0.2% of 300 ms
    assert math.isclose(s["gain_us"], 2625.0) and math.isclose(s["needed_us"], 1008.956, rel_tol=1e-6)
    assert (s["needed_us"], s["verdict"]) == (v.needed_us, "plan kept: " + v.text)
    text = render_markdown([], dict(phase="applied", **s))
    assert (
        "- gain (defaults - plan): 2.6 ms (mean of 8 paired differences, defaults - plan), needed > 1.0 ms (the "
        "larger of its 95% bound 1.0 ms and the minimum gain 0.6 ms)\n"
    ) in text
    # one statistic and its bound: the verdict line holds no median (they are the table's, labelled)
    assert v.text == (
        "gain 2.6 ms (mean of 8 paired differences, defaults - plan), needed > 1.0 ms (the larger of "
        "its 95% bound 1.0 ms and the minimum gain 0.6 ms)"
    )
    assert "median" not in v.text and "median" not in s["verdict"]
    assert (
        "- rule: paired: the k-th default and the k-th plan iteration form a pair; the plan is kept when the mean "
        "of the 8 paired differences is more than the larger of its one-sided 95% Student-t bound "
        "(t(0.95, 7) x sd / sqrt(8), t = 1.895) and the minimum gain (0.2% of the defaults' median: 0.6 ms)\n" in text
    )
    assert "the larger of the spread and the minimum gain" not in text


def test_the_report_names_the_level_of_a_sequential_verdict():
    """With four looks (``--lagom-verify-max-iters`` 8 x the first) the bound is at 1 - 0.05/4: the
    report recomputes it at that level, as the tuner's verdict did, and says so."""
    vd = [300e3, 302e3, 299e3, 301e3, 300e3, 303e3, 298e3, 300e3]
    vp = [297e3, 300e3, 299e3, 296e3, 297e3, 301e3, 294e3, 298e3]
    s = verdict_summary(vp, vd, min_gain=0.002, noise_rule="paired", n_looks=4)
    # t(0.9875, 7) = 2.841 (t table: 2.841); bound 2.841 x 1.5059 / 2.828 = 1.513 ms
    assert math.isclose(s["needed_us"], 1512.6, rel_tol=2e-3) and s["verdict"].startswith("plan kept: ")
    assert "98.75% (95% over 4 looks) bound 1.5 ms" in s["verdict"]
    assert s["verdict_rule"].startswith("paired, sequential over 4 looks:")
    assert "t(0.9875, 7) x sd / sqrt(8), t = 2.84" in s["verdict_rule"]


def test_one_pair_falls_back_to_half_range_as_the_verdict_does():
    s = verdict_summary([290e3], [300e3], min_gain=0.002, noise_rule="paired")
    assert s["noise_rule"] == "half-range" and "95% bound" not in s["verdict"]
    # no range with one value: the minimum gain decides; the statistic is the medians' difference, so both are named
    assert s["verdict_figures"] == (
        "10.0 ms (median of the defaults 300.0 ms - median of the plan 290.0 ms, 1 and 1 "
        "iterations), needed > 0.6 ms (the minimum gain 0.6 ms; one iteration per arm gives "
        "no noise estimate: it alone decided)"
    )
    assert s["verdict_rule"].startswith("half-range: the plan is kept when the medians' difference")
    assert "no verification in this run" in render_markdown([], {"phase": "reused"})


def test_every_text_of_the_figure_fits_its_canvas():
    """The reused plan's subtitle (its reason, a long line) was cut off at both edges of the PNG."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from lagom_megatron.megatron.outputs.figure import report_figure

    rows, summary = _fixture()
    long = (
        "plan runs/demo/cpu-tp2-dp2/a/rather/deep/folder/of/plans/plan.json reused (digest c9e4646a602e) but its "
        "verification kept the defaults (gain -456.2 ms (mean of 4 paired differences, defaults - plan), needed > "
        "600.0 ms (the larger of its 95% bound 600.0 ms and the minimum gain 8.2 ms)) | profiling and search "
        "skipped; delete the plan or pass another --lagom-plan to search again"
    )
    for reason in (summary["verdict"], long):
        fig = report_figure(rows, {**summary, "verdict": reason, "run_kind": "reused"})
        try:
            renderer = fig.canvas.get_renderer()
            texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
            assert any("profiling and search" in t.get_text() for t in texts) or reason != long
            for t in texts:
                box = t.get_window_extent(renderer)
                assert box.x0 >= -0.5 and box.x1 <= fig.bbox.width + 0.5, (t.get_text()[:60], box, fig.bbox)
                assert box.y0 >= -0.5 and box.y1 <= fig.bbox.height + 0.5, (t.get_text()[:60], box, fig.bbox)
        finally:
            plt.close(fig)


def test_the_report_says_what_the_plan_cannot_change_and_why():
    """A site with registered buffers kept on its own communicator and a bucket group with two tuner
    rows: the plan's notes reach the report, grouped by note with their sites."""
    import dataclasses

    kept = "registered buffers (--use-nccl-ub) that only the group's own communicator holds: kept there"
    bins = "2 tuner rows, one per NCCL bin of its tensors (12582912, 4194304 bytes)"
    entries = {
        f"dp.grad_reduce_scatter[chunk0.bucket{i}]": dataclasses.replace(
            _entry(CommConfig(), 100.0, 100.0, "reduce_scatter", "dp"), note=kept
        )
        for i in range(5)
    }
    entries["dp.param_all_gather[chunk0.bucket0]"] = dataclasses.replace(
        _entry(CommConfig(n_channels=4), 90.0, 100.0, "all_gather", "dp"), note=bins
    )
    rows, summary = _fixture()
    text = render_markdown(site_rows(entries, {}, {}, {}) + rows, summary)
    assert "## What the plan cannot change, and how it applies the rest" in text
    assert (
        f"- {kept}: `dp.grad_reduce_scatter[chunk0.bucket0]`, `dp.grad_reduce_scatter[chunk0.bucket1]`, "
        "`dp.grad_reduce_scatter[chunk0.bucket2]` and 2 more"
    ) in text
    assert f"- {bins}: `dp.param_all_gather[chunk0.bucket0]`" in text
    assert "What the plan cannot change" not in render_markdown(rows, summary)  # no notes, no section


def test_a_figure_that_cannot_be_written_names_the_png_and_keeps_the_table(tmp_path, monkeypatch, capsys):
    import errno
    import os

    from lagom_megatron.megatron.outputs import figure

    real_write_atomic = figure.write_atomic

    def disk_full(path, write):  # the disk fills while savefig writes the temporary file
        def fill(tmp):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)

        return real_write_atomic(path, fill)

    monkeypatch.setattr(figure, "write_atomic", disk_full)
    rows, summary = _fixture()
    path = tmp_path / "report.md"
    assert write_report(path, rows, summary) == [path]
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # no PNG, no temporary file left
    assert "sites tuned:" in path.read_text()
    out = capsys.readouterr().out.splitlines()
    assert out == [f"lagom: WARNING: {tmp_path / 'report.png'} not written (No space left on device); {path} written"]
