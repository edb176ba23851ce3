"""Sequential verification (``engine/verify.py``): Student-t quantiles against the published table,
the looks, and the three outcomes of a look (keep, stop for futility, go on), in the verdict and in
the tuner's schedule."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.tuner import Phase, Tuner
from lagom_megatron.engine.verify import T_95, looks, sequential_verdict, t_quantile, verdict
from tests.engine.test_tuner import PROBES, _measure, _Rules, fake_engine  # noqa: F401  (fixture)

# two-sided t-table values (one-sided p), e.g. NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.2
PUBLISHED = [
    ((0.975, 1), 12.706),
    ((0.975, 2), 4.303),
    ((0.95, 3), 2.353),
    ((0.995, 3), 5.841),
    ((0.99, 5), 3.365),
    ((0.995, 5), 4.032),
    ((0.975, 10), 2.228),
    ((0.9995, 10), 4.587),
    ((0.99, 20), 2.528),
    ((0.995, 30), 2.750),
    ((0.975, 100), 1.984),
]


@pytest.mark.parametrize("args,value", PUBLISHED)
def test_t_quantile_matches_the_published_table(args, value):
    p, dof = args
    tolerance = 0.01 if dof < 10 else 0.001  # Cornish-Fisher to 1/dof^4: looser at few degrees of freedom
    assert t_quantile(p, dof) == pytest.approx(value, rel=tolerance)


def test_t_quantile_agrees_with_the_95_percent_table_and_refuses_bad_input():
    for dof in range(3, len(T_95) + 1):
        assert t_quantile(0.95, dof) == pytest.approx(T_95[dof - 1], rel=0.005)
    with pytest.raises(ValueError, match="p=0.4"):
        t_quantile(0.4, 5)
    with pytest.raises(ValueError, match="dof=0"):
        t_quantile(0.95, 0)


def test_looks_double_to_the_cap():
    assert looks(20, 160) == (20, 40, 80, 160)
    assert looks(20, 100) == (20, 40, 80, 100)
    assert looks(4, 4) == (4,)
    with pytest.raises(ValueError, match="first=8, cap=4"):
        looks(8, 4)


def _arms(n, gain_us, spread_us):
    """n pairs: defaults 10 ms, the plan ``gain_us`` faster, its k-th pair off by +-``spread_us``."""
    defaults = [10_000.0] * n
    plan = [10_000.0 - gain_us + spread_us * (-1) ** k for k in range(n)]
    return plan, defaults


def test_one_look_is_the_fixed_count_rule():
    plan, defaults = _arms(8, 50.0, 40.0)
    one = sequential_verdict(plan, defaults, min_gain=0.002, noise_rule="paired", first=8, cap=8)
    assert one == verdict(plan, defaults, min_gain=0.002, noise_rule="paired")
    assert "95% bound" in one.text and one.decided


def test_a_look_keeps_stops_or_goes_on():
    kw = dict(min_gain=0.002, noise_rule="paired", first=2, cap=8)  # looks 2, 4, 8: each at 1 - 0.05/3
    assert sequential_verdict(*_arms(3, 50.0, 40.0), **kw) is None  # between looks
    # mean 50 us, sd 46.2 us over 4 pairs: bound t(0.98333, 3) 3.73 x 46.2 / 2 = 86 us > 50: undecided,
    # and its upper end 136 us still reaches the minimum gain 20 us
    v = sequential_verdict(*_arms(4, 50.0, 40.0), **kw)
    assert not v.decided and not v.keep and "undecided after 4 pairs" in v.text
    assert v.needed_us == pytest.approx(3.7327 * 46.188 / 2, rel=2e-3)
    # 8 pairs: sd 42.8, bound 2.642 x 42.8 / sqrt(8) = 40 us < 50: kept, at the split level
    v = sequential_verdict(*_arms(8, 50.0, 40.0), **kw)
    assert v.decided and v.keep and "98.33% (95% over 3 looks)" in v.text
    # a plan 1% slower: at 4 pairs even the upper end (-100 + 86 us) is below 20 us: stopped
    v = sequential_verdict(*_arms(4, -100.0, 40.0), **kw)
    assert v.decided and not v.keep and "stopped" in v.text
    # a marginal plan at the cap is rejected
    v = sequential_verdict(*_arms(8, 30.0, 40.0), **kw)
    assert v.decided and not v.keep


def _verify(t, gain_us, spread_us):
    """Runs ``t`` to its verdict with the plan ``gain_us`` faster and its k-th plan iteration off by
    +-``spread_us``; returns the verify step kinds."""
    kinds, k, it = [], 0, 0
    while not t.done:
        step = t.start_iteration(it)
        m = _measure(step, plan_us=10_000.0, default_us=10_000.0)
        if step.kind == "verify-plan":
            m = type(m)(
                iteration=m.iteration,
                iteration_us=10_000.0 - gain_us + spread_us * (-1) ** k,
                sites=m.sites,
                samples=m.samples,
            )
            k += 1
        if step.kind.startswith("verify"):
            kinds.append(step.kind)
        t.finish_iteration(m)
        it += 1
    return kinds


def _tuner(**cfg):
    cfg = {"warmup_iters": 1, "verify_iters": 3, **cfg}  # the counts these tests were written for
    return Tuner(Tuner.Config(probe_configs=PROBES, **cfg), rules=_Rules(), fingerprint={"model": "m"})


def test_the_tuner_extends_an_undecided_verdict_to_the_cap(fake_engine):
    t = _tuner(verify_iters=2, verify_max_iters=8)
    assert t.verify_looks == (2, 4, 8)
    assert t.total_iters == 1 + 1 + 1 + len(PROBES) + 1 + 2 * 8
    kinds = _verify(t, 50.0, 40.0)
    assert kinds.count("verify-plan") == 8 and t.phase is Phase.APPLIED, t.reason
    said = [m for _, _, m in t.events]
    assert any("up to 8 while undecided" in m for m in said)
    assert any("undecided after 2 pairs" in m and "on to 4 iterations each" in m for m in said)
    assert any("undecided after 4 pairs" in m and "on to 8 iterations each" in m for m in said)


def test_the_tuner_stops_early_for_a_slower_plan_and_for_a_clear_gain(fake_engine):
    t = _tuner(verify_iters=2, verify_max_iters=8)
    assert _verify(t, -100.0, 40.0).count("verify-plan") == 4 and t.phase is Phase.FELL_BACK
    assert "stopped" in t.reason
    t = _tuner(verify_iters=2, verify_max_iters=8)
    assert _verify(t, 1000.0, 10.0).count("verify-plan") == 2 and t.phase is Phase.APPLIED


def test_other_rules_take_one_look_and_a_cap_below_the_first_look_is_refused():
    assert _tuner(verify_iters=3, verify_max_iters=12, noise_rule="half-range").verify_looks == (3,)
    assert _tuner(verify_iters=3).verify_looks == (3,)
    with pytest.raises(ValueError, match="verify_max_iters must be >= verify_iters \\(3\\) or None; got 2"):
        Tuner.Config(verify_iters=3, verify_max_iters=2)
