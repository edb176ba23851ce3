"""Environment rules: CUDA_DEVICE_MAX_CONNECTIONS (Megatron-LM ``arguments.py`` validate_args), NCCL variables."""

from __future__ import annotations

from pathlib import Path

import yaml

from lagom_megatron.nccl.env_check import check_nccl_env, override_issues
from lagom_megatron.nccl.env_network import check_network_env
from lagom_megatron.nccl.env_vars import MAX_CGA_CLUSTER_SIZE, max_ctas
from lagom_megatron.nccl.plugin_launch import check_tuner_plugin
from lagom_megatron.preflight.types import Finding, RunShape

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
            return [
                Finding(
                    "error",
                    "cuda-device-max-connections",
                    "CUDA_DEVICE_MAX_CONNECTIONS=1 with FSDP",
                    "FSDP2 and Megatron-FSDP need several hardware queues to overlap their all-gathers "
                    "and reduce-scatters; Megatron-LM asserts it is not 1",
                    "unset CUDA_DEVICE_MAX_CONNECTIONS (or set it to 32)",
                )
            ]
        return []
    if (s.tp > 1 or s.cp > 1) and pre_blackwell and cdmc != "1":
        seen = "unset" if cdmc is None else f"{cdmc!r}"
        by_preset = " (the preset's env does this)" if s.preset_env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" else ""
        return [
            Finding(
                "error",
                "cuda-device-max-connections",
                f"CUDA_DEVICE_MAX_CONNECTIONS is {seen} with TP {s.tp}, CP {s.cp} on {arch}",
                "Megatron-LM asserts 'Using tensor model parallelism or context parallelism require "
                "setting the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1': with one hardware "
                "queue, TP/CP communication kernels are issued before the compute they overlap",
                f"export CUDA_DEVICE_MAX_CONNECTIONS=1{by_preset}",
            )
        ]
    out = []
    if (
        cdmc == "1"
        and s.tp == 1
        and s.cp == 1
        and (s.get("overlap_grad_reduce", False) or s.get("overlap_param_gather", False))
    ):
        out.append(
            Finding(
                "warning",
                "cuda-device-max-connections",
                "CUDA_DEVICE_MAX_CONNECTIONS=1 with TP = CP = 1 and overlapped data-parallel communication",
                "one hardware queue serialises the gradient/parameter collectives with compute, so "
                "there is no overlap for lagom to tune (Megatron-LM issue 1468)",
                "unset CUDA_DEVICE_MAX_CONNECTIONS",
            )
        )
    if cdmc == "1" and s.get("overlap_moe_expert_parallel_comm", False):
        out.append(
            Finding(
                "warning",
                "cuda-device-max-connections",
                "CUDA_DEVICE_MAX_CONNECTIONS=1 with overlap_moe_expert_parallel_comm",
                "expert-parallel all-to-all overlap needs several queues; 32 doubled the measured gain "
                "(Megatron-LM PR 6311)",
                "export CUDA_DEVICE_MAX_CONNECTIONS=32",
            )
        )
    return out


def rule_nccl_env(s: RunShape) -> list[Finding]:
    """NCCL / TORCH_NCCL variables outside their grammars, an unloadable tuner plugin."""
    if s.backend == "gloo":
        return []
    issues = check_nccl_env(s.environ, nccl_version=s.nccl_version) + check_network_env(s.environ)
    plugin = check_tuner_plugin(s.environ, nccl_version=s.nccl_version)
    if plugin:  # one error line per variable: the plugin check's reason replaces 'file does not exist'
        issues = [i for i in issues if i.variable != plugin[0].variable] + plugin
    return [Finding(i.level, "nccl-env", i.what, i.why, i.fix) for i in issues]


def rule_nccl_overrides(s: RunShape) -> list[Finding]:
    """With --lagom: each set variable of ``nccl.env_vars.LAGOM_VARIABLES`` (what it changes of lagom, once)."""
    if s.backend == "gloo" or not s.lagom:
        return []
    return [Finding(i.level, "nccl-override", i.what, i.why, i.fix) for i in override_issues(s.environ)]


GROUP_NAMES: frozenset[str] = frozenset(
    {
        "cp",
        "dp",
        "dp_cp",
        "embd",
        "ep",
        "ep_dp",
        "ep_tp",
        "hcp",
        "inter_ep_dp",
        "intra_dist_opt_instance",
        "intra_dp_cp",
        "intra_ep_dp",
        "mp",
        "pos_embd",
        "pp",
        "tp",
        "tp_cp",
        "tp_dp",
        "tp_dp_cp",
        "tp_ep_mp",
        "tp_ep_pp",
    }
)
"""Process-group names megatron-core 0.16.1 passes to ``get_nccl_options`` (``parallel_state.py``)."""

