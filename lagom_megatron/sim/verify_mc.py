"""Monte Carlo of lagom's paired verification at the simulator's noise; sets the presets' verify counts."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from lagom_megatron.engine.tuner import DEFAULT_CONFIG
from lagom_megatron.engine.verify import looks, sequential_verdict

GAINS = (-0.01, 0.0, 0.005, 0.01, 0.02)
"""True relative gains tabulated: 0 gives the false-accept rate."""
CANDIDATE_ITERS = (4, 8, 12, 16, 20, 24, 32)
CANDIDATE_CAPS = (1, 2, 4, 8, 16, 32)
MIN_GAIN = DEFAULT_CONFIG.min_gain
"""``Tuner.Config.min_gain`` default."""
TARGET_KEEP_1PCT = 0.90
"""Share of a real 1% gain the presets' first look keeps."""
TARGET_KEEP_HALF_PCT = 0.95
"""Share of a real 0.5% gain the presets' cap keeps."""


@dataclass(frozen=True, slots=True)
class Rates:
    """``trials`` verifications of one plan: share ``kept``, mean iterations per arm at the verdict."""

    kept: float
    mean_pairs: float


def rates(
    gain: float,
    first: int,
    cap: int | None = None,
    *,
    sigma: float,
    trials: int = 2000,
    seed: int = 0,
    min_gain: float = MIN_GAIN,
) -> Rates:
    """Verifies a plan of true ``gain`` ``trials`` times (cap None: ``first``); ValueError for bad counts or sigma."""
    cap = first if cap is None else cap
    if first < 1 or cap < first or sigma < 0 or trials < 1:
        raise ValueError(
            f"need 1 <= first <= cap, sigma >= 0, trials >= 1; got first={first}, cap={cap}, "
            f"sigma={sigma}, trials={trials}"
        )
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


def accept_rate(
    gain: float,
    n: int,
    *,
    sigma: float,
    trials: int = 2000,
    seed: int = 0,
    min_gain: float = MIN_GAIN,
    cap: int | None = None,
) -> float:
    """Share of ``trials`` keeping a plan of true ``gain`` with ``n`` iterations per arm; ValueError as ``rates``."""
    if n < 1 or sigma < 0 or trials < 1:
        raise ValueError(f"need n >= 1, sigma >= 0, trials >= 1; got n={n}, sigma={sigma}, trials={trials}")
    return rates(gain, n, cap, sigma=sigma, trials=trials, seed=seed, min_gain=min_gain).kept


def table(sigma: float, *, first: int, caps: tuple[int, ...], trials: int = 2000) -> dict[int, dict[float, Rates]]:
    return {c: {g: rates(g, first, c, sigma=sigma, trials=trials, seed=c) for g in GAINS} for c in caps}


def choose_iters(sigma: float, *, trials: int = 2000) -> int:
    """The fewest ``CANDIDATE_ITERS`` keeping a 1% gain ``TARGET_KEEP_1PCT`` of the time in one look (else the most)."""
    for n in CANDIDATE_ITERS:
        if accept_rate(0.01, n, sigma=sigma, trials=trials, seed=n) >= TARGET_KEEP_1PCT:
            return n
    return CANDIDATE_ITERS[-1]


def choose_cap(sigma: float, first: int, *, trials: int = 2000) -> int:
    """The smallest cap ``first x CANDIDATE_CAPS`` keeping a 0.5% gain ``TARGET_KEEP_HALF_PCT`` of the time."""
    for m in CANDIDATE_CAPS:
        if rates(0.005, first, first * m, sigma=sigma, trials=trials, seed=m).kept >= TARGET_KEEP_HALF_PCT:
            return first * m
    return first * CANDIDATE_CAPS[-1]


def _trials(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a whole number of trials, 1 or more")
    return n


def main(argv: list[str] | None = None) -> None:
    """Prints the verification table of docs/simulator.md; ``--help`` prints the usage and the run time."""
    from lagom_megatron.sim.constants import get

    parser = argparse.ArgumentParser(
        prog="python -m lagom_megatron.sim.verify_mc",
        description="Monte Carlo of the paired verification at the simulator's iteration noise: prints the "
        "share of plans kept per cap and true gain, and the first look and cap the presets use. "
        "A run at the default 2000 trials takes about 12 s of one idle CPU core (time grows in proportion "
        "to --trials, and on a busy machine) and prints nothing until the table is done.",
    )
    parser.add_argument(
        "--trials", type=_trials, default=2000, help="verifications simulated per table cell (default: 2000)"
    )
    trials = parser.parse_args(argv).trials
    sigma = get("sigma_iteration")
    first = choose_iters(sigma, trials=trials)
    print(
        f"paired verdict, iteration noise {sigma:.1%}, min_gain {MIN_GAIN:.1%}, first look {first} iterations "
        f"per arm: share of plans kept (mean iterations per arm at the verdict)"
    )
    print("cap/arm " + " ".join(f"{'gain ' + format(g, '.1%'):>15s}" for g in GAINS))
    caps = tuple(first * m for m in CANDIDATE_CAPS)
    for cap, row in table(sigma, first=first, caps=caps, trials=trials).items():
        print(f"{cap:7d} " + " ".join(f"{row[g].kept:8.3f} ({row[g].mean_pairs:4.0f})" for g in GAINS))
    print(
        f"chosen: first look {first} iterations per arm (keeps a 1% gain >= {TARGET_KEEP_1PCT:.0%} of the time), "
        f"cap {choose_cap(sigma, first, trials=trials)} (keeps a 0.5% gain >= {TARGET_KEEP_HALF_PCT:.0%} of the time)"
    )


if __name__ == "__main__":
    main()
