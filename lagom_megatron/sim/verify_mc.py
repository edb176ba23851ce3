"""A Monte Carlo of lagom's verification verdict at the simulator's noise: how often a plan with a
true relative gain is kept (``engine.verify.verdict``, paired rule) for a number of verification
iterations per arm. It sets the GPU presets' ``lagom_verify_iters`` (``choose_iters``) and the
table in docs/simulator.md (``python -m lagom_megatron.sim.verify_mc`` prints it).

The noise model is the simulator's: independent iterations, each scaled by a normal factor of
relative standard deviation ``sigma`` (``sigma_iteration`` in ``sim.constants``; the per-kernel
noise averages out over an iteration's thousands of kernels). Arms alternate as the tuner runs
them (defaults, plan, defaults, ...), and the rule is applied with the tuner's ``min_gain``.
"""

from __future__ import annotations

import random

from lagom_megatron.engine.verify import verdict

GAINS = (0.0, 0.005, 0.01, 0.02)
"""True relative gains tabulated: 0 gives the false-accept rate."""
CANDIDATE_ITERS = (4, 8, 12, 16, 20, 24, 32)
MIN_GAIN = 0.002
"""``Tuner.Config.min_gain`` default."""
TARGET_KEEP_1PCT = 0.90
"""The presets' count keeps a real 1% gain at least this often."""


def accept_rate(gain: float, n: int, *, sigma: float, trials: int = 2000, seed: int = 0, min_gain: float = MIN_GAIN) -> float:
    """Share of ``trials`` in which ``verdict`` keeps a plan of true relative ``gain`` with ``n``
    iterations per arm at relative noise ``sigma``.

    Raises:
        ValueError: ``n < 1``, ``sigma < 0`` or ``trials < 1``.
    """
    if n < 1 or sigma < 0 or trials < 1:
        raise ValueError(f"need n >= 1, sigma >= 0, trials >= 1; got n={n}, sigma={sigma}, trials={trials}")
    rng = random.Random(seed)
    kept = 0
    for _ in range(trials):
        defaults = [1000.0 * (1.0 + rng.gauss(0.0, sigma)) for _ in range(n)]
        plan = [1000.0 * (1.0 - gain) * (1.0 + rng.gauss(0.0, sigma)) for _ in range(n)]
        kept += verdict(plan, defaults, min_gain=min_gain, noise_rule="paired").keep
    return kept / trials


def table(sigma: float, *, iters: tuple[int, ...] = CANDIDATE_ITERS, trials: int = 2000) -> dict[int, dict[float, float]]:
    """``{n: {gain: accept rate}}`` for ``GAINS`` (module docstring)."""
    return {n: {g: accept_rate(g, n, sigma=sigma, trials=trials, seed=n) for g in GAINS} for n in iters}


def choose_iters(sigma: float, *, trials: int = 2000) -> int:
    """The fewest iterations per arm of ``CANDIDATE_ITERS`` that keep a real 1% gain at least
    ``TARGET_KEEP_1PCT`` of the time at noise ``sigma`` (the largest candidate if none does)."""
    for n in CANDIDATE_ITERS:
        if accept_rate(0.01, n, sigma=sigma, trials=trials, seed=n) >= TARGET_KEEP_1PCT:
            return n
    return CANDIDATE_ITERS[-1]


def main() -> None:
    """Prints the table at the simulator's noise and the count it chooses."""
    from lagom_megatron.sim.constants import get

    sigma = get("sigma_iteration")
    print(f"paired verdict, iteration noise {sigma:.1%}, min_gain {MIN_GAIN:.1%}: share of plans kept")
    print("iters/arm " + " ".join(f"{'gain ' + format(g, '.1%'):>10s}" for g in GAINS))
    for n, row in table(sigma).items():
        print(f"{n:9d} " + " ".join(f"{row[g]:10.3f}" for g in GAINS))
    print(f"chosen: {choose_iters(sigma)} iterations per arm (keeps a 1% gain >= {TARGET_KEEP_1PCT:.0%} of the time)")


if __name__ == "__main__":
    main()
