"""``--lagom-report``: what a ``--lagom`` run measured and decided (ms), per verification arm (median, half-range
spread, gain vs needed) and per site (region times); ``.md`` / ``.csv`` / ``.json`` by suffix, plus ``<stem>.png``."""

from __future__ import annotations

import csv
import io
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.files import write_json_atomic, write_text_atomic
from lagom_megatron.engine.knobs import GLOO_DEFAULT_THREADS
from lagom_megatron.engine.plan import Plan
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.engine.tuner import Tuner
from lagom_megatron.engine.verify import ALPHA, half_range, t_95, t_quantile, verdict
from lagom_megatron.megatron.outputs.run_files import RunFiles, say

COLUMNS = (
    "site_id",
    "op",
    "group",
    "bytes_per_call",
    "calls_per_iter",
    "default_config",
    "chosen_config",
    "tuned",
    "measured_default_ms",
    "measured_plan_ms",
    "predicted_default_ms",
    "predicted_plan_ms",
)
"""Columns of the per-site table (times: region time per iteration, milliseconds)."""


def default_config_text(backend: str) -> str:
    """What a site runs with when lagom leaves it alone, on ``backend`` (gloo, nccl or sim)."""
    if backend == "gloo":
        return f"n_channels={GLOO_DEFAULT_THREADS} (gloo worker threads), no split"
    return "NCCL's choice"


def is_tuned(config: dict[str, Any], backend: str) -> bool:
    """True when ``config`` (``CommConfig.to_dict()``) changes the backend's default (gloo's is 2 threads)."""
    cfg = {k: v for k, v in config.items() if v is not None}
    if backend == "gloo" and cfg.get("n_channels") == GLOO_DEFAULT_THREADS:
        cfg.pop("n_channels")
    return bool(cfg)


@dataclass(kw_only=True, slots=True)
class SiteRow:
    """One row of the report (see ``COLUMNS``); times in microseconds, NaN = not measured."""

    site_id: str
    op: str
    group: str
    nbytes: int
    calls_per_iter: int
    backend: str = "nccl"
    chosen_config: dict[str, Any] = field(default_factory=dict)
    measured_default_us: float = math.nan
    measured_plan_us: float = math.nan
    predicted_default_us: float = math.nan
    predicted_plan_us: float = math.nan
    note: str = ""

    @property
    def tuned(self) -> bool:
        return is_tuned(self.chosen_config, self.backend)

    def values(self, applied: bool = True) -> list[Any]:
        """The row in ``COLUMNS`` order (ms); ``tuned`` is ``yes`` only when ``applied``, else ``not applied``."""
        tuned = ("yes" if applied else "not applied") if self.tuned else "no"
        return [
            self.site_id,
            self.op,
            self.group,
            _bytes_text(self.nbytes),
            self.calls_per_iter or "-",
            default_config_text(self.backend),
            _cfg_text(self.chosen_config),
            tuned,
            self.measured_default_us / 1e3,
            self.measured_plan_us / 1e3,
            self.predicted_default_us / 1e3,
            self.predicted_plan_us / 1e3,
        ]


def site_rows(
    entries: dict[str, Any],
    sites: dict[str, Any],
    measured_default_us: dict[str, list[float]],
    measured_plan_us: dict[str, list[float]],
    *,
    backend: str = "nccl",
) -> list[SiteRow]:
    """One row per site of the plan or of the profiled sites; ``measured_*_us``: per-iteration region times (us)."""
    rows = []
    for sid in sorted(set(entries) | set(sites)):
        e, site = entries.get(sid), sites.get(sid)
        d_t, p_t = measured_default_us.get(sid), measured_plan_us.get(sid)
        rows.append(
            SiteRow(
                site_id=sid,
                op=site.op if site else e.op,
                group=site.group if site else e.group,
                nbytes=site.nbytes if site else e.nbytes,
                calls_per_iter=site.calls_per_iter if site else 0,
                backend=backend,
                chosen_config=e.config.to_dict() if e is not None else {},
                measured_default_us=statistics.median(d_t) if d_t else math.nan,
                measured_plan_us=statistics.median(p_t) if p_t else math.nan,
                predicted_default_us=float(e.predicted_default_t_region_us) if e else math.nan,
                predicted_plan_us=float(e.predicted_t_region_us) if e else math.nan,
                note=getattr(e, "note", "") if e is not None else "",
            )
        )
    return rows


