"""The verification rule: keep a plan only when its measured gain beats the noise (docs/engine.md,
"Search").

Plan and defaults alternate for a few timed iterations each (``tuner.py``: defaults, plan,
defaults, plan, ...). Noise rules (ours; the Lagom paper's verification is not public):

* ``paired`` (default): the k-th default and the k-th plan iteration are neighbours, so slow drift
  (clocks, thermals, a straggler) hits both; the gain is the mean of the paired differences
  ``default_k - plan_k`` and must exceed ``min_gain`` of the defaults' median and its one-sided
  95% Student-t bound, ``t(0.95, n-1) * sd / sqrt(n)``. With 8 pairs and 1% iteration noise it keeps
  a real 1.5% gain almost always and a pure-noise "gain" about 5% of the time; with fewer than
  two pairs it falls back to ``half-range``, which one iteration per arm leaves without a noise
  estimate (the minimum gain alone decides, and the verdict's line says so).
* ``half-range``: the medians' gain must exceed half the larger per-arm range (max - min).
* ``none``: ``min_gain`` alone decides.

Sequential verification (``paired`` only; ``looks``, ``sequential_verdict``): a gain of 0.5% at 1%
iteration noise needs about a hundred pairs to tell from noise, while a plan 2% faster or slower is
plain after a few. So the verdict is taken at a growing number of pairs, the looks ``n, 2n, 4n, ...,
cap``: a look accepts the plan when its gain clears the bound, stops and rejects it when even the
upper end of its confidence interval is below the minimum gain (futility), and otherwise asks for
more pairs; at the cap an undecided plan is rejected. The one-sided 5% false-accept rate is split
evenly over the K looks (Bonferroni: each look's bound uses the ``1 - 0.05 / K`` quantile), so a
plan with no gain is kept at most 5% of the time however many looks it gets; with ``cap == n`` there
is one look and the rule is the fixed-count rule above. ``sim.verify_mc`` tabulates both rates.

On a noisy machine the rules keep the defaults, which is the intended behaviour.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

NoiseRule = Literal["paired", "half-range", "none"]
NOISE_RULES: tuple[str, ...] = ("paired", "half-range", "none")

T_95: tuple[float, ...] = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
                           1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729)
"""One-sided 95% quantiles of Student's t for 1..19 degrees of freedom (standard table); 1.645
(the normal quantile) beyond."""


ALPHA = 0.05
"""One-sided false-accept rate of the whole verification (split over its looks)."""


def t_95(dof: int) -> float:
    """One-sided 95% Student-t quantile for ``dof`` >= 1 degrees of freedom."""
    return T_95[dof - 1] if dof <= len(T_95) else 1.645


def t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile of Student's t with ``dof`` degrees of freedom.

    Exact for 1 and 2 degrees of freedom (closed forms); beyond, the Cornish-Fisher expansion of t
    in the normal quantile z to the 1/dof^4 term (Abramowitz & Stegun, Handbook of Mathematical
    Functions, 26.7.5), within 1.5% of the exact quantile for p <= 0.9975 and dof >= 3 and within
    0.1% from dof 10. The table ``T_95`` gives p = 0.95 exactly (``t_95``).

    Raises:
        ValueError: ``p`` outside (0.5, 1) or ``dof < 1``.
    """
    if not 0.5 < p < 1.0 or dof < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and dof >= 1; got p={p}, dof={dof}")
    if dof == 1:
        return math.tan(math.pi * (p - 0.5))
    if dof == 2:
        return (2.0 * p - 1.0) / math.sqrt(2.0 * p * (1.0 - p))
    z = NormalDist().inv_cdf(p)
    terms = ((z ** 3 + z) / 4.0,
             (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96.0,
             (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384.0,
             (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160.0)
    return z + sum(g / dof ** (k + 1) for k, g in enumerate(terms))


def looks(first: int, cap: int) -> tuple[int, ...]:
    """Pair counts at which sequential verification takes its verdict: ``first``, doubling, then
    ``cap`` (module docstring). ``looks(20, 160) == (20, 40, 80, 160)``; ``looks(4, 4) == (4,)``.

    Raises:
        ValueError: ``first < 1`` or ``cap < first``.
    """
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
    decided: bool = True
    """False: a look of sequential verification that neither accepted nor ruled out the plan (more
    pairs are needed; ``keep`` is then False)."""


def half_range(xs: list[float]) -> float:
    """(max - min) / 2 of ``xs``; 0 for fewer than two values."""
    return (max(xs) - min(xs)) / 2.0 if len(xs) > 1 else 0.0


def verdict(plan_us: list[float], default_us: list[float], *, min_gain: float, noise_rule: NoiseRule,
            n_looks: int = 1, final: bool = True) -> Verdict:
    """Compares the plan's iteration times with the defaults' (module docstring).

    Args:
        plan_us, default_us: iteration times of each arm in the order measured, microseconds (at
            least one each); under ``paired`` the k-th of each form a pair.
        min_gain: smallest relative gain (fraction of the defaults' median) a plan must show.
        noise_rule: ``paired``, ``half-range`` or ``none`` (module docstring).
        n_looks: looks of sequential verification the false-accept rate is split over (``paired``
            only; 1 = the fixed-count rule).
        final: whether this is the last look; an earlier look may leave the plan undecided
            (``Verdict.decided`` False). Other rules always decide.

    Raises:
        statistics.StatisticsError: an arm without measurements.
        ValueError: an unknown noise rule.
    """
    if noise_rule not in NOISE_RULES:
        raise ValueError(f"noise_rule must be one of {list(NOISE_RULES)}; got {noise_rule!r}")
    n = min(len(plan_us), len(default_us))
    if noise_rule == "paired" and n < 2 and not final:
        base = statistics.median(default_us)
        return Verdict(keep=False, plan_us=statistics.median(plan_us), default_us=base, gain_us=base - statistics.median(plan_us),
                       needed_us=min_gain * base, text=f"undecided after {n} pair: the paired rule needs two", decided=False)
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
    text = (f"gain {gain / 1e3:.1f} ms (median of the defaults {base / 1e3:.1f} ms - median of the plan "
            f"{plan / 1e3:.1f} ms, {len(default_us)} and {len(plan_us)} iterations), needed > {need / 1e3:.1f} ms ("
            + (f"{floor}; one iteration per arm gives no noise estimate: it alone decided)" if single else
               f"the larger of half the wider arm's range {spread / 1e3:.1f} ms and {floor})"
               if noise_rule == "half-range" else f"{floor})"))
    return Verdict(keep=gain > need, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text)


def _paired(plan_us: list[float], default_us: list[float], *, min_gain: float, n_looks: int, final: bool) -> Verdict:
    """The ``paired`` rule at one look (module docstring); ``n_looks >= 1``."""
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
    line = (f"{stat}, needed > {need / 1e3:.1f} ms (the larger of its {level} bound {bound / 1e3:.1f} ms and "
            f"the minimum gain {floor / 1e3:.1f} ms)")
    keep = gain > need
    if keep or final:
        return Verdict(keep=keep, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=line)
    if gain + bound < floor:  # futility: even the upper end of the bound misses the minimum gain
        text = f"{line}; stopped: even its upper bound {(gain + bound) / 1e3:.1f} ms is below the minimum gain"
        return Verdict(keep=False, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text)
    text = (f"undecided after {n} pairs: {stat}, needed > {need / 1e3:.1f} ms, its upper bound "
            f"{(gain + bound) / 1e3:.1f} ms still reaches the minimum gain {floor / 1e3:.1f} ms")
    return Verdict(keep=False, plan_us=plan, default_us=base, gain_us=gain, needed_us=need, text=text, decided=False)


def sequential_verdict(plan_us: list[float], default_us: list[float], *, min_gain: float, noise_rule: NoiseRule,
                       first: int, cap: int) -> Verdict | None:
    """The verdict of sequential verification (module docstring) once both arms hold a look's
    number of measurements (``looks(first, cap)``), None between looks; at a look that leaves the
    plan undecided, a ``Verdict`` with ``decided`` False (more pairs are due). Under ``half-range`` and ``none`` the only look is ``first``.

    Raises:
        ValueError: as ``looks``; an unknown noise rule.
    """
    points = looks(first, cap) if noise_rule == "paired" else (first,)
    n = min(len(plan_us), len(default_us))
    if len(plan_us) != len(default_us) or n not in points:
        return None
    v = verdict(plan_us, default_us, min_gain=min_gain, noise_rule=noise_rule, n_looks=len(points),
                final=n == points[-1])
    return v
