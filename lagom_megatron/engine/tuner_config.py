"""The tuner's settings (``Tuner.Config``): the flags ``--lagom-warmup-iters``, ``--lagom-verify-iters``,
``--lagom-verify-max-iters`` and ``--lagom-method`` and the verification rule's parameters, checked
when built (``tuner.py`` runs the lifecycle they configure)."""

from __future__ import annotations

from dataclasses import dataclass

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.search import METHODS
from lagom_megatron.engine.verify import NOISE_RULES, NoiseRule, looks


@dataclass(kw_only=True, slots=True)
class TunerConfig:
    """``Tuner.Config``: the tuner's settings (``--lagom-warmup-iters``, ``--lagom-verify-iters``,
    ``--lagom-verify-max-iters``, ``--lagom-method``).

    Raises:
        ValueError: a count below 1, a cap below ``verify_iters``, an unknown method or noise rule,
            a ``min_gain`` outside [0, 1).
    """

    warmup_iters: int = 1
    """Untimed iterations under defaults before profiling (iteration 0 is always one: the
    allocator and communicators warm up there)."""
    verify_iters: int = 3
    """Timed iterations per arm (plan, defaults) at verification's first look."""
    verify_max_iters: int | None = None
    """Most timed iterations per arm: an undecided verdict (``paired`` rule) doubles the pairs up
    to this cap (``verify.looks``); None = ``verify_iters`` (one look, no extension)."""
    method: str = "priority"
    """Searcher: priority, autoccl, exhaustive, nccl-default."""
    min_gain: float = 0.002
    """Smallest relative gain (fraction of the default median) a plan must show to be kept."""
    noise_rule: NoiseRule = "paired"
    """paired: the mean paired gain must exceed its 95% Student-t bound; half-range: the
    medians' gain must exceed half the larger per-arm range (max - min); none: ``min_gain``
    alone decides (``verify.verdict``)."""
    probe_configs: list[CommConfig] | None = None
    """Probe configs applied to all sites; None = ``rules.probe_configs()``."""

    def __post_init__(self) -> None:
        if self.warmup_iters < 1:
            raise ValueError(f"lagom.warmup_iters must be >= 1 (iteration 0 is never timed); got {self.warmup_iters}")
        if self.verify_iters < 1:
            raise ValueError(f"lagom.verify_iters must be >= 1; got {self.verify_iters}")
        if self.verify_max_iters is not None and self.verify_max_iters < self.verify_iters:
            raise ValueError(f"lagom.verify_max_iters must be >= verify_iters ({self.verify_iters}) or None; "
                             f"got {self.verify_max_iters}")
        if self.method not in METHODS:
            raise ValueError(f"lagom.method must be one of {list(METHODS)}; got {self.method!r}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"lagom.min_gain must be in [0, 1); got {self.min_gain}")
        if self.noise_rule not in NOISE_RULES:
            raise ValueError(f"lagom.noise_rule must be one of {list(NOISE_RULES)}; got {self.noise_rule!r}")

    def looks(self) -> tuple[int, ...]:
        """Pairs (plan, defaults) after which verification takes its verdict (``verify.looks``):
        one look at ``verify_iters`` unless the rule is ``paired`` and ``verify_max_iters`` is larger."""
        cap = self.verify_max_iters or self.verify_iters
        return looks(self.verify_iters, cap) if self.noise_rule == "paired" else (self.verify_iters,)
