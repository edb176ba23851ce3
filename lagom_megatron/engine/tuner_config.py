"""The tuner's settings (``Tuner.Config``), checked when built."""

from __future__ import annotations

from dataclasses import dataclass

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.search import METHODS
from lagom_megatron.engine.verify import NOISE_RULES, NoiseRule, looks


@dataclass(kw_only=True, slots=True)
class TunerConfig:
    """``Tuner.Config``: the ``--lagom-*`` flags (warm-up, verify, verify-max iterations, method) and the
    verification rule; ValueError on a count < 1, a cap < ``verify_iters``, unknown method or rule, bad ``min_gain``."""

    warmup_iters: int = 1
    """Untimed iterations under defaults before profiling (>= 1: iteration 0 warms allocator and communicators)."""
    verify_iters: int = 3
    """Timed iterations per arm (plan, defaults) at verification's first look."""
    verify_max_iters: int | None = None
    """Most timed iterations per arm while undecided (``paired``); None = ``verify_iters``."""
    method: str = "priority"
    min_gain: float = 0.002
    """Smallest relative gain (fraction of the default median) a plan must show to be kept."""
    noise_rule: NoiseRule = "paired"
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
        """Pair counts of the verdicts (``verify.looks``); one unless ``paired`` with larger ``verify_max_iters``."""
        cap = self.verify_max_iters or self.verify_iters
        return looks(self.verify_iters, cap) if self.noise_rule == "paired" else (self.verify_iters,)