def column_totals(rows: list[SiteRow], summary: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Per time column: (sum of the site rows, rest of the iteration, iteration), microseconds; NaN where unknown."""
    iters = {
        "measured_default": summary.get("measured_default_us"),
        "measured_plan": summary.get("measured_plan_us"),
        "predicted_default": summary.get("predicted_default_iteration_us"),
        "predicted_plan": summary.get("predicted_iteration_us"),
    }
    out = {}
    for col, it in iters.items():
        vals = [getattr(r, col + "_us") for r in rows]
        total = math.fsum(v for v in vals if math.isfinite(v)) if any(math.isfinite(v) for v in vals) else math.nan
        it = float(it) if isinstance(it, (int, float)) else math.nan
        out[col] = (total, it - total if math.isfinite(it) and math.isfinite(total) else math.nan, it)
    return out


def verdict_rule_text(
    noise_rule: str, n_pairs: int, min_gain: float, default_us: float, spread_us: float, n_looks: int = 1
) -> str:
    """How ``engine.verify.verdict`` decided under ``noise_rule``, in words, ms (inputs us, ``min_gain`` a fraction)."""
    floor = f"the minimum gain ({min_gain:.1%} of the defaults' median: {_ms(min_gain * default_us)} ms)"
    if noise_rule == "paired" and n_looks > 1:
        p = 1.0 - ALPHA / n_looks
        return (
            f"paired, sequential over {n_looks} looks: the k-th default and the k-th plan iteration form a pair; "
            f"the plan is kept at a look when the mean of the {n_pairs} paired differences is more than the larger "
            f"of its one-sided {p:.2%} Student-t bound (the 95% split over {n_looks} looks: t({p:.4f}, "
            f"{n_pairs - 1}) x sd / sqrt({n_pairs}), t = {t_quantile(p, n_pairs - 1):.3f}) and {floor}; an "
            f"undecided look doubles the pairs up to the cap"
        )
    if noise_rule == "paired":
        return (
            f"paired: the k-th default and the k-th plan iteration form a pair; the plan is kept when the mean "
            f"of the {n_pairs} paired differences is more than the larger of its one-sided 95% Student-t bound "
            f"(t(0.95, {n_pairs - 1}) x sd / sqrt({n_pairs}), t = {t_95(n_pairs - 1):.3f}) and {floor}"
        )
    if noise_rule == "half-range":
        return (
            f"half-range: the plan is kept when the medians' difference is more than the larger of half the wider "
            f"arm's range (max - min: {_ms(spread_us)} ms) and {floor}"
        )
    return f"{noise_rule}: the plan is kept when the medians' difference is more than {floor}"


def verdict_summary(
    plan_us: list[float], default_us: list[float], *, min_gain: float, noise_rule: str, n_looks: int = 1
) -> dict[str, Any]:
    """Verdict fields (us) of ``engine.verify.verdict`` (may raise); ``paired`` under two pairs: ``half-range``."""
    v = verdict(plan_us, default_us, min_gain=min_gain, noise_rule=noise_rule, n_looks=n_looks)  # type: ignore[arg-type]
    n = min(len(plan_us), len(default_us))
    applied = "half-range" if noise_rule == "paired" and n < 2 else noise_rule
    spread = max(half_range(plan_us), half_range(default_us))
    figures = v.text.removeprefix("gain ")
    return dict(
        gain_us=v.gain_us,
        needed_us=v.needed_us,
        spread_plan_us=half_range(plan_us),
        spread_default_us=half_range(default_us),
        verdict=("plan kept: " if v.keep else "defaults kept: ") + v.text,
        verdict_figures=figures,
        noise_rule=applied,
        verdict_rule=verdict_rule_text(applied, n, min_gain, v.default_us, spread, n_looks),
    )


def registration_text(groups: Any, registered_now: bool) -> str:
    """What a plan's ``registered_groups`` (Megatron's ``--use-nccl-ub``) came to: registered when the buffers were
    built, or left to the next launch that reuses the plan (buffers are registered only when they are built)."""
    when = "registered at this launch" if registered_now else "applied from the next launch that reuses this plan"
    return f"registered buffers for {', '.join(groups)} (--use-nccl-ub): {when}"


def registered_this_launch(ctl: Any) -> bool:
    """Whether this launch's DDP buffers are registered with NCCL (``nccl_ub`` pools the site registry found)."""
    return bool(getattr(getattr(ctl, "registry", None), "registered_pools", None))


