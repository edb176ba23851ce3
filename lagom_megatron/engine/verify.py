"""The verification rule: keep a plan only when its measured gain beats the noise (docs/engine.md,
"Search").

Plan and defaults alternate for a few timed iterations each (``tuner.py``: defaults, plan,
defaults, plan, ...). Noise rules (ours; the Lagom paper's verification is not public):

* ``paired`` (default): the k-th default and the k-th plan iteration are neighbours, so slow drift
  (clocks, thermals, a straggler) hits both; the gain is the mean of the paired differences
  ``default_k - plan_k`` and must exceed ``min_gain`` of the defaults' median and its one-sided
  95% Student-t bound, ``t(0.95, n-1) * sd / sqrt(n)``. With 8 pairs and 1% iteration noise it keeps
  a real 1.5% gain almost always and a pure-noise "gain" about 5% of the time; with fewer than
  two pairs it falls back to ``half-range``.
* ``half-range``: the medians' gain must exceed half the larger per-arm range (max - min).
* ``none``: ``min_gain`` alone decides.

On a noisy machine the rules keep the defaults, which is the intended behaviour.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

NoiseRule = Literal["paired", "half-range", "none"]
NOISE_RULES: tuple[str, ...] = ("paired", "half-range", "none")

T_95: tuple[float, ...] = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
                           1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729)
"""One-sided 95% quantiles of Student's t for 1..19 degrees of freedom (standard table); 1.645
(the normal quantile) beyond."""


def t_95(dof: int) -> float:
    """One-sided 95% Student-t quantile for ``dof`` >= 1 degrees of freedom."""
    return T_95[dof - 1] if dof <= len(T_95) else 1.645


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of verification. Times in microseconds.

    ``keep``: the plan beat the defaults by more than ``needed_us``; ``text``: one line saying so
    in milliseconds (the unit of Megatron's log), for logs, reports and the plan's
    ``verification_reason``: the one statistic the rule compared (``gain ...``, what it is) and the
    bound it had to beat (``needed > ...``, what it is made of). Under ``paired`` the arms' medians
    are not in it: they are another statistic (the report's iteration table lists them, labelled).
    """

    keep: bool
    plan_us: float
    default_us: float
    gain_us: float
    needed_us: float
    text: str


def half_range(xs: list[float]) -> float:
    """(max - min) / 2 of ``xs``; 0 for fewer than two values."""
    return (max(xs) - min(xs)) / 2.0 if len(xs) > 1 else 0.0


def verdict(plan_us: list[float], default_us: list[float], *, min_gain: float, noise_rule: NoiseRule) -> Verdict:
    """Compares the plan's iteration times with the defaults' (module docstring).

    Args:
        plan_us, default_us: iteration times of each arm in the order measured, microseconds (at
            least one each); under ``paired`` the k-th of each form a pair.
        min_gain: smallest relative gain (fraction of the defaults' median) a plan must show.
        noise_rule: ``paired``, ``half-range`` or ``none`` (module docstring).

    Raises:
        statistics.StatisticsError: an arm without measurements.
        ValueError: an unknown noise rule.
    """
    if noise_rule not in NOISE_RULES:
        raise ValueError(f"noise_rule must be one of {list(NOISE_RULES)}; got {noise_rule!r}")
    n = min(len(plan_us), len(default_us))
    if noise_rule == "paired" and n >= 2:
        d = [b - p for p, b in zip(plan_us[:n], default_us[:n])]
        base = statistics.median(default_us)
        gain = statistics.fmean(d)
        bound = t_95(n - 1) * statistics.stdev(d) / math.sqrt(n)
        need = max(bound, min_gain * base)
        plan = base - gain
        text = (f"gain {gain / 1e3:.1f} ms (mean of {n} paired differences, defaults - plan), needed > "
                f"{need / 1e3:.1f} ms (the larger of its 95% bound {bound / 1e3:.1f} ms and the minimum gain "
                f"{min_gain * base / 1e3:.1f} ms)")
        return Verdict(keep=gain > need, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text)
    if noise_rule == "paired":
        noise_rule = "half-range"
    plan, base = statistics.median(plan_us), statistics.median(default_us)
    gain = base - plan
    spread = max(half_range(plan_us), half_range(default_us)) if noise_rule == "half-range" else 0.0
    need = max(spread, min_gain * base)
    floor = f"the minimum gain {min_gain * base / 1e3:.1f} ms"
    text = (f"gain {gain / 1e3:.1f} ms (median of the defaults {base / 1e3:.1f} ms - median of the plan "
            f"{plan / 1e3:.1f} ms, {len(default_us)} and {len(plan_us)} iterations), needed > {need / 1e3:.1f} ms ("
            + (f"the larger of half the wider arm's range {spread / 1e3:.1f} ms and {floor})"
               if noise_rule == "half-range" else f"{floor})"))
    return Verdict(keep=gain > need, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text)
