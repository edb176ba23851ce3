"""Plan exporters: the formats stock NCCL and Megatron-LM read. ``megatron-yaml``: megatron-core 0.16.1's
``--nccl-communicator-config-path`` file (``parallel_state.py:164``, :770-773), both CTA ends (NCCL PR#2256), ``{}`` if
empty (else None); ``nccl-tuner-csv``: 10 columns for NCCL's example plugin, which reads -1 as ring / simple / 1 channel
(``plugins/tuner/example/plugin.c`` @v2.30.7 :81-91, :107-112, :216, :236, :361, :406-409), 12 for lagom's."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from lagom_megatron.engine.knobs import P2P_OPS
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.nccl import plugin_status
from lagom_megatron.nccl.env_vars import validate_env
from lagom_megatron.nccl.rules import tuner_call_key, validate_cta_range
from lagom_megatron.nccl.validate import nccl_bins

FORMATS: tuple[str, ...] = ("megatron-yaml", "nccl-tuner-csv", "env")

TUNER_COLUMNS: tuple[str, ...] = (
    "collective_type",
    "min_bytes",
    "max_bytes",
    "algorithm",
    "protocol",
    "channels",
    "nNodes",
    "nRanks",
    "numPipeOps",
    "regBuff",
)
TUNER_EXTENDED_COLUMNS: tuple[str, ...] = TUNER_COLUMNS + ("chunkSize", "commTag")

TUNER_COLLECTIVE = {
    "broadcast": "broadcast",
    "all_gather": "allgather",
    "reduce_scatter": "reducescatter",
    "all_reduce": "allreduce",
}
"""lagom op -> the plugin's collective_type (NCCL's tuner is not consulted for P2P ops)."""
TUNER_ALGORITHM = {
    "Tree": "tree",
    "Ring": "ring",
    "CollNetDirect": "collnet_direct",
    "CollNetChain": "collnet_chain",
    "NVLS": "nvls",
    "NVLSTree": "nvls_tree",
    "PAT": "pat",
}
TUNER_PROTOCOL = {"LL": "ll", "LL128": "ll128", "Simple": "simple"}


def export_plan(plan: Plan, fmt: str, *, extended: bool = False, cluster=None) -> str:
    """The plan as text in ``fmt`` (``cluster``: CTA limits, default 64); ValueError: bad format or rejected value."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}; got {fmt!r}")
    if plan.backend == "gloo" and fmt != "env":
        raise ValueError(f"format {fmt!r} is for NCCL plans; this plan is for backend 'gloo' (use it directly)")
    if fmt == "megatron-yaml":
        return _megatron_yaml(plan, cluster)
    if fmt == "nccl-tuner-csv":
        return _tuner_csv(plan, extended)
    return _env(plan)


class _AnyNccl:
    """Stands in for a ClusterSpec in CTA checks when none is given (NCCL >= 2.25 limits)."""

    backend = "nccl"
    nccl = (2, 25, 0)
    nccl_version = "2.25+"


def _megatron_yaml(plan: Plan, cluster) -> str:
    groups: dict[str, list[PlanEntry]] = {}
    for entry in plan.entries.values():
        groups.setdefault(entry.group, []).append(entry)
    lines = [
        "# Megatron-LM --nccl-communicator-config-path file written by lagom",
        f"# plan method: {plan.method}; keys are Megatron process-group names; both CTA ends always set",
    ]
    body = []
    for group in sorted(groups):
        entries = groups[group]
        ch = [e.config.n_channels for e in entries if e.config.n_channels is not None and e.op not in P2P_OPS]
        cga = {e.config.cga_cluster_size for e in entries if e.config.cga_cluster_size is not None}
        fast = any(e.config.high_priority_stream for e in entries)
        if not ch and not cga and not fast:
            continue
        fields = {}
        if ch:
            # min_ctas 1: calls keep NCCL's own smaller counts, as the search assumed; max_ctas caps them all
            lo, hi = 1, max(ch)
            validate_cta_range(lo, hi, cluster=cluster or _AnyNccl())
            fields["min_ctas"], fields["max_ctas"] = lo, hi
        if cga:
            fields["cga_cluster_size"] = max(cga)
        if fast:
            fields["is_high_priority_stream"] = "true"
        body.append(f"{group}: {{" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}")
    return "\n".join(lines + (body or ["{}"])) + "\n"


@dataclass(frozen=True)
class TunerRow:
    """One tuner-table row: its ``cells`` (``TUNER_COLUMNS`` order) and the ``sites`` it serves (highest gain first)."""

    cells: tuple[str, ...]
    sites: tuple[str, ...]


