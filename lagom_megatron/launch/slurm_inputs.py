"""SLURM's allocation variables, parsed as SLURM defines them, and the checks the launch needs of them.

Host lists (``node-a[07-08,10]``; ranges keep their zero padding): SLURM's ``src/common/hostlist.c``;
``SLURM_TASKS_PER_NODE`` (``8(x2),4``): sbatch(1), OUTPUT ENVIRONMENT VARIABLES."""

from __future__ import annotations

import re
from typing import Mapping

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top(text: str) -> list[str]:
    """Splits on commas outside brackets; raises ValueError on unbalanced or nested brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _range_values(body: str) -> list[str]:
    out = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"'[{body}]' holds {item!r}, not a number or a range LOW-HIGH")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """The host names of a SLURM host-list expression, in order; ValueError naming it and the fault."""
    if not text or not text.strip():
        raise ValueError("empty host list")
    hosts: list[str] = []
    try:
        for part in _split_top(text.strip()):
            if not part:
                raise ValueError("an empty entry between commas")
            names = [""]
            for piece in re.split(r"(\[[^\]]*\])", part):
                values = _range_values(piece[1:-1]) if piece.startswith("[") else [piece]
                names = [n + v for n in names for v in values]
            hosts += names
    except ValueError as exc:
        raise ValueError(f"host list {text!r}: {exc}") from None
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` as one count per node, ``"8(x2),4"`` -> ``[8, 8, 4]``; ValueError on a bad entry."""
    counts: list[int] = []
    for entry in text.strip().split(","):
        m = _TASKS.match(entry.strip())
        if not m or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r}: entry {entry!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def check_allocation(environ: Mapping[str, str], *, nodes: int, tasks_per_node: int, name: str) -> None:
    """Checks the allocation's node list and tasks per node; ValueError naming the variable, value and need.

    Every node must run ``tasks_per_node`` (1: one torchrun per node, else one task per GPU); nothing is
    checked outside an allocation."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        hosts = expand_hostlist(nodelist)
        if len(hosts) != nodes:
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names {len(hosts)} nodes but preset {name!r} needs "
                             f"{nodes}; submit with --nodes={nodes}")
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names a node twice")
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    if tasks:
        counts = parse_tasks_per_node(tasks)
        if nodelist and len(counts) != len(expand_hostlist(nodelist)):
            raise ValueError(f"SLURM_TASKS_PER_NODE={tasks!r} gives {len(counts)} nodes, SLURM_JOB_NODELIST "
                             f"{len(expand_hostlist(nodelist))}")
        if any(c != tasks_per_node for c in counts):
            raise ValueError(f"SLURM_TASKS_PER_NODE={tasks!r}: the launch needs {tasks_per_node} task(s) on every "
                             f"node ({'one torchrun per node' if tasks_per_node == 1 else 'one task per GPU'}); "
                             f"submit with --ntasks-per-node={tasks_per_node}")