KEYS: dict[str, str] = {
    "is_high_priority_stream": "bool",
    "cga_cluster_size": "int",
    "max_ctas": "int",
    "min_ctas": "int",
    "net_name": "str",
}

NET_NAMES = ("IB", "Socket")

_TAGS = {"bool": "tag:yaml.org,2002:bool", "int": "tag:yaml.org,2002:int", "str": "tag:yaml.org,2002:str"}


def _at(path: str, node: yaml.Node) -> str:
    return f"{path}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"


def check_comm_config(path: str, nccl_version: str | None = None) -> list[str]:
    """Every problem of one communicator-config file as ``file:line:col: ...`` (``nccl_version`` None: CTAs <= 64)."""
    flag = "--nccl-communicator-config-path"
    p = Path(path)
    if not p.is_file():
        return [f"{flag} {path!r} does not exist or is not a file"]
    try:
        root = yaml.compose(p.read_text(), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        return [f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})"]
    if root is None:
        return [
            f"{path}:1:1: {flag} file is empty; megatron-core needs a mapping of process-group names "
            f"({', '.join(sorted(GROUP_NAMES))}) to options"
        ]
    if not isinstance(root, yaml.MappingNode):
        return [
            f"{_at(path, root)}: {flag} must hold a mapping of process-group names to options; got a "
            f"{'list' if isinstance(root, yaml.SequenceNode) else 'scalar'}"
        ]
    out = []
    ceiling = max_ctas(nccl_version)
    for key_node, value_node in root.value:
        group = key_node.value
        if group not in GROUP_NAMES:
            out.append(
                f"{_at(path, key_node)}: unknown process group {group!r}; allowed: {', '.join(sorted(GROUP_NAMES))}"
            )
            continue
        if not isinstance(value_node, yaml.MappingNode):
            out.append(f"{_at(path, value_node)}: group {group!r} must map to options ({', '.join(KEYS)})")
            continue
        seen: dict[str, tuple[yaml.Node, object]] = {}
        for k, v in value_node.value:
            if k.value not in KEYS:
                out.append(f"{_at(path, k)}: unknown option {k.value!r} of group {group!r}; allowed: {', '.join(KEYS)}")
                continue
            want = KEYS[k.value]
            if not isinstance(v, yaml.ScalarNode) or v.tag != _TAGS[want]:
                shown = v.value if isinstance(v, yaml.ScalarNode) else "a collection"
                quoted = " (quoted: a string)" if isinstance(v, yaml.ScalarNode) and v.style in ("'", '"') else ""
                out.append(f"{_at(path, v)}: {group}.{k.value} must be a YAML {want}; got {shown!r}{quoted}")
                continue
            seen[k.value] = (v, yaml.safe_load(yaml.serialize(v)))
        for name, lo in (("min_ctas", 1), ("max_ctas", 1), ("cga_cluster_size", 0)):
            if name in seen:
                node, value = seen[name]
                hi = MAX_CGA_CLUSTER_SIZE if name == "cga_cluster_size" else ceiling
                if not lo <= value <= hi:
                    out.append(f"{_at(path, node)}: {group}.{name} {value} is outside {lo}..{hi} (NCCL ncclConfig_t)")
        if ("min_ctas" in seen) != ("max_ctas" in seen):
            given = "min_ctas" if "min_ctas" in seen else "max_ctas"
            other = "max_ctas" if given == "min_ctas" else "min_ctas"
            out.append(
                f"{_at(path, seen[given][0])}: group {group!r} sets {given} without {other}; give both "
                f"(NCCL fills the other from its own default, which differs per GPU and version)"
            )
        elif "min_ctas" in seen and seen["min_ctas"][1] > seen["max_ctas"][1]:
            out.append(
                f"{_at(path, seen['min_ctas'][0])}: {group}.min_ctas {seen['min_ctas'][1]} exceeds "
                f"max_ctas {seen['max_ctas'][1]}"
            )
        if "net_name" in seen and str(seen["net_name"][1]).lower() not in ("ib", "socket"):
            out.append(
                f"{_at(path, seen['net_name'][0])}: {group}.net_name {seen['net_name'][1]!r} is not one of "
                f"{', '.join(NET_NAMES)} (parallel_state.py:175)"
            )
    return out


def rule_comm_config(s: RunShape) -> list[Finding]:
    """Errors of :func:`check_comm_config` for ``--nccl-communicator-config-path`` (a file on this machine)."""
    path = s.args.get("nccl_communicator_config_path")
    if not path:
        return []
    return [
        Finding(
            "error",
            "comm-config",
            m,
            "megatron-core copies these options into NCCL unchecked (parallel_state.py:150-180)",
            "fix the file at the line and column named",
        )
        for m in check_comm_config(path, s.nccl_version)
    ]
