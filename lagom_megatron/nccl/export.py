"""Plan exporters: the formats stock NCCL and Megatron-LM read.

- ``megatron-yaml``: Megatron-LM's ``--nccl-communicator-config-path`` file. Keys are Megatron
  process-group names (dp, dp_cp, tp, pp, ep, cp, ...); values hold ``min_ctas`` (1) and
  ``max_ctas`` (the largest channel count the plan gives the group's sites; always both: NCCL
  rejects a one-sided range, NCCL PR#2256) and
  ``cga_cluster_size`` where the plan sets one, and ``is_high_priority_stream: true`` for a group
  the plan puts on a high-priority stream (megatron-core 0.16.1 ``parallel_state.py:164`` passes
  it to ``ProcessGroupNCCL.Options``, ``:770-773`` is where ``--high-priority-stream-groups`` sets
  it). Megatron copies only these keys (and net_name) into ``ProcessGroupNCCL.Options``. Never empty: an empty
  file loads as None and Megatron's lookup fails, so a plan without CTA choices exports ``{}``.
- ``nccl-tuner-csv``: the tuner table,
  ``collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff``.
  Rows are per (communicator, op, byte size), what a tuner plugin can tell apart: sites with the
  same key and the same exported config share one row (a comment lists them); sites with the same
  key and different configs are refused (``ValueError`` naming both): the search must give sites
  NCCL cannot tell apart one decision, and the table never picks one silently. A coalesced call
  (a DDP bucket group) gets one row per NCCL bin of its tensors (``bins.nccl_bins``). nNodes is
  always -1 (any): NCCL's node count is NVLink domains, not hosts.

  * 10 columns (default): the format of NCCL's own example tuner plugin
    (``plugins/tuner/example/plugin.c`` at NCCL v2.30.7), and it reads every row as lagom's plugin
    does. The example reads an algorithm it does not know, ``-1`` included, as ring
    (``parseAlgorithm``, :81-91), a protocol ``-1`` as simple (``parseProtocol``, :107-112) and
    channels with ``atoi`` after presetting one channel on every call (:236, :361, :406-409), and
    has no chunk size or communicator tag (at most 10 fields, :216). So this export writes only
    explicit algorithm, protocol and channels, and refuses a plan that leaves any of them to NCCL
    or sets a chunk size, naming the site. Every collective no row matches still runs on one
    channel under NCCL's example plugin (:361); under lagom's plugin it keeps NCCL's choice.
  * 12 columns (``extended=True``): lagom's plugin only; adds ``chunkSize`` and ``commTag`` and
    writes ``-1`` for a knob left to NCCL. NCCL's example plugin cannot refuse these rows (it
    stops reading at 10 fields) and would misread them, so they must not be given to it.
- ``env``: ``export NAME='VALUE'`` lines (shell-quoted: ``;`` in ``NCCL_ALGO`` lists never runs as
  a command) of the plan's process-scope knobs only, checked with ``env_vars.validate_env`` (never
  LL128 forced, never a global algorithm list without Ring).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from lagom_megatron.engine.knobs import P2P_OPS
from lagom_megatron.nccl import plugin_status
from lagom_megatron.nccl.bins import nccl_bins
from lagom_megatron.nccl.env_vars import validate_env
from lagom_megatron.nccl.rules import tuner_call_key, validate_cta_range
from lagom_megatron.engine.plan import Plan, PlanEntry

FORMATS: tuple[str, ...] = ("megatron-yaml", "nccl-tuner-csv", "env")

TUNER_COLUMNS: tuple[str, ...] = (
    "collective_type", "min_bytes", "max_bytes", "algorithm", "protocol", "channels", "nNodes", "nRanks",
    "numPipeOps", "regBuff",
)
"""Columns of NCCL's example tuner plugin table, in order."""
TUNER_EXTENDED_COLUMNS: tuple[str, ...] = TUNER_COLUMNS + ("chunkSize", "commTag")
"""The two optional trailing columns lagom's own plugin understands."""

TUNER_COLLECTIVE = {"broadcast": "broadcast", "all_gather": "allgather", "reduce_scatter": "reducescatter",
                    "all_reduce": "allreduce"}
"""lagom op -> the plugin's collective_type (NCCL's tuner is not consulted for P2P ops)."""
TUNER_ALGORITHM = {"Tree": "tree", "Ring": "ring", "CollNetDirect": "collnet_direct", "CollNetChain": "collnet_chain",
                   "NVLS": "nvls", "NVLSTree": "nvls_tree", "PAT": "pat"}
TUNER_PROTOCOL = {"LL": "ll", "LL128": "ll128", "Simple": "simple"}


