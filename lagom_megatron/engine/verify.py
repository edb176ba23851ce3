"""The verification rule: keep a plan only when its measured gain beats the noise (docs/engine.md; ours).
``paired``: mean of default_k - plan_k above ``min_gain`` and its one-sided 95% Student-t bound (one pair:
``half-range``); ``half-range``: medians' gain above half the wider arm's range; ``none``: ``min_gain`` alone.
Sequential ``paired``: verdicts at ``looks``, reject on futility or at the cap; 5% false-accept split over the looks."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

NoiseRule = Literal["paired", "half-range", "none"]
NOISE_RULES: tuple[str, ...] = ("paired", "half-range", "none")

T_95: tuple[float, ...] = (
    6.314,
    2.920,
    2.353,
    2.132,
    2.015,
    1.943,
    1.895,
    1.860,
    1.833,
    1.812,
    1.796,
    1.782,
    1.771,
    1.761,
    1.753,
    1.746,
    1.740,
    1.734,
    1.729,
)
"""One-sided 95% Student-t quantiles for 1..19 degrees of freedom; 1.645 beyond."""


ALPHA = 0.05
"""One-sided false-accept rate of the whole verification (split over its looks)."""


def t_95(dof: int) -> float:
    """One-sided 95% Student-t quantile for ``dof`` >= 1 degrees of freedom."""
    return T_95[dof - 1] if dof <= len(T_95) else 1.645


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile of Student's t (ValueError unless 0.5 < p < 1, dof >= 1): exact for dof 1, 2, else
    Cornish-Fisher to 1/dof^4 (Abramowitz & Stegun 26.7.5; within 1.5% for p <= 0.9975, dof >= 3)."""
    if not 0.5 < p < 1.0 or dof < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and dof >= 1; got p={p}, dof={dof}")
    if dof == 1:
        return math.tan(math.pi * (p - 0.5))
    if dof == 2:
        return (2.0 * p - 1.0) / math.sqrt(2.0 * p * (1.0 - p))
    z = NormalDist().inv_cdf(p)
    terms = (
        (z**3 + z) / 4.0,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96.0,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384.0,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160.0,
    )
    return z + sum(g / dof ** (k + 1) for k, g in enumerate(terms))


