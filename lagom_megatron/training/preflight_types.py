"""The data types of the pre-flight rules (``lagom doctor`` and training): ``RunShape`` (what a rule looks at) and ``Finding`` (what it reports).

The rules are in ``lagom_megatron.training.preflight_rules`` (layout and overlap) and
``lagom_megatron.training.preflight_env`` (CUDA and NCCL environment) and beside them;
``lagom_megatron.training.preflight`` builds the ``RunShape`` and runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

Level = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of a rule.

    Attributes:
        level: "error" stops the launch; "warning" is printed only.
        rule: short rule id, e.g. ``world-size`` or ``nccl-env``.
        what: one line: what is wrong, with the values seen.
        why: what would happen and where the requirement comes from.
        fix: what to change.
    """

    level: Level
    rule: str
    what: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.level}: [{self.rule}] {self.what}\n    why: {self.why}\n    fix: {self.fix}"


@dataclass(frozen=True, slots=True)
class RunShape:
    """What the rules look at, normalised from a preset, a namespace or a dict.

    Attributes:
        args: argparse destinations -> values (Megatron-LM names).
        environ: environment of the ranks.
        world_size: ranks in the job; None = unknown (rules that need it are skipped).
        gpus_per_node: GPUs (ranks) per node; None = unknown.
        sm_arch: compute capability x 10 (90 = Hopper); None = unknown, treated as pre-Blackwell.
        nccl_version: e.g. "2.27.3"; None = unknown.
        backend: "nccl" or "gloo" (CPU: the CUDA and NCCL rules do not apply).
        preset_env: the preset's ``env`` section (empty without a preset), so that a fix can say
            whether the preset already sets a variable.
        local: the run starts on this machine (training, or the doctor without ``--cluster``):
            the rules that look at files, ports and installed libraries apply.
    """

    args: Mapping[str, Any]
    environ: Mapping[str, str]
    world_size: int | None
    gpus_per_node: int | None
    sm_arch: int | None
    nccl_version: str | None
    backend: str
    preset_env: Mapping[str, str] = field(default_factory=dict)
    local: bool = False

    def get(self, name: str, default: Any = None) -> Any:
        value = self.args.get(name, default)
        return default if value is None else value

    @property
    def tp(self) -> int:
        return int(self.get("tensor_model_parallel_size", 1))

    @property
    def pp(self) -> int:
        return int(self.get("pipeline_model_parallel_size", 1))

    @property
    def cp(self) -> int:
        return int(self.get("context_parallel_size", 1))

    @property
    def ep(self) -> int:
        return int(self.get("expert_model_parallel_size", 1))

    @property
    def fsdp(self) -> bool:
        return bool(self.get("use_torch_fsdp2", False) or self.get("use_megatron_fsdp", False))

    @property
    def lagom(self) -> bool:
        return bool(self.get("lagom", False))
