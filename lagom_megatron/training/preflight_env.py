"""The environment rules of ``lagom doctor``: CUDA_DEVICE_MAX_CONNECTIONS (Megatron-LM's ``validate_args`` in
``megatron/training/arguments.py``) and the NCCL variables (``nccl.env_check``)."""

from __future__ import annotations

from lagom_megatron.training.preflight_types import Finding, RunShape
from lagom_megatron.nccl.env_check import check_nccl_env, override_issues
from lagom_megatron.nccl.env_network import check_network_env
from lagom_megatron.nccl.plugin_check import check_tuner_plugin, plugin_abi_report

BLACKWELL_SM_ARCH = 100
"""Megatron-LM asks for CUDA_DEVICE_MAX_CONNECTIONS=1 only below compute capability 10.0."""


def rule_cuda_device_max_connections(s: RunShape) -> list[Finding]:
    """CUDA_DEVICE_MAX_CONNECTIONS: 1 with TP or CP > 1 before Blackwell without FSDP; not 1 with FSDP."""
    if s.backend == "gloo":
        return []
    cdmc = s.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    pre_blackwell = s.sm_arch is None or int(s.sm_arch) < BLACKWELL_SM_ARCH
    arch = f"sm_{s.sm_arch}" if s.sm_arch is not None else "an unknown GPU (taken as pre-Blackwell)"
    if s.fsdp:
        if cdmc == "1":
            return [Finding(
                "error", "cuda-device-max-connections",
                "CUDA_DEVICE_MAX_CONNECTIONS=1 with FSDP",
                "FSDP2 and Megatron-FSDP need several hardware queues to overlap their all-gathers "
                "and reduce-scatters; Megatron-LM asserts it is not 1",
                "unset CUDA_DEVICE_MAX_CONNECTIONS (or set it to 32)",
            )]
        return []
    if (s.tp > 1 or s.cp > 1) and pre_blackwell and cdmc != "1":
        seen = "unset" if cdmc is None else f"{cdmc!r}"
        by_preset = " (the preset's env does this)" if s.preset_env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" else ""
        return [Finding(
            "error", "cuda-device-max-connections",
            f"CUDA_DEVICE_MAX_CONNECTIONS is {seen} with TP {s.tp}, CP {s.cp} on {arch}",
            "Megatron-LM asserts 'Using tensor model parallelism or context parallelism require "
            "setting the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1': with one hardware "
            "queue, TP/CP communication kernels are issued before the compute they overlap",
            f"export CUDA_DEVICE_MAX_CONNECTIONS=1{by_preset}",
        )]
    out = []
    if cdmc == "1" and s.tp == 1 and s.cp == 1 and (
            s.get("overlap_grad_reduce", False) or s.get("overlap_param_gather", False)):
        out.append(Finding(
            "warning", "cuda-device-max-connections",
            "CUDA_DEVICE_MAX_CONNECTIONS=1 with TP = CP = 1 and overlapped data-parallel communication",
            "one hardware queue serialises the gradient/parameter collectives with compute, so "
            "there is no overlap for lagom to tune (Megatron-LM issue 1468)",
            "unset CUDA_DEVICE_MAX_CONNECTIONS",
        ))
    if cdmc == "1" and s.get("overlap_moe_expert_parallel_comm", False):
        out.append(Finding(
            "warning", "cuda-device-max-connections",
            "CUDA_DEVICE_MAX_CONNECTIONS=1 with overlap_moe_expert_parallel_comm",
            "expert-parallel all-to-all overlap needs several queues; 32 doubled the measured gain "
            "(Megatron-LM PR 6311)",
            "export CUDA_DEVICE_MAX_CONNECTIONS=32",
        ))
    return out


def rule_nccl_env(s: RunShape) -> list[Finding]:
    """NCCL and TORCH_NCCL variables outside their grammars, a tuner plugin NCCL would not load and, with
    --lagom, a profiler plugin variable that keeps lagom's profiler from loading."""
    if s.backend == "gloo":
        return []
    issues = check_nccl_env(s.environ, nccl_version=s.nccl_version) + check_network_env(s.environ)
    plugin = check_tuner_plugin(s.environ, nccl_version=s.nccl_version)
    if plugin:  # one error line per variable: the plugin check's reason replaces 'file does not exist'
        issues = [i for i in issues if i.variable != plugin[0].variable] + plugin
    elif s.lagom:  # the profiler half lagom checks what NCCL ran with (a user's own is left in place)
        issues += plugin_abi_report(s.environ, nccl_version=s.nccl_version)[1]
    return [Finding(i.level, "nccl-env", i.what, i.why, i.fix) for i in issues]


def rule_nccl_overrides(s: RunShape) -> list[Finding]:
    """With --lagom: NCCL variables that silently override lagom's choices."""
    if s.backend == "gloo" or not s.lagom:
        return []
    return [Finding(i.level, "nccl-override", i.what, i.why, i.fix) for i in override_issues(s.environ)]
