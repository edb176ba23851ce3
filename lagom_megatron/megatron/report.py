"""``--lagom-report``: the per-site table of a tuned run and a figure beside it.

One row per collective site: op, group, bytes per call, calls per iteration, the default and the
chosen configuration, the region time measured under defaults (the profiled default iteration)
and under the plan (median of the verification iterations, or of the applied iterations when a
saved plan was reused), and the cost model's predictions for both. The format follows the file
suffix: ``.md`` (markdown table, the default), ``.csv`` or ``.json`` (rows plus the run
summary). A matplotlib bar chart of the region times (measured and predicted, default vs. plan)
is written beside it as ``<stem>.png``. Files are written atomically.
"""

from __future__ import annotations

import csv
import io
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lagom_megatron.engine.files import write_atomic, write_json_atomic, write_text_atomic

COLUMNS = ("site_id", "op", "group", "nbytes", "calls_per_iter", "default_config", "chosen_config",
           "measured_default_us", "measured_plan_us", "predicted_default_us", "predicted_plan_us")
"""Columns of the per-site table (times are region times per iteration, microseconds)."""


@dataclass(kw_only=True, slots=True)
class SiteRow:
    """One row of the report (see ``COLUMNS``); NaN = not measured or not predicted."""

    site_id: str
    op: str
    group: str
    nbytes: int
    calls_per_iter: int
    chosen_config: dict[str, Any] = field(default_factory=dict)
    measured_default_us: float = math.nan
    measured_plan_us: float = math.nan
    predicted_default_us: float = math.nan
    predicted_plan_us: float = math.nan

    def values(self) -> list[Any]:
        return [self.site_id, self.op, self.group, self.nbytes, self.calls_per_iter, "defaults",
                _cfg_text(self.chosen_config), self.measured_default_us, self.measured_plan_us,
                self.predicted_default_us, self.predicted_plan_us]


def site_rows(entries: dict[str, Any], sites: dict[str, Any], measured_default_us: dict[str, float],
              measured_plan_us: dict[str, list[float]]) -> list[SiteRow]:
    """One row per site of the plan or of the default iteration, in site-id order.

    Args:
        entries: site id -> ``PlanEntry`` of the plan (empty without a plan).
        sites: site id -> ``CollectiveSite`` seen in the default iteration.
        measured_default_us: site id -> region time under defaults, microseconds.
        measured_plan_us: site id -> region times under the plan (the median is reported).
    """
    rows = []
    for sid in sorted(set(entries) | set(sites)):
        e, site, plan_t = entries.get(sid), sites.get(sid), measured_plan_us.get(sid)
        rows.append(SiteRow(
            site_id=sid, op=site.op if site else getattr(e, "op", "?"), group=site.group if site else e.group,
            nbytes=site.nbytes if site else getattr(e, "nbytes", 0),
            calls_per_iter=site.calls_per_iter if site else 1,
            chosen_config=e.config.to_dict() if e is not None else {},
            measured_default_us=measured_default_us.get(sid, math.nan),
            measured_plan_us=statistics.median(plan_t) if plan_t else math.nan,
            predicted_default_us=float(getattr(e, "predicted_default_t_region_us", math.nan) or math.nan) if e else math.nan,
            predicted_plan_us=float(e.predicted_t_region_us) if e else math.nan,
        ))
    return rows


def _cfg_text(cfg: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(cfg.items())) or "defaults"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.1f}"
    return str(v)


def render_markdown(rows: list[SiteRow], summary: dict[str, Any]) -> str:
    """The report as a markdown document: summary lines, then the per-site table."""
    lines = ["# lagom report", ""]
    for key in ("phase", "reason", "method", "n_sites", "default_iteration_us", "measured_default_us",
                "measured_plan_us", "model_mape_pct", "plan_digest", "plan_path", "profile_path"):
        if summary.get(key) is not None:
            lines.append(f"- {key}: {_fmt(summary[key])}")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(v) for v in r.values()) + " |")
    return "\n".join(lines) + "\n"


def render_csv(rows: list[SiteRow]) -> str:
    """The per-site table as CSV with a header row (``COLUMNS``)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow(r.values())
    return buf.getvalue()


def write_report(path: str | os.PathLike, rows: list[SiteRow], summary: dict[str, Any], *, figure: bool = True) -> list[Path]:
    """Writes the table in the format of ``path``'s suffix and, with ``figure``, a PNG beside it.

    Returns:
        The paths written.

    Raises:
        ValueError: a suffix other than .md, .csv, .json (names it).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".md", ".markdown", ""):
        write_text_atomic(path, render_markdown(rows, summary))
    elif suffix == ".csv":
        write_text_atomic(path, render_csv(rows))
    elif suffix == ".json":
        write_json_atomic(path, {"summary": summary, "columns": list(COLUMNS),
                                 "rows": [dict(zip(COLUMNS, r.values())) for r in rows]})
    else:
        raise ValueError(f"--lagom-report must end in .md, .csv or .json; got {str(path)!r}")
    written = [path]
    if figure and rows:
        png = path.with_suffix(".png")
        plot_regions(png, rows, title=f"lagom: {summary.get('phase', '')} ({summary.get('method', '')})")
        written.append(png)
    return written


def plot_regions(path: Path, rows: list[SiteRow], *, title: str = "") -> None:
    """Horizontal bars per site: measured and predicted region time, defaults vs. plan (us)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r.site_id for r in rows]
    series = [("measured, defaults", [r.measured_default_us for r in rows]),
              ("measured, plan", [r.measured_plan_us for r in rows]),
              ("predicted, defaults", [r.predicted_default_us for r in rows]),
              ("predicted, plan", [r.predicted_plan_us for r in rows])]
    y = np.arange(len(names))
    h = 0.2
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.45 * len(names) + 1)))
    for i, (label, vals) in enumerate(series):
        v = np.array([x if math.isfinite(x) else 0.0 for x in vals])
        ax.barh(y + (i - 1.5) * h, v, height=h, label=label)
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("region time per iteration (us)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