def export_plan(plan: Plan, fmt: str, *, extended: bool = False, cluster=None) -> str:
    """The plan as text in ``fmt`` (megatron-yaml, nccl-tuner-csv or env).

    Args:
        plan: the plan to export.
        fmt: one of ``FORMATS``.
        extended: nccl-tuner-csv only: add the chunkSize and commTag columns.
        cluster: a ClusterSpec to check CTA ranges against (64 CTAs from NCCL 2.25, else 32);
            without it the 64 limit applies.

    Raises:
        ValueError: unknown format (names it and the allowed set), or a value the target would
            reject (a CTA range, an env variable).
    """
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
            # maxCTAs caps every call of the communicator; NCCL (or the tuner plugin) picks within
            # [1, max]. min_ctas stays 1 so that calls keep NCCL's own smaller counts, as the
            # search assumed (a raised minimum would force every call up to it).
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
    """One data row of an exported tuner table.

    Attributes:
        cells: the row's column values as written (10 or 12 strings, ``TUNER_COLUMNS`` order).
        sites: the plan sites this row applies to (first = highest predicted gain).
    """

    cells: tuple[str, ...]
    sites: tuple[str, ...]


def tuner_rows(plan: Plan, *, extended: bool) -> list[TunerRow]:
    """The data rows of the plan's tuner table, in file order (what the plugin's per-row hit
    counters index, ``nccl/plugin_status.py``).

    Args:
        plan: an NCCL plan.
        extended: 12 columns for lagom's plugin; else the 10 columns NCCL's example plugin reads
            the same way (see the module docstring).

    Raises:
        ValueError: two sites with the same (communicator tag, collective, bytes, nodes, ranks)
            and different configs (names both and the values); 10 columns: a site that leaves its
            algorithm, protocol or channels to NCCL, or sets a chunk size (names the site).
    """
    order = sorted(plan.entries.items(),
                   key=lambda kv: -(kv[1].predicted_default_t_region_us - kv[1].predicted_t_region_us))
    rows: dict[tuple, list] = {}
    for site_id, e in order:
        c = e.config
        if e.op not in TUNER_COLLECTIVE or (c.algorithm is None and c.protocol is None and c.n_channels is None
                                            and c.chunk_size is None):
            continue
        if not extended:
            unset = [name for name, v in (("algorithm", c.algorithm), ("protocol", c.protocol),
                                          ("channels", c.n_channels)) if v is None]
            if unset or c.chunk_size is not None:
                what = (f"leaves {', '.join(unset)} to NCCL" if unset else f"sets chunk size {c.chunk_size}")
                raise ValueError(
                    f"site {site_id} {what}: NCCL's example tuner plugin would read that as ring / simple / "
                    "1 channel, or drop the chunk size; the 10-column table holds only explicit algorithm, "
                    "protocol and channels (export with --extended for lagom's plugin)")
        decision = (TUNER_ALGORITHM.get(c.algorithm, "-1"), TUNER_PROTOCOL.get(c.protocol, "-1"),
                    str(c.n_channels if c.n_channels is not None else -1))
        if extended:
            decision += (str(c.chunk_size if c.chunk_size is not None else -1),)
        # one row per getCollInfo NCCL makes for the call (bins.nccl_bins: a coalesced bucket group
        # is asked about once per (dtype, within-4x) aggregate), keyed by the search's key
        # (tuner_call_key: one decision per key) and nRanks; the 10 columns have no tag, so every
        # group counts as one. nNodes is -1: NCCL counts an NVLink domain as one node
        # (src/init.cc:1285-1297), so on multi-node NVLink a host count would never match; the tag
        # and nRanks identify the communicator.
        for nbytes in nccl_bins(e.parts, nbytes=e.nbytes, op=e.op):
            call = tuner_call_key(group=e.group if extended else "*", op=e.op, nbytes=nbytes)
            key = (*call, -1, e.group_size or -1)
            if key in rows:
                first, first_decision = rows[key][0][0], rows[key][1]
                if decision != first_decision:
                    raise ValueError(
                        f"sites {first} and {site_id} are the same collective to a tuner plugin (tag {key[0]!r}, "
                        f"{TUNER_COLLECTIVE[e.op]}, {key[2]} bytes, {key[4]} ranks) but have different configs "
                        f"{first_decision} and {decision}; the plan must give them one decision")
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
        "# NCCL tuner table written by lagom" + (" (lagom's plugin only: 12 columns)" if extended
                                                 else " (NCCL's example tuner plugin reads it the same way)"),
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
    """Rows of a tuner table as dicts (comments and blank lines skipped); 10 or 12 columns.

    Raises:
        ValueError: a row with another column count (names the line number).
    """
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cells = line.split(",")
        if len(cells) not in (len(TUNER_COLUMNS), len(TUNER_EXTENDED_COLUMNS)):
            raise ValueError(f"tuner table line {n}: expected {len(TUNER_COLUMNS)} or {len(TUNER_EXTENDED_COLUMNS)} columns; got {len(cells)}")
        rows.append(dict(zip(TUNER_EXTENDED_COLUMNS, cells)))
    return rows


def plan_hit_summary(plan: Plan, *, status_reader: Any = None) -> str:
    """``plugin_status.summarize_hits`` for ``plan``'s tuner rows (``tuner_rows``, extended) with
    this process's plugin status (``status_reader``, default ``read_plugin_status``): one log line.
    Never raises for a plan whose table could not be exported (the line says so instead)."""
    try:
        rows = tuner_rows(plan, extended=True)
    except ValueError as exc:
        return f"lagom: tuner plugin: no hit summary, the plan has no tuner table ({exc})"
    return plugin_status.summarize_hits((status_reader or plugin_status.read_plugin_status)(), rows)
