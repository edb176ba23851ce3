"""A Monte Carlo of lagom's verification verdict at the simulator's noise: how often a plan with a
true relative gain is kept, and after how many pairs, for a first look and a cap of iterations per
arm (``engine.verify.sequential_verdict``, paired rule; a cap equal to the first look is the
fixed-count rule). It sets the GPU presets' ``lagom_verify_iters`` (``choose_iters``) and
``lagom_verify_max_iters`` (``choose_cap``) and the table in docs/simulator.md
(``python -m lagom_megatron.sim.verify_mc`` prints it).

The noise model is the simulator's: independent iterations, each scaled by a normal factor of
relative standard deviation ``sigma`` (``sigma_iteration`` in ``sim.constants``; the per-kernel
noise averages out over an iteration's thousands of kernels). Arms alternate as the tuner runs
them (defaults, plan, defaults, ...), and the rule is applied with the tuner's ``min_gain``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lagom_megatron.engine.verify import looks, sequential_verdict

GAINS = (-0.01, 0.0, 0.005, 0.01, 0.02)
"""True relative gains tabulated: 0 gives the false-accept rate, -1% how soon a slower plan stops."""
CANDIDATE_ITERS = (4, 8, 12, 16, 20, 24, 32)
"""First looks ``choose_iters`` tries."""
CANDIDATE_CAPS = (1, 2, 4, 8, 16, 32)
"""Caps ``choose_cap`` tries, as multiples of the first look (the looks double: ``verify.looks``)."""
MIN_GAIN = 0.002
"""``Tuner.Config.min_gain`` default."""
TARGET_KEEP_1PCT = 0.90
"""The presets' first look keeps a real 1% gain at least this often (without extending)."""
TARGET_KEEP_HALF_PCT = 0.95
"""The presets' cap keeps a real 0.5% gain at least this often."""


@dataclass(frozen=True, slots=True)
class Rates:
    """Outcome of ``trials`` verifications of one plan: ``kept`` (share kept), ``mean_pairs``
    (iterations per arm when the verdict came, averaged)."""

    kept: float
    mean_pairs: float


def rates(gain: float, first: int, cap: int | None = None, *, sigma: float, trials: int = 2000, seed: int = 0,
          min_gain: float = MIN_GAIN) -> Rates:
    """Verifies a plan of true relative ``gain`` ``trials`` times at relative noise ``sigma``, the
    first look at ``first`` pairs and at most ``cap`` (None = ``first``: one look).

    Raises:
        ValueError: ``first < 1``, ``cap < first``, ``sigma < 0`` or ``trials < 1``.
    """
    cap = first if cap is None else cap
    if first < 1 or cap < first or sigma < 0 or trials < 1:
        raise ValueError(f"need 1 <= first <= cap, sigma >= 0, trials >= 1; got first={first}, cap={cap}, "
                         f"sigma={sigma}, trials={trials}")
    points = looks(first, cap)
    rng = random.Random(seed)
    kept = pairs = 0
    for _ in range(trials):
        defaults: list[float] = []
        plan: list[float] = []
        for n in points:
            while len(defaults) < n:  # the tuner's order: a default iteration, then a plan one
                defaults.append(1000.0 * (1.0 + rng.gauss(0.0, sigma)))
                plan.append(1000.0 * (1.0 - gain) * (1.0 + rng.gauss(0.0, sigma)))
            v = sequential_verdict(plan, defaults, min_gain=min_gain, noise_rule="paired", first=first, cap=cap)
            if v is not None and v.decided:
                kept += v.keep
                pairs += n
                break
    return Rates(kept=kept / trials, mean_pairs=pairs / trials)


def accept_rate(gain: float, n: int, *, sigma: float, trials: int = 2000, seed: int = 0, min_gain: float = MIN_GAIN,
                cap: int | None = None) -> float:
    """Share of ``trials`` in which verification keeps a plan of true relative ``gain`` with ``n``
    iterations per arm at the first look (and at most ``cap``) at relative noise ``sigma``.

    Raises:
        ValueError: ``n < 1``, ``sigma < 0`` or ``trials < 1`` (``n >= 1`` is named), ``cap < n``.
    """
    if n < 1 or sigma < 0 or trials < 1:
        raise ValueError(f"need n >= 1, sigma >= 0, trials >= 1; got n={n}, sigma={sigma}, trials={trials}")
    return rates(gain, n, cap, sigma=sigma, trials=trials, seed=seed, min_gain=min_gain).kept


def table(sigma: float, *, first: int, caps: tuple[int, ...], trials: int = 2000) -> dict[int, dict[float, Rates]]:
    """``{cap: {gain: Rates}}`` for ``GAINS`` (module docstring), first look ``first``."""
    return {c: {g: rates(g, first, c, sigma=sigma, trials=trials, seed=c) for g in GAINS} for c in caps}


def choose_iters(sigma: float, *, trials: int = 2000) -> int:
    """The fewest iterations per arm of ``CANDIDATE_ITERS`` that keep a real 1% gain at least
    ``TARGET_KEEP_1PCT`` of the time at noise ``sigma`` with one look (the largest candidate if
    none does)."""
    for n in CANDIDATE_ITERS:
        if accept_rate(0.01, n, sigma=sigma, trials=trials, seed=n) >= TARGET_KEEP_1PCT:
            return n
    return CANDIDATE_ITERS[-1]


def choose_cap(sigma: float, first: int, *, trials: int = 2000) -> int:
    """The smallest cap ``first x CANDIDATE_CAPS`` that keeps a real 0.5% gain at least
    ``TARGET_KEEP_HALF_PCT`` of the time at noise ``sigma`` (the largest candidate if none does)."""
    for m in CANDIDATE_CAPS:
        if rates(0.005, first, first * m, sigma=sigma, trials=trials, seed=m).kept >= TARGET_KEEP_HALF_PCT:
            return first * m
    return first * CANDIDATE_CAPS[-1]


def main() -> None:
    """Prints the table at the simulator's noise and the counts it chooses."""
    from lagom_megatron.sim.constants import get

    sigma = get("sigma_iteration")
    first = choose_iters(sigma)
    print(f"paired verdict, iteration noise {sigma:.1%}, min_gain {MIN_GAIN:.1%}, first look {first} iterations "
          f"per arm: share of plans kept (mean iterations per arm at the verdict)")
    print("cap/arm " + " ".join(f"{'gain ' + format(g, '.1%'):>15s}" for g in GAINS))
    for cap, row in table(sigma, first=first, caps=tuple(first * m for m in CANDIDATE_CAPS)).items():
        print(f"{cap:7d} " + " ".join(f"{row[g].kept:8.3f} ({row[g].mean_pairs:4.0f})" for g in GAINS))
    print(f"chosen: first look {first} iterations per arm (keeps a 1% gain >= {TARGET_KEEP_1PCT:.0%} of the time), "
          f"cap {choose_cap(sigma, first)} (keeps a 0.5% gain >= {TARGET_KEEP_HALF_PCT:.0%} of the time)")


if __name__ == "__main__":
    main()
