"""torch's two NCCL process-group engines, and what lagom needs of each.

torch 2.14 added ``ProcessGroupNCCL2`` ("nccl2", built on the torchcomms engine) beside the legacy
``ProcessGroupNCCL``; which one ``backend="nccl"`` builds is decided once per process, when "nccl" is
first used (``Backend._ensure_backend_registered``, ``distributed_c10d.py:631-663`` @2.15.0), by
``TORCH_DIST_USE_NCCL2``: torch 2.14 builds nccl2 only when it is ``1`` (``:829-841`` @2.14.1), torch 2.15
builds nccl2 unless it is ``0`` (``:961-984`` @2.15.0). ``"nccl-legacy"`` names the old class explicitly.

Both classes take the same ``ProcessGroupNCCL.Options`` (``_nccl2_options``, ``:808-818`` @2.15.0) and bind
every call lagom makes on a backend: ``options``, ``register_mem_pool(pool, symm)``,
``_enable_collectives_timing`` and ``Work._get_duration`` (``nccl2/ProcessGroupNCCL.hpp:289, 337`` and
``nccl2/WorkNCCL.hpp:96`` @2.15.0; ``options`` and the stream priority: ``initNcclResources`` reads
``is_high_priority_stream``, ``nccl2/ProcessGroupNCCL.cpp`` @02327c9). They differ in the name
NCCL gives the communicator (``ncclConfig_t.commName``, which NCCL hands to profiler plugins): nccl2 always
sets it to the process group's ``group_name`` (``:861`` @2.15.0 passes ``group_id``, the constructor keeps it,
``nccl2/ProcessGroupNCCLBackend.cpp`` @0320b6c; ``NCCLBootstrap::
createNcclComm`` and ``ProcessGroupNCCL::split`` overwrite ``commName`` with it, torch ``nccl2/NCCLBootstrap.cpp``
@0ba8e6a, ``nccl2/ProcessGroupNCCL.cpp`` @02327c9), so ``NCCLConfig.comm_name`` is ignored there; the legacy
class keeps ``comm_name`` where torch binds it and otherwise may write ``"<group_desc>:<group_name>"``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lagom_megatron.engine.cluster import release as version_release

ENGINE_ENV = "TORCH_DIST_USE_NCCL2"
"""The variable that picks the engine behind ``backend="nccl"`` (read when "nccl" is first used)."""
NCCL2 = "nccl2"
LEGACY = "legacy"
ENGINE_NAMES = {NCCL2: "nccl2 (ProcessGroupNCCL2)", LEGACY: "legacy ProcessGroupNCCL"}

BACKEND_CALLS = ("options", "register_mem_pool", "_enable_collectives_timing")
"""Attributes of a process group's CUDA backend that lagom uses (``nccl.pool``, ``megatron.hooks.profiler``)."""


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """Which engine ``backend="nccl"`` gives (``NCCL2`` / ``LEGACY``) and why, in one clause."""

    engine: str
    reason: str

    def describe(self) -> str:
        """One line for ``lagom doctor`` and the training log."""
        other = (
            f"{ENGINE_ENV}=0 gives the legacy ProcessGroupNCCL"
            if self.engine == NCCL2
            else f"{ENGINE_ENV}=1 gives nccl2 on torch 2.14, nccl2 is the default from torch 2.15"
        )
        name = ENGINE_NAMES[self.engine]
        return f"NCCL engine: {name}: {self.reason}; {other}"


def predicted_engine(torch_version: str, environ: Mapping[str, str] | None = None) -> EngineChoice:
    """The engine ``backend="nccl"`` will build under ``torch_version`` with ``environ`` (before any group exists).

    ``torch_version`` as torch reports it (``"2.15.0+cu132"``, ``"2.15.0a0+nv25.10"``); the variable is compared as
    torch compares it: exactly ``"1"`` on 2.14, exactly ``"0"`` on 2.15 and newer."""
    env = os.environ if environ is None else environ
    value = env.get(ENGINE_ENV)
    try:
        release = version_release(torch_version)[:2]
    except ValueError:  # "unknown": no version in torch's source
        release = (0, 0)
    if release >= (2, 15):
        if value == "0":
            return EngineChoice(LEGACY, f"torch {torch_version} with {ENGINE_ENV}=0")
        return EngineChoice(NCCL2, f"the default of torch {torch_version}")
    if release >= (2, 14) and value == "1":
        return EngineChoice(NCCL2, f"torch {torch_version} with {ENGINE_ENV}=1")
    return EngineChoice(LEGACY, f"torch {torch_version} builds it for backend 'nccl'")


def cuda_backend(group: Any) -> Any | None:
    """``group``'s CUDA backend object, or None (gloo-only group, no CUDA, no torch)."""
    try:
        import torch

        return group._get_backend(torch.device("cuda"))
    except Exception:  # noqa: BLE001 - no CUDA backend on this group
        return None


def backend_engine(backend: Any) -> str | None:
    """``NCCL2`` or ``LEGACY`` for a backend object by its class (torch binds both in ``torch.distributed``)."""
    if backend is None:
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    for attr, engine in (("ProcessGroupNCCL2", NCCL2), ("ProcessGroupNCCLLazy", NCCL2), ("ProcessGroupNCCL", LEGACY)):
        cls = getattr(dist, attr, None)
        if isinstance(cls, type) and isinstance(backend, cls):
            return engine
    return None


def missing_calls(backend: Any) -> tuple[str, ...]:
    """The ``BACKEND_CALLS`` that ``backend`` lacks (a torch build that binds fewer)."""
    return tuple(name for name in BACKEND_CALLS if not hasattr(type(backend), name) and not hasattr(backend, name))


def _default_group() -> Any | None:
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - no default group: nothing to tell
        return None


def runtime_engine(group: Any = None) -> str | None:
    """The engine of ``group``'s (default: the default group's) CUDA backend, or None without one."""
    group = _default_group() if group is None else group
    return backend_engine(cuda_backend(group)) if group is not None else None


def engine_lines(group: Any = None) -> list[str]:
    """The training log's lines on the engine of ``group`` (default: the default group): which one it is, and one
    warning when its backend lacks a call in ``BACKEND_CALLS`` (what needs it keeps NCCL's defaults)."""
    group = _default_group() if group is None else group
    backend = cuda_backend(group) if group is not None else None
    engine = backend_engine(backend)
    if engine is None:
        return []
    name = ENGINE_NAMES[engine]
    switch = f"{ENGINE_ENV}=0 gives the legacy class" if engine == NCCL2 else f"{ENGINE_ENV} picks the engine"
    lines = [f"lagom: NCCL engine {name} ({switch})"]
    missing = missing_calls(backend)
    if missing:
        lines.append(
            f"lagom: WARNING: this torch's {name} has no {', '.join(missing)}; what needs them keeps NCCL's "
            f"defaults (inherited group options, registered buffers, collective timing); {switch}"
        )
    return lines
