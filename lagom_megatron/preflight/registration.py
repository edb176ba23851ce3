"""A reused plan's registered buffers at launch (``Plan.registered_groups``: Megatron's ``--use-nccl-ub``).

Megatron-Core registers the DDP buffers when it builds them: with ``DistributedDataParallelConfig.nccl_ub`` each
buffer is allocated from an NCCL memory pool and registered with its data-parallel group (megatron-core 0.16.1
``distributed/param_and_grad_buffer.py:753-763``), before lagom profiles anything. A plan that registers buffers is
therefore applied from the start of the next launch that reuses it: our ``pretrain_gpt.py`` and the patched
Megatron-LM checkout ask :func:`planned_registration` before the model is built, and turn ``nccl_ub`` on or refuse.

What registration needs (``registration_missing``):

- NCCL: gloo has no NCCL memory pool (the CPU run).
- ``nccl_ub`` among ``DistributedDataParallelConfig``'s fields (megatron-core 0.16.1
  ``distributed/distributed_data_parallel_config.py:100``).
- torch >= 2.9 for symmetric (window) registration, which NCCL's symmetric kernels and copy-engine collectives need:
  below it Megatron-Core falls back to local registration with only an info log (megatron-core 0.16.1
  ``nccl_allocator.py:116-122``, ``is_torch_min_version("2.9.0a0")``).
- no ``expandable_segments:True`` in ``PYTORCH_CUDA_ALLOC_CONF``: the DDP config refuses it with ``nccl_ub``
  (megatron-core 0.16.1 ``distributed/distributed_data_parallel_config.py:156-161``).
- a DDP wrapper: torch FSDP2's config is built without ``nccl_ub`` (Megatron-LM core_v0.19.0
  ``megatron/training/training.py:1980-1982``; ``training.model.ddp_config``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lagom_megatron.nccl.registration import SYMMETRIC_TORCH

REGISTRATION_FLAG = "--use-nccl-ub"
OTHER_PLAN = (
    "pass --lagom-plan with another file to search a plan for this launch (lagom deletes no file: the plan stays "
    "for a launch that can register its buffers)"
)
"""The way out of a refusal when this launch cannot register; there is no flag that re-plans in place."""


@dataclass(frozen=True, kw_only=True)
class PlanRegistration:
    """What the plan a ``--lagom`` run will reuse registers, and whether this launch can."""

    plan_path: Path
    digest: str
    groups: tuple[str, ...]
    user_flag: bool
    """The command line has ``--use-nccl-ub`` already."""
    missing: str | None = None
    """Why this launch cannot register them; None: it can."""
    way_out: str = OTHER_PLAN

    @property
    def turns_on(self) -> bool:
        """True when lagom turns ``nccl_ub`` on for this launch (the plan needs it, the user did not pass it)."""
        return self.missing is None and not self.user_flag

    def applied_line(self) -> str:
        """The log line of a launch whose buffers lagom registers for the plan."""
        return (
            f"lagom: plan {self.digest[:12]} registers the buffers of {', '.join(self.groups)} "
            f"({REGISTRATION_FLAG}) from this launch"
        )

    def refusal(self) -> str:
        """One line: the plan file, its groups, what this launch lacks and the way out."""
        return (
            f"plan {self.plan_path} (digest {self.digest[:12]}) registers the buffers of {', '.join(self.groups)} "
            f"({REGISTRATION_FLAG}), which this launch cannot: {self.missing}; {self.way_out}"
        )


def registration_missing(
    *,
    backend: str,
    ddp_fields: Iterable[str],
    torch_version: str,
    environ: Mapping[str, str],
    torch_fsdp2: bool = False,
    no_symmetric: bool = False,
) -> str | None:
    """Why a launch on ``backend`` cannot register DDP buffers (the rules of the module docstring), or None."""
    from lagom_megatron.engine.cluster import release

    if backend != "nccl":
        return f"it runs on {backend}, which has no NCCL memory pool to register buffers with (NCCL on GPUs only)"
    if "nccl_ub" not in set(ddp_fields):
        return "the installed megatron-core's DistributedDataParallelConfig has no nccl_ub"
    if torch_fsdp2:
        return "--use-torch-fsdp2's data-parallel config has no nccl_ub (registration is for DDP and Megatron-FSDP)"
    try:
        too_old = release(torch_version)[:2] < SYMMETRIC_TORCH
    except ValueError:
        too_old = False  # a version string we cannot read: Megatron-Core's own check decides
    if too_old:
        return (
            f"torch {torch_version} is older than {'.'.join(map(str, SYMMETRIC_TORCH))}, below which megatron-core "
            "registers without the symmetric windows the plan's NCCL kernels need"
        )
    if no_symmetric:
        return (
            "--disable-symmetric-registration keeps the buffers out of symmetric windows, which the plan's symmetric "
            "kernels and copy engines need (core_v0.19.0 distributed/param_and_grad_buffer.py:1132-1140)"
        )
    if "expandable_segments:True" in environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(","):
        return "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which megatron-core refuses with nccl_ub"
    return None


def registration_disagreement(flags: list[bool]) -> str | None:
    """One line when ranks disagree on ``--use-nccl-ub`` (``flags``: each rank's, in rank order), else None. Each rank
    decides from its own read of the plan file before any process group exists, so a plan folder that not every node
    sees would register the buffers on some ranks only."""
    if not any(flags) or all(flags):
        return None
    return (
        f"--use-nccl-ub is on for {sum(flags)} of {len(flags)} ranks (off on rank {flags.index(False)}): every rank "
        "must read the same --lagom-plan file (a folder all nodes share), or pass --use-nccl-ub on every rank"
    )


def ddp_config_fields() -> tuple[str, ...]:
    """The field names of the installed megatron-core's ``DistributedDataParallelConfig`` (empty without it)."""
    import dataclasses

    try:
        from megatron.core.distributed import DistributedDataParallelConfig
    except ImportError:
        return ()
    return tuple(f.name for f in dataclasses.fields(DistributedDataParallelConfig))


def plan_to_reuse(args: Any, *, on_gpu: bool) -> tuple[Path | None, Any]:
    """(plan file, plan): the plan the ``--lagom`` controller of ``args`` will reuse, as far as a rank can tell before any process
    group: the controller's own files and cluster (``LagomController``), the fingerprint keys known now
    (``run_fingerprint``; the agreed capabilities come later). ``(None, None)`` without ``--lagom``; plan None
    without a plan that matches."""
    if not getattr(args, "lagom", False):
        return None, None
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.megatron.control.controller import LagomController
    from lagom_megatron.megatron.outputs.run_files import run_fingerprint

    controller = LagomController(  # from_args' files and cluster; its tuning options play no part here
        plan_path=getattr(args, "lagom_plan", None),
        report_path=getattr(args, "lagom_report", None),
        cluster=getattr(args, "lagom_cluster", None),
        preset_name=getattr(args, "preset_name", None),
    )
    name = controller.resolve_cluster(on_gpu)  # the controller's choice in on_setup
    try:
        cluster = ClusterSpec.load(name)
    except (ValueError, FileNotFoundError):
        cluster = None  # the controller fails on it in on_setup; the plan's own fields still decide here
    fingerprint = run_fingerprint(args, backend="nccl" if on_gpu else "gloo", cluster=name)
    known = {k: v for k, v in fingerprint.items() if v is not None}  # e.g. a value Megatron-LM derives later
    return controller.files.plan_path, controller.files.plan_to_reuse(known, cluster)


def planned_registration(
    args: Any,
    *,
    on_gpu: bool,
    environ: Mapping[str, str] | None = None,
    torch_version: str | None = None,
    ddp_fields: Iterable[str] | None = None,
    late_flag: str | None = None,
) -> PlanRegistration | None:
    """What the plan ``args``' run will reuse registers (None: nothing); ``late_flag``: why lagom cannot turn
    ``nccl_ub`` on this late (the way out is then the flag itself)."""
    path, plan = plan_to_reuse(args, on_gpu=on_gpu)
    if plan is None or not plan.registered_groups:
        return None
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    backend = getattr(args, "distributed_backend", "nccl") if on_gpu else "gloo"
    missing = registration_missing(
        backend=backend,
        ddp_fields=ddp_config_fields() if ddp_fields is None else ddp_fields,
        torch_version=torch_version,
        environ=os.environ if environ is None else environ,
        torch_fsdp2=bool(getattr(args, "use_torch_fsdp2", False)),
        no_symmetric=bool(getattr(args, "disable_symmetric_registration", False)),
    )
    user_flag = bool(getattr(args, "nccl_ub", False))
    way_out = OTHER_PLAN
    if missing is None and late_flag and not user_flag:
        missing, way_out = late_flag, f"add {REGISTRATION_FLAG} to the command line"
    return PlanRegistration(
        plan_path=path,
        digest=plan.digest(),
        groups=plan.registered_groups,
        user_flag=user_flag,
        missing=missing,
        way_out=way_out,
    )


def plan_registration(args: Any, *, on_gpu: bool | None = None, **checks: Any) -> PlanRegistration | None:
    """``--lagom``: what the plan this run will reuse registers (:func:`planned_registration`, ``checks`` its keyword
    arguments), before the model is built; sets ``args.nccl_ub`` when lagom turns it on (``training.model.ddp_config``
    and Megatron-LM's ``get_model`` pass it to ``DistributedDataParallelConfig``). None: nothing to register;
    ``.missing``: the launch must refuse."""
    if not getattr(args, "lagom", False):
        return None
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    found = planned_registration(args, on_gpu=on_gpu, **checks)
    if found is not None and found.turns_on:
        args.nccl_ub = True
    return found
