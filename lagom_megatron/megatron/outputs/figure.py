"""The report's figure (``<report stem>.png``, ms): arm medians with min-max ranges, predictions as hollow markers, a
band from ``defaults - needed`` to the defaults' median; below, region times of the ``MAX_SITES`` most changed sites."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lagom_megatron.engine.files import write_atomic

MAX_SITES = 12


def _ms(v: Any) -> float:
    return float(v) / 1e3 if isinstance(v, (int, float)) and math.isfinite(v) else math.nan


def plot_report(path: Path, rows: list, summary: dict[str, Any]) -> None:
    """Writes the figure as PNG to ``path``, atomically; ``summary`` times in microseconds."""
    import matplotlib.pyplot as plt

    fig = report_figure(rows, summary)
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=DPI, format="png"))
    finally:
        plt.close(fig)


DPI = 100


def fit_title(fig: Any, ax: Any, text: str, *, fontsize: float, min_width: int = 30) -> Any:
    """Sets ``ax``'s title to ``text``, wrapped narrower until it lies inside the canvas; returns the title ``Text``."""
    import textwrap

    width = max(len(line) for line in text.split("\n")) if text else min_width
    while True:
        wrapped = "\n".join(textwrap.fill(line, width, break_long_words=True) or line for line in text.split("\n"))
        title = ax.set_title(wrapped, fontsize=fontsize)
        fig.tight_layout()
        fig.canvas.draw()
        box = title.get_window_extent()
        if (box.x0 >= 0 and box.x1 <= fig.bbox.width) or width <= min_width:
            return title
        width = max(min_width, int(width * 0.85))


def report_figure(rows: list, summary: dict[str, Any]) -> Any:
    """The figure of :func:`plot_report`, laid out on the Agg canvas; the caller closes the returned ``Figure``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def change(r) -> float:
        pairs = ((r.measured_default_us, r.measured_plan_us), (r.predicted_default_us, r.predicted_plan_us))
        return max((abs(a - b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)), default=0.0)

    shown = sorted(rows, key=change, reverse=True)[:MAX_SITES]
    shown.sort(key=lambda r: r.site_id)
    fig, (ax_it, ax_site) = plt.subplots(
        2,
        1,
        figsize=(12, 3.2 + 0.42 * len(shown)),
        dpi=DPI,
        gridspec_kw={"height_ratios": [1.6, max(1.0, 0.42 * len(shown))]},
    )
    s = summary
    arms = [
        (
            "defaults",
            s.get("verify_default_us") or [],
            s.get("measured_default_us"),
            s.get("predicted_default_iteration_us"),
            "tab:blue",
        ),
        (
            "plan",
            s.get("verify_plan_us") or [],
            s.get("measured_plan_us"),
            s.get("predicted_iteration_us"),
            "tab:orange",
        ),
    ]
    base = _ms(s.get("measured_default_us"))
    needed = _ms(s.get("needed_us"))
    if math.isfinite(base) and math.isfinite(needed):
        ax_it.axvspan(
            base - needed,
            base,
            color="0.85",
            zorder=0,
            label=f"not enough gain: the verdict needed more than {needed:.1f} ms",
        )
        ax_it.axvline(base - needed, color="0.4", ls="--", lw=1)
    for y, (label, xs, med, pred, color) in enumerate(arms):
        med = _ms(med)
        if math.isfinite(med):
            lo, hi = min(xs) / 1e3, max(xs) / 1e3
            ax_it.barh(
                y,
                med,
                height=0.5,
                color=color,
                alpha=0.8,
                label=f"{label}: median {med:.1f} ms (range {lo:.1f}-{hi:.1f}, {len(xs)} iterations)",
            )
            ax_it.errorbar(med, y, xerr=[[med - lo], [hi - med]], fmt="none", ecolor="k", capsize=5)
        pred = _ms(pred)
        if math.isfinite(pred):
            ax_it.plot(pred, y, marker="D", mfc="none", mec="k", ls="none")
    ax_it.plot([], [], marker="D", mfc="none", mec="k", ls="none", label="predicted by the cost model")
    ax_it.set_yticks([0, 1], ["defaults", "plan"])
    ax_it.invert_yaxis()
    # zoomed to the measurements (the differences are a few percent of the iteration)
    xs = [x / 1e3 for _, vals, _, _, _ in arms for x in vals]
    xs += [
        v
        for v in (
            base - needed if math.isfinite(needed) else math.nan,
            _ms(s.get("predicted_default_iteration_us")),
            _ms(s.get("predicted_iteration_us")),
        )
        if math.isfinite(v)
    ]
    if xs:
        lo, hi = min(xs), max(xs)
        pad = max(0.1 * (hi - lo), 0.01 * hi, 1e-3)
        ax_it.set_xlim(lo - pad, hi + pad)
    ax_it.set_xlabel("iteration time (ms; axis zoomed, not from 0)")
    ax_it.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    verdict = s.get("verdict") or s.get("reason") or ""
    title = f"lagom: {s.get('phase', '?')} ({s.get('run_kind', '')}, {s.get('method', '')})\n{verdict}"

    names = [r.site_id for r in shown]
    series = [
        ("measured, defaults", [r.measured_default_us for r in shown]),
        ("measured, plan", [r.measured_plan_us for r in shown]),
        ("predicted, defaults", [r.predicted_default_us for r in shown]),
        ("predicted, plan", [r.predicted_plan_us for r in shown]),
    ]
    y = np.arange(len(names))
    h = 0.2
    for i, (label, vals) in enumerate(series):
        v = np.array([x / 1e3 if math.isfinite(x) else 0.0 for x in vals])
        ax_site.barh(y + (i - 1.5) * h, v, height=h, label=label)
    ax_site.set_yticks(y, names, fontsize=7)
    ax_site.invert_yaxis()
    ax_site.set_xlabel("region time per iteration (ms)")
    ax_site.set_title(f"{len(shown)} of {len(rows)} sites (largest changes; the report's table lists all)", fontsize=8)
    ax_site.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fit_title(fig, ax_it, title, fontsize=9)
    return fig