def looks(first: int, cap: int) -> tuple[int, ...]:
    """Verdict pair counts: ``first``, doubling, ``cap`` (20, 40, 80, 160); ValueError unless 1 <= first <= cap."""
    if first < 1 or cap < first:
        raise ValueError(f"verification looks need 1 <= first <= cap; got first={first}, cap={cap}")
    out = []
    n = first
    while n < cap:
        out.append(n)
        n *= 2
    return (*out, cap)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Verification's outcome (us); ``text``: one line in ms (Megatron's log unit), the statistic and its bound."""

    keep: bool
    plan_us: float
    default_us: float
    gain_us: float
    needed_us: float
    text: str
    decided: bool = True
    """False: a look that neither accepted nor ruled out the plan (``keep`` False, more pairs due)."""


def half_range(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / 2.0 if len(xs) > 1 else 0.0


def verdict(
    plan_us: list[float],
    default_us: list[float],
    *,
    min_gain: float,
    noise_rule: NoiseRule,
    n_looks: int = 1,
    final: bool = True,
) -> Verdict:
    """Compares the plan's iteration times (us, measured order) with the defaults' (module docstring); ``final``
    False lets a look stay undecided. StatisticsError on an empty arm, ValueError on an unknown rule."""
    if noise_rule not in NOISE_RULES:
        raise ValueError(f"noise_rule must be one of {list(NOISE_RULES)}; got {noise_rule!r}")
    n = min(len(plan_us), len(default_us))
    if noise_rule == "paired" and n < 2 and not final:
        base = statistics.median(default_us)
        return Verdict(
            keep=False,
            plan_us=statistics.median(plan_us),
            default_us=base,
            gain_us=base - statistics.median(plan_us),
            needed_us=min_gain * base,
            text=f"undecided after {n} pair: the paired rule needs two",
            decided=False,
        )
    if noise_rule == "paired" and n >= 2:
        return _paired(plan_us[:n], default_us[:n], min_gain=min_gain, n_looks=n_looks, final=final)
    if noise_rule == "paired":
        noise_rule = "half-range"
    plan, base = statistics.median(plan_us), statistics.median(default_us)
    gain = base - plan
    spread = max(half_range(plan_us), half_range(default_us)) if noise_rule == "half-range" else 0.0
    need = max(spread, min_gain * base)
    floor = f"the minimum gain {min_gain * base / 1e3:.1f} ms"
    single = noise_rule == "half-range" and max(len(plan_us), len(default_us)) == 1
    text = (
        f"gain {gain / 1e3:.1f} ms (median of the defaults {base / 1e3:.1f} ms - median of the plan "
        f"{plan / 1e3:.1f} ms, {len(default_us)} and {len(plan_us)} iterations), needed > {need / 1e3:.1f} ms ("
        + (
            f"{floor}; one iteration per arm gives no noise estimate: it alone decided)"
            if single
            else f"the larger of half the wider arm's range {spread / 1e3:.1f} ms and {floor})"
            if noise_rule == "half-range"
            else f"{floor})"
        )
    )
    return Verdict(keep=gain > need, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text)


def _paired(plan_us: list[float], default_us: list[float], *, min_gain: float, n_looks: int, final: bool) -> Verdict:
    if n_looks < 1:
        raise ValueError(f"n_looks must be >= 1; got {n_looks}")
    n = len(plan_us)
    d = [b - p for p, b in zip(plan_us, default_us)]
    base = statistics.median(default_us)
    gain = statistics.fmean(d)
    q = t_95(n - 1) if n_looks == 1 else t_quantile(1.0 - ALPHA / n_looks, n - 1)
    bound = q * statistics.stdev(d) / math.sqrt(n)
    floor = min_gain * base
    need = max(bound, floor)
    level = "95%" if n_looks == 1 else f"{100 * (1 - ALPHA / n_looks):.2f}% (95% over {n_looks} looks)"
    stat = f"gain {gain / 1e3:.1f} ms (mean of {n} paired differences, defaults - plan)"
    plan = base - gain
    line = (
        f"{stat}, needed > {need / 1e3:.1f} ms (the larger of its {level} bound {bound / 1e3:.1f} ms and "
        f"the minimum gain {floor / 1e3:.1f} ms)"
    )
    keep = gain > need
    if keep or final:
        return Verdict(keep=keep, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=line)
    if gain + bound < floor:  # futility: even the upper end of the bound misses the minimum gain
        text = f"{line}; stopped: even its upper bound {(gain + bound) / 1e3:.1f} ms is below the minimum gain"
        return Verdict(keep=False, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text)
    text = (
        f"undecided after {n} pairs: {stat}, needed > {need / 1e3:.1f} ms, its upper bound "
        f"{(gain + bound) / 1e3:.1f} ms still reaches the minimum gain {floor / 1e3:.1f} ms"
    )
    return Verdict(keep=False, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text, decided=False)


def sequential_verdict(
    plan_us: list[float], default_us: list[float], *, min_gain: float, noise_rule: NoiseRule, first: int, cap: int
) -> Verdict | None:
    """The verdict once both arms hold a look's count (``looks``; one unless ``paired``), else None; ValueError."""
    points = looks(first, cap) if noise_rule == "paired" else (first,)
    n = min(len(plan_us), len(default_us))
    if len(plan_us) != len(default_us) or n not in points:
        return None
    v = verdict(
        plan_us, default_us, min_gain=min_gain, noise_rule=noise_rule, n_looks=len(points), final=n == points[-1]
    )
    return v
