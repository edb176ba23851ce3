"""The verification rule: keep a plan only when its measured gain beats the noise (docs/engine.md,
"Search").

Plan and defaults alternate for a few timed iterations each (``tuner.py``); the medians are
compared, and the gain must exceed both ``min_gain`` of the defaults' median and, under the
``half-range`` noise rule, half the larger per-arm range (max - min) of the measurements. Our
rule (the Lagom paper's verification is not public); on a noisy machine it keeps the defaults,
which is the intended behaviour.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

NoiseRule = Literal["half-range", "none"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of verification. Times in microseconds.

    ``keep``: the plan beat the defaults by more than ``needed_us``; ``text``: one line saying so
    in milliseconds (the unit of Megatron's log), for logs, reports and the plan's
    ``verification_reason``.
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
        plan_us, default_us: iteration times of each arm, microseconds (at least one each).
        min_gain: smallest relative gain (fraction of the defaults' median) a plan must show.
        noise_rule: ``half-range`` (the gain must also exceed half the larger per-arm range) or
            ``none`` (``min_gain`` alone decides).

    Raises:
        statistics.StatisticsError: an arm without measurements.
    """
    plan, base = statistics.median(plan_us), statistics.median(default_us)
    gain = base - plan
    spread = max(half_range(plan_us), half_range(default_us)) if noise_rule == "half-range" else 0.0
    need = max(spread, min_gain * base)
    text = (f"plan {plan / 1e3:.1f} ms vs defaults {base / 1e3:.1f} ms (median of {len(plan_us)}), "
            f"gain {gain / 1e3:.1f} ms, needed > {need / 1e3:.1f} ms")
    return Verdict(keep=gain > need, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text)
