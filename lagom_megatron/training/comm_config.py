"""Strict check of ``--nccl-communicator-config-path``, which megatron-core 0.16.1 loads unchecked
(``megatron/core/parallel_state.py:768``) into ``ProcessGroupNCCL.Options`` (``get_nccl_options``, ``:150-180``;
``net_name``: ``:175``). CTA bounds follow NCCL ``src/init.cc`` ``envConfigOverride``."""

from __future__ import annotations

from pathlib import Path

import yaml

from lagom_megatron.nccl.env_grammar import MAX_CGA_CLUSTER_SIZE, max_ctas
from lagom_megatron.training.preflight_types import Finding, RunShape

GROUP_NAMES: frozenset[str] = frozenset({
    "cp", "dp", "dp_cp", "embd", "ep", "ep_dp", "ep_tp", "hcp", "inter_ep_dp", "intra_dist_opt_instance",
    "intra_dp_cp", "intra_ep_dp", "mp", "pos_embd", "pp", "tp", "tp_cp", "tp_dp", "tp_dp_cp", "tp_ep_mp",
    "tp_ep_pp",
})
"""Process-group names megatron-core 0.16.1 passes to ``get_nccl_options`` (``parallel_state.py``)."""

KEYS: dict[str, str] = {"is_high_priority_stream": "bool", "cga_cluster_size": "int", "max_ctas": "int",
                        "min_ctas": "int", "net_name": "str"}
"""The keys ``get_nccl_options`` reads and their YAML types."""

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
        return [f"{path}:1:1: {flag} file is empty; megatron-core needs a mapping of process-group names "
                f"({', '.join(sorted(GROUP_NAMES))}) to options"]
    if not isinstance(root, yaml.MappingNode):
        return [f"{_at(path, root)}: {flag} must hold a mapping of process-group names to options; got a "
                f"{'list' if isinstance(root, yaml.SequenceNode) else 'scalar'}"]
    out = []
    ceiling = max_ctas(nccl_version)
    for key_node, value_node in root.value:
        group = key_node.value
        if group not in GROUP_NAMES:
            out.append(f"{_at(path, key_node)}: unknown process group {group!r}; allowed: {', '.join(sorted(GROUP_NAMES))}")
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
            out.append(f"{_at(path, seen[given][0])}: group {group!r} sets {given} without {other}; give both "
                       f"(NCCL fills the other from its own default, which differs per GPU and version)")
        elif "min_ctas" in seen and seen["min_ctas"][1] > seen["max_ctas"][1]:
            out.append(f"{_at(path, seen['min_ctas'][0])}: {group}.min_ctas {seen['min_ctas'][1]} exceeds "
                       f"max_ctas {seen['max_ctas'][1]}")
        if "net_name" in seen and str(seen["net_name"][1]).lower() not in ("ib", "socket"):
            out.append(f"{_at(path, seen['net_name'][0])}: {group}.net_name {seen['net_name'][1]!r} is not one of "
                       f"{', '.join(NET_NAMES)} (parallel_state.py:175)")
    return out


def rule_comm_config(s: RunShape) -> list[Finding]:
    """Errors of :func:`check_comm_config` for ``--nccl-communicator-config-path`` (a file on this machine)."""
    path = s.args.get("nccl_communicator_config_path")
    if not path:
        return []
    return [Finding("error", "comm-config", m, "megatron-core copies these options into NCCL unchecked "
                    "(parallel_state.py:150-180)", "fix the file at the line and column named")
            for m in check_comm_config(path, s.nccl_version)]
