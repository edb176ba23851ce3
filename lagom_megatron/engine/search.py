"""``search()``: the entry point of every search method, and the list of methods.

The searchers live in ``priority.py`` (Lagom's priority search) and ``baselines.py``
(``nccl-default``, ``autoccl``, ``exhaustive``); importing them registers them by name
(``problem.register``). Their shared coordinate-descent steps are in ``descent.py``.
"""

from __future__ import annotations

from typing import Any

from lagom_megatron.engine import baselines, priority  # noqa: F401  (importing registers the searchers)
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.knobs import KnobRules
from lagom_megatron.engine.problem import SEARCHERS, SearchProblem, SearchResult
from lagom_megatron.engine.profile import Profile

METHODS: tuple[str, ...] = ("priority", "autoccl", "exhaustive", "nccl-default")
"""Search methods accepted by ``search`` and ``lagom search --method`` (every registered searcher)."""


def search(profile: "Profile | SearchProblem", *, rules: KnobRules | None = None, method: str = "priority",
           model: CostModel | None = None, **options: Any) -> SearchResult:
    """Searches a plan with ``method`` for a profile (or a prepared ``SearchProblem``).

    Args:
        profile: a Profile (the cost model is fitted on ``rules.cluster`` unless ``model`` is
            given) or a SearchProblem (which carries its own rules).
        rules: the knob rules of the mechanism that will apply the plan (``knobs.KnobRules``,
            e.g. ``lagom_megatron.nccl.rules.NcclRules``); required with a Profile.
        method: priority, autoccl, exhaustive or nccl-default.
        model: an already fitted CostModel for the profile's sites.
        options: passed to the searcher (``rounds``, ``limit`` for exhaustive).

    Returns:
        SearchResult(plan, stats); stats has model_evaluations, wall_time_s,
        predicted_iteration_us, default_iteration_us, n_sites.

    Raises:
        ValueError: unknown method (names it and the allowed set), a Profile without rules, or a
            searcher's refusal (exhaustive above its size limit).
    """
    if method not in SEARCHERS:
        raise ValueError(f"method must be one of {sorted(SEARCHERS)}; got {method!r}")
    if isinstance(profile, SearchProblem):
        problem = profile
    elif rules is None:
        raise ValueError("search: rules (the mechanism's knob rules) are required to search a profile")
    else:
        problem = SearchProblem.from_profile(profile, rules=rules, model=model)
    return SEARCHERS[method](problem, **options)