def tuner_rows(plan: Plan, *, extended: bool) -> list[TunerRow]:
    """Tuner-table rows in file order, as the plugin counts hits; ValueError: two configs for a key, a missing cell."""
    order = sorted(
        plan.entries.items(), key=lambda kv: -(kv[1].predicted_default_t_region_us - kv[1].predicted_t_region_us)
    )
    rows: dict[tuple, list] = {}
    for site_id, e in order:
        c = e.config
        if e.op not in TUNER_COLLECTIVE or (
            c.algorithm is None and c.protocol is None and c.n_channels is None and c.chunk_size is None
        ):
            continue
        if not extended:
            unset = [
                name
                for name, v in (("algorithm", c.algorithm), ("protocol", c.protocol), ("channels", c.n_channels))
                if v is None
            ]
            if unset or c.chunk_size is not None:
                what = f"leaves {', '.join(unset)} to NCCL" if unset else f"sets chunk size {c.chunk_size}"
                raise ValueError(
                    f"site {site_id} {what}: NCCL's example tuner plugin would read that as ring / simple / "
                    "1 channel, or drop the chunk size; the 10-column table holds only explicit algorithm, "
                    "protocol and channels (export with --extended for lagom's plugin)"
                )
        decision = (
            TUNER_ALGORITHM.get(c.algorithm, "-1"),
            TUNER_PROTOCOL.get(c.protocol, "-1"),
            str(c.n_channels if c.n_channels is not None else -1),
        )
        if extended:
            decision += (str(c.chunk_size if c.chunk_size is not None else -1),)
        # a row per getCollInfo (nccl_bins) by tuner_call_key and nRanks; nNodes -1, as NCCL counts an NVLink
        # domain as one node (src/init.cc:1285-1297): a host count would never match on multi-node NVLink
        for nbytes in nccl_bins(e.parts, nbytes=e.nbytes, op=e.op):
            call = tuner_call_key(group=e.group if extended else "*", op=e.op, nbytes=nbytes)
            key = (*call, -1, e.group_size or -1)
            if key in rows:
                first, first_decision = rows[key][0][0], rows[key][1]
                if decision != first_decision:
                    raise ValueError(
                        f"sites {first} and {site_id} are the same collective to a tuner plugin (tag {key[0]!r}, "
                        f"{TUNER_COLLECTIVE[e.op]}, {key[2]} bytes, {key[4]} ranks) but have different configs "
                        f"{first_decision} and {decision}; the plan must give them one decision"
                    )
                if site_id not in rows[key][0]:
                    rows[key][0].append(site_id)
                continue
            rows[key] = ([site_id], decision)
    out = []
    for (tag, op, nbytes, n_nodes, n_ranks), (sites, decision) in rows.items():
        cells = (TUNER_COLLECTIVE[op], str(nbytes), str(nbytes), *decision[:3], str(n_nodes), str(n_ranks), "-1", "-1")
        if extended:
            cells += (decision[3], tag)
        out.append(TunerRow(cells=cells, sites=tuple(sites)))
    return out


def _tuner_csv(plan: Plan, extended: bool) -> str:
    columns = TUNER_EXTENDED_COLUMNS if extended else TUNER_COLUMNS
    lines = [
        "# NCCL tuner table written by lagom"
        + (
            " (lagom's plugin only: 12 columns)" if extended else " (NCCL's example tuner plugin reads it the same way)"
        ),
        "# " + ",".join(columns),
        "# collective_type: broadcast|reduce|allgather|reducescatter|allreduce; min/max_bytes inclusive",
        "# algorithm: tree|ring|collnet_direct|collnet_chain|nvls|nvls_tree|pat|-1; protocol: ll|ll128|simple|-1",
        "# channels, nNodes, nRanks, numPipeOps: integer or -1 (any); regBuff: 0|1|-1",
    ]
    if extended:
        lines.append("# chunkSize: bytes or -1 (NCCL's); commTag: process-group name, empty or * = any communicator")
    for row in tuner_rows(plan, extended=extended):
        lines.append("# " + " ".join(row.sites))
        lines.append(",".join(row.cells))
    return "\n".join(lines) + "\n"


def _env(plan: Plan) -> str:
    validate_env(plan.env)
    lines = ["# process-scope NCCL settings of a lagom plan: source before launching every rank"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(plan.env.items())]
    return "\n".join(lines) + "\n"


def parse_tuner_csv(text: str) -> list[dict[str, str]]:
    """Rows of a tuner table (10 or 12 columns) as dicts; ValueError names a row with another column count."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cells = line.split(",")
        if len(cells) not in (len(TUNER_COLUMNS), len(TUNER_EXTENDED_COLUMNS)):
            raise ValueError(
                f"tuner table line {n}: expected {len(TUNER_COLUMNS)} or {len(TUNER_EXTENDED_COLUMNS)} columns; got {len(cells)}"
            )
        rows.append(dict(zip(TUNER_EXTENDED_COLUMNS, cells)))
    return rows


def plan_hit_summary(plan: Plan, *, status_reader: Any = None) -> str:
    """One log line: ``summarize_hits`` of ``plan``'s extended tuner rows; never raises for a plan without a table."""
    try:
        rows = tuner_rows(plan, extended=True)
    except ValueError as exc:
        return f"lagom: tuner plugin: no hit summary, the plan has no tuner table ({exc})"
    return plugin_status.summarize_hits((status_reader or plugin_status.read_plugin_status)(), rows)