def _bytes_text(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _cfg_text(cfg: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(cfg.items()) if v is not None) or "(default)"


def _ms(v: Any) -> str:
    return f"{v / 1e3:.1f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.2f}"
    return str(v)


def render_markdown(rows: list[SiteRow], summary: dict[str, Any]) -> str:
    """The report as markdown: the result, the iteration-level table, then the per-site table."""
    s = summary
    lines = [
        f"# lagom report: {s.get('phase', '?')}",
        "",
        f"- result: {s.get('phase', '?')}: {s.get('reason') or '(no reason recorded)'}",
        f"- run: {s.get('run_kind', '?')}; method {s.get('method', '?')}; backend {s.get('backend', '?')}; "
        f"cluster {s.get('cluster', '?')}",
    ]
    for key, label in (("plan_path", "plan"), ("profile_path", "profile")):
        lines.append(f"- {label}: {s[key]}" if s.get(key) else f"- {label}: none written by this run")
    if s.get("plan_digest"):
        lines.append(f"- plan digest: {s['plan_digest'][:12]}")
    if s.get("registered_groups"):
        lines.append(f"- {registration_text(s['registered_groups'], bool(s.get('registered_this_launch')))}")
    n_tuned = sum(r.tuned for r in rows)
    n_gain = sum(r.tuned and r.predicted_plan_us < r.predicted_default_us for r in rows)
    default = default_config_text(s.get("backend", "nccl"))
    if s.get("phase") == "applied":
        lines.append(
            f"- sites tuned: {n_tuned} of {len(rows)} (config differs from the default: {default}); "
            f"{n_gain} with a predicted gain"
        )
    else:
        lines.append(
            f"- sites tuned: 0 of {len(rows)} (the defaults were kept: {default}); the plan would change "
            f"{n_tuned} ({n_gain} with a predicted gain), tuned 'not applied' below"
        )
    lines += ["", "## Iteration time (ms)", "", "| | defaults | plan |", "|---|---|---|"]
    n_d, n_p = len(s.get("verify_default_us") or []), len(s.get("verify_plan_us") or [])
    lines.append(
        f"| measured median ({n_d} / {n_p} iterations: the verification's, or a reused plan's 2nd-4th) | "
        f"{_ms(s.get('measured_default_us'))} | {_ms(s.get('measured_plan_us'))} |"
    )
    lines.append(
        f"| measured spread (half of max - min; the half-range rule's noise) | {_ms(s.get('spread_default_us'))} | {_ms(s.get('spread_plan_us'))} |"
    )
    lines.append(
        f"| predicted by the cost model | {_ms(s.get('predicted_default_iteration_us'))} | "
        f"{_ms(s.get('predicted_iteration_us'))} |"
    )
    lines.append(
        f"| profiled default iteration (one iteration, profiler on) | {_ms(s.get('default_iteration_us'))} | |"
    )
    if s.get("verdict_figures"):
        lines += ["", f"- gain (defaults - plan): {s['verdict_figures']}", f"- rule: {s.get('verdict_rule')}"]
    else:
        lines += ["", "- gain (defaults - plan): - (no verification in this run)"]
    lines.append(f"- verdict: {s.get('verdict') or 'no verification in this run'}")
    lines += [
        "",
        "## Per site (region time per iteration, ms)",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    applied = s.get("phase") == "applied"
    for r in rows:
        lines.append("| " + " | ".join(_fmt(v) for v in r.values(applied)) + " |")
    totals = column_totals(rows, s)
    order = ("measured_default", "measured_plan", "predicted_default", "predicted_plan")
    pad = [""] * (len(COLUMNS) - 5)
    for i, label in enumerate(("sum of the sites", "rest of the iteration", "iteration")):
        lines.append("| " + " | ".join([f"**{label}**", *pad, *(_fmt(totals[c][i] / 1e3) for c in order)]) + " |")
    lines += _note_lines(rows)
    lines += observed_lines(s.get("observed") or {})
    return "\n".join(lines) + "\n"


def observed_lines(observed: dict[str, dict[str, Any]]) -> list[str]:
    """The observed check's table (``megatron.observed``) per planned site; empty when no check ran."""
    if not observed:
        return []
    out = [
        "",
        "## Applied = observed (what ran, per planned site)",
        "",
        "| site_id | verdict | knob | planned | observed | rank | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for sid, r in observed.items():
        knobs = list(r.get("planned") or {}) or ["-"]
        verdict = {"differs": "differs: reverted to the defaults"}.get(r["status"], r["status"])
        for k in knobs:
            mark = " (differs)" if k in r.get("knobs", ()) else ""
            out.append(
                f"| `{sid}` | {verdict} | {k}{mark} | {_fmt((r.get('planned') or {}).get(k, '-'))} | "
                f"{_fmt((r.get('observed') or {}).get(k, '-'))} | {r.get('rank', '-')} | {r.get('note') or ''} |"
            )
    return out


def _note_lines(rows: list[SiteRow]) -> list[str]:
    by_note: dict[str, list[str]] = {}
    for r in rows:
        for note in filter(None, (n.strip() for n in r.note.split(";"))):
            by_note.setdefault(note, []).append(r.site_id)
    if not by_note:
        return []
    out = ["", "## What the plan cannot change, and how it applies the rest", ""]
    for note, sids in by_note.items():
        shown = ", ".join(f"`{s}`" for s in sids[:3]) + (f" and {len(sids) - 3} more" if len(sids) > 3 else "")
        out.append(f"- {note}: {shown}")
    return out


def render_csv(rows: list[SiteRow], applied: bool = True) -> str:
    """The per-site table as CSV with a header row (``COLUMNS``); ``applied``: ``SiteRow.values``."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow(r.values(applied))
    return buf.getvalue()


def report_path_for(path: str | os.PathLike, run_kind: str) -> Path:
    """``path`` for a ``tuned`` run, else the first free ``<stem>.<run_kind>-<n><suffix>``."""
    path = Path(path)
    if run_kind == "tuned":
        return path
    n = 1
    while True:
        cand = path.with_name(f"{path.stem}.{run_kind}-{n}{path.suffix}")
        if not cand.exists():
            return cand
        n += 1


def write_report(
    path: str | os.PathLike, rows: list[SiteRow], summary: dict[str, Any], *, figure: bool = True
) -> list[Path]:
    """Writes the report by ``path``'s suffix (.md, .csv, .json; else ValueError) and ``<stem>.png``; the paths
    written (a PNG that could not be written is warned about and left out; OSError for the table)."""
    path = Path(path)
    suffix = path.suffix.lower()
    applied = summary.get("phase") == "applied"
    if suffix in (".md", ".markdown", ""):
        write_text_atomic(path, render_markdown(rows, summary))
    elif suffix == ".csv":
        write_text_atomic(path, render_csv(rows, applied))
    elif suffix == ".json":
        totals = column_totals(rows, summary)
        write_json_atomic(
            path,
            {
                "summary": summary,
                "columns": list(COLUMNS),
                "rows": [dict(zip(COLUMNS, r.values(applied))) for r in rows],
                "totals_ms": {
                    c: dict(zip(("sites", "rest", "iteration"), (x / 1e3 for x in t))) for c, t in totals.items()
                },
            },
        )
    else:
        raise ValueError(f"--lagom-report must end in .md, .csv or .json; got {str(path)!r}")
    written = [path]
    if figure and rows:
        png = path.with_suffix(".png")
        from lagom_megatron.megatron.outputs.figure import plot_report

        try:
            plot_report(png, rows, summary)
        except OSError as exc:  # the table is written: name the one file that is not
            say(f"lagom: WARNING: {png} not written ({exc.strerror or exc}); {path} written")
        else:
            written.append(png)
    return written


class SummaryPart(Protocol):
    def summary_part(self) -> dict[str, Any]:
        """The report's summary fields of the apply path (pool, capabilities, observed, a failure)."""


class RunView(Protocol):
    """What the report reads of a run (``control.controller.LagomController``); times in us."""

    mode: str
    method: str
    backend: str | None
    cluster: ClusterSpec | None
    tuner: Tuner | None
    plan: Plan | None
    applier: SummaryPart | None
    files: RunFiles
    search_ms: float | None
    train_iters: int | None
    last_iteration: int
    applied_us: list[float]
    last_sites: dict[str, CollectiveSite]
    t_verify_default: dict[str, list[float]]
    t_plan: dict[str, list[float]]


def run_kind(ctl: RunView) -> str:
    """``run_files.RUN_KINDS`` of this run."""
    tuner = ctl.tuner
    if ctl.mode == "reuse" and (tuner is None or tuner.done):
        return "reused"
    if tuner is not None and not tuner.done and ctl.mode != "aborted":
        if ctl.train_iters is not None and ctl.last_iteration < ctl.train_iters:
            return "interrupted"
        return "unfinished"
    return "tuned"


def run_summary(ctl: RunView) -> dict[str, Any]:
    """JSON-ready state of the run for the report (us; paths of existing files only; verdict fields recomputed)."""
    tuner = ctl.tuner
    out: dict[str, Any] = tuner.summary() if tuner is not None else {"phase": ctl.mode, "method": ctl.method}
    kind = run_kind(ctl)
    out.update(
        mode=ctl.mode,
        run_kind=kind,
        search_ms=ctl.search_ms,
        backend=ctl.backend,
        cluster=ctl.cluster.name if ctl.cluster is not None else None,
    )
    if ctl.applier is not None:
        out.update(ctl.applier.summary_part())
    search = out.get("search") or {}
    for key in ("predicted_iteration_us", "predicted_default_iteration_us"):
        if isinstance(search.get(key), (int, float)):
            out[key] = search[key]
    plan = ctl.plan
    if kind == "reused" and plan is not None:
        for key in ("predicted_iteration_us", "predicted_default_iteration_us"):
            if isinstance(plan.stats.get(key), (int, float)):
                out[key] = plan.stats[key]
    vp, vd = out.get("verify_plan_us") or [], out.get("verify_default_us") or []
    if vp and vd and tuner is not None:
        out.update(
            verdict_summary(
                vp,
                vd,
                min_gain=tuner.config.min_gain,
                noise_rule=tuner.config.noise_rule,
                n_looks=len(tuner.verify_looks),
            )
        )
    if kind == "reused" and plan is not None:
        kept_defaults = plan.rejected
        saved = plan.stats.get("verification_reason") or "no reason saved"
        out["phase"] = "fell_back" if kept_defaults else "applied"
        out["reason"] = (
            f"reused plan {ctl.files.plan_path}, rejected by its own verification ({saved}); defaults kept"
            if kept_defaults
            else f"reused plan {ctl.files.plan_path}, verified when it was searched ({saved}); "
            "not verified again in this run"
        )
        out["method"] = plan.method
        if ctl.applied_us:  # under the defaults when the reused plan was a rejected one
            arm = "default" if kept_defaults else "plan"
            out[f"measured_{arm}_us"] = statistics.median(ctl.applied_us)
            out[f"verify_{arm}_us"] = list(ctl.applied_us)
    elif kind in ("unfinished", "interrupted") and tuner is not None:
        phase = tuner.phase.value
        out["reason"] = (
            f"training stopped at iteration {ctl.last_iteration} of {ctl.train_iters} (an error or "
            f"a signal) while lagom was {phase}; defaults kept"
            if kind == "interrupted"
            else f"--train-iters {ctl.train_iters} ended while lagom was {phase}: tuning needs "
            f"{'up to ' if len(tuner.verify_looks) > 1 else ''}{tuner.total_iters} iterations; "
            "defaults kept"
        )
    out["plan_path"] = str(ctl.files.plan_path) if ctl.files.plan_path.is_file() else None
    out["profile_path"] = str(ctl.files.profile_path) if ctl.files.profile_path.is_file() else None
    if plan is not None:
        out["plan_digest"] = plan.digest()
        if plan.registered_groups:
            out["registered_groups"] = list(plan.registered_groups)
            out["registered_this_launch"] = registered_this_launch(ctl)
    return out


def run_rows(ctl: RunView) -> list[SiteRow]:
    """One ``SiteRow`` per site of the plan (or of the profiled sites), from the verification's iterations."""
    entries = ctl.plan.entries if ctl.plan is not None else {}
    return site_rows(entries, ctl.last_sites, ctl.t_verify_default, ctl.t_plan, backend=ctl.backend or "nccl")
