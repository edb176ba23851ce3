"""The pre-flight rules' data types: ``RunShape`` (what a rule looks at) and ``Finding`` (what it reports)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Level = Literal["error", "warning"]


def flag(dest: str) -> str:
    """``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + dest.replace("_", "-")


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of a rule: an ``error`` stops the launch; ``why`` names where the requirement comes from."""

    level: Level
    rule: str
    what: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.level}: [{self.rule}] {self.what}\n    why: {self.why}\n    fix: {self.fix}"


@dataclass(frozen=True, slots=True)
class RunShape:
    """What the rules look at. None sizes are unknown (rules needing them skip); ``sm_arch`` is compute capability
    x 10 (None: pre-Blackwell); ``local``: on this machine (file, port and library rules apply); ``megatron_lm``: a
    line for Megatron-LM's own ``pretrain_gpt.py``, whose loop is not lagom's without ``--lagom``; ``defaults``: the
    parser's defaults, when ``args`` holds them (a value equal to its default need not be the user's)."""

    args: Mapping[str, Any]
    environ: Mapping[str, str]
    world_size: int | None
    gpus_per_node: int | None
    sm_arch: int | None
    nccl_version: str | None
    backend: str
    preset_env: Mapping[str, str] = field(default_factory=dict)
    local: bool = False
    megatron_lm: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    cluster: Any = None
    """The target cluster: a ``ClusterSpec``, a dict for a GPU without a cluster file, or None."""

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
