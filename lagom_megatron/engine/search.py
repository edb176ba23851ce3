"""``search()``: the entry point of every search method; importing ``priority`` and ``baselines`` registers them."""

from __future__ import annotations

from typing import Any

from lagom_megatron.engine import baselines, priority  # noqa: F401  (importing registers the searchers)
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.knobs import KnobRules
from lagom_megatron.engine.problem import SEARCHERS, SearchProblem, SearchResult
from lagom_megatron.engine.profile import Profile

METHODS: tuple[str, ...] = ("priority", "autoccl", "exhaustive", "nccl-default")
LAGOM_METHODS = tuple(m for m in METHODS if m != "exhaustive")
"""Values of ``--lagom-method`` and a preset's ``lagom_method`` (``exhaustive`` is for small offline instances only)."""


def search(
    profile: Profile | SearchProblem,
    *,
    rules: KnobRules | None = None,
    method: str = "priority",
    model: CostModel | None = None,
    **options: Any,
) -> SearchResult:
    """A plan for a Profile (needs ``rules``; fitted unless ``model``) or a SearchProblem; ValueError if it cannot."""
    if method not in SEARCHERS:
        raise ValueError(f"method must be one of {sorted(SEARCHERS)}; got {method!r}")
    if isinstance(profile, SearchProblem):
        problem = profile
    elif rules is None:
        raise ValueError("search: rules (the mechanism's knob rules) are required to search a profile")
    else:
        problem = SearchProblem.from_profile(profile, rules=rules, model=model)
    return SEARCHERS[method](problem, **options)
