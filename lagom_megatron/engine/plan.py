"""Plan files (JSON): each site's CommConfig and predicted times, process-scope ``env``, stats, and the fingerprint
of what it was searched for. Ranks compare ``Plan.digest()``: sha256 of the canonical JSON without the stats."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from lagom_megatron.engine.files import write_json_atomic
from lagom_megatron.engine.knobs import CommConfig

PLAN_SCHEMA_VERSION = 1
"""Version of the plan file format; bump on any incompatible change (a test freezes it)."""

FINGERPRINT_FIELDS: tuple[str, ...] = (
    "model",
    "parallel",
    "world_size",
    "cluster",
    "nccl_version",
    "lagom_version",
    "backend",
)
"""Fields a fingerprint usually holds; any other key is compared too."""

NCCL_MECHANISMS: tuple[str, ...] = ("tuner", "communicator", "env")
"""How a plan reaches NCCL (``nccl.rules``): tuner plugin (default), ``ncclConfig_t`` per pool entry, or job env."""
MECHANISMS: dict[str, tuple[str, ...]] = {"nccl": NCCL_MECHANISMS, "sim": NCCL_MECHANISMS, "gloo": ("gloo",)}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanEntry:
    """The chosen config of one collective site and what the cost model predicts for it."""

    config: CommConfig
    predicted_t_comm_us: float
    """Per iteration."""
    predicted_t_region_us: float
    group: str
    op: str = "all_reduce"
    nbytes: int = 0
    """One call's; with ``group_size`` and ``n_nodes``: the tuner table's byte range, nRanks, nNodes."""
    group_size: int = 0
    n_nodes: int = 1
    predicted_default_t_region_us: float = 0.0
    tunable: tuple[str, ...] = ()
    """Knobs the mechanism can change for this site, in priority order; empty = NCCL's choice whatever the plan."""
    note: str = ""
    reduce_op: str | None = None
    parts: tuple[tuple[str, int], ...] = ()
    """(dtype, bytes) per tensor of a coalesced call: one tuner row per NCCL bin."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": self.config.to_dict(),
            "predicted_t_comm_us": self.predicted_t_comm_us,
            "predicted_t_region_us": self.predicted_t_region_us,
            "predicted_default_t_region_us": self.predicted_default_t_region_us,
            "group": self.group,
            "op": self.op,
            "nbytes": self.nbytes,
            "group_size": self.group_size,
            "n_nodes": self.n_nodes,
            "tunable": list(self.tunable),
        }
        if self.note:
            out["note"] = self.note
        if self.reduce_op is not None:
            out["reduce_op"] = self.reduce_op
        if self.parts:
            out["parts"] = [list(p) for p in self.parts]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanEntry:
        """Builds an entry from ``to_dict`` output that ``config.plan_files.PlanSchema`` accepts."""
        times = ("predicted_t_comm_us", "predicted_t_region_us", "predicted_default_t_region_us")
        return cls(
            **{
                **data,
                **{k: float(data[k]) for k in times if k in data},
                "config": CommConfig.from_dict(data["config"]),
                "tunable": tuple(data.get("tunable", ())),
                "parts": tuple(map(tuple, data.get("parts", ()))),
            }
        )


@dataclass(kw_only=True)
class Plan:
    """Site id -> PlanEntry, plus fingerprint, method, process-scope env and search statistics."""

    entries: dict[str, PlanEntry]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    method: str = "priority"
    env: dict[str, str] = field(default_factory=dict)
    """Process-scope knobs as environment variables (NCCL_NTHREADS, ...) for the next launch."""
    stats: dict[str, Any] = field(default_factory=dict)
    backend: str = "nccl"
    mechanism: str = "tuner"
    registered_groups: tuple[str, ...] = ()
    """Process groups whose buffers the plan registers (Megatron's ``--use-nccl-ub``): NCCL's symmetric kernels and
    copy-engine collectives need it. Registration happens when Megatron builds its buffers, so it applies from the
    next launch that reuses the plan; sorted, no repeats."""
    schema_version: int = PLAN_SCHEMA_VERSION

    def to_dict(self, *, with_stats: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "method": self.method,
            "backend": self.backend,
            "mechanism": self.mechanism,
            "fingerprint": self.fingerprint,
            "env": dict(self.env),
            "entries": {k: e.to_dict() for k, e in self.entries.items()},
        }
        if self.registered_groups:  # absent when empty: older plans keep their digest
            out["registered_groups"] = list(self.registered_groups)
        if with_stats:
            out["stats"] = self.stats
        return out

    def digest(self) -> str:
        """sha256 hex digest of the canonical JSON (sorted keys, no whitespace) without stats."""
        text = json.dumps(self.to_dict(with_stats=False), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        """Writes the plan as JSON atomically (temporary file in the same folder + rename)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Builds a plan from ``to_dict`` output that ``config.plan_files.PlanSchema`` accepts (which reads files)."""
        return cls(
            **{k: data[k] for k in ("method", "backend", "mechanism") if k in data},
            entries={sid: PlanEntry.from_dict(e) for sid, e in data["entries"].items()},
            fingerprint=dict(data.get("fingerprint", {})),
            env=dict(data.get("env", {})),
            stats=dict(data.get("stats", {})),
            registered_groups=tuple(sorted(set(data.get("registered_groups", ())))),
        )

    def fingerprint_mismatch(self, expected: dict[str, Any]) -> list[str]:
        """Sorted keys of ``expected`` the fingerprint differs on (one it lacks differs unless expected None)."""
        return sorted(k for k in expected if self.fingerprint.get(k) != expected[k])

    def check_fingerprint(self, expected: dict[str, Any], *, source: str = "plan") -> None:
        """Raises ValueError naming each differing field with both values, if any differ."""
        diff = self.fingerprint_mismatch(expected)
        if diff:
            detail = "; ".join(
                f"{k}: plan has {shown(self.fingerprint, k)}, run has {shown(expected, k)}" for k in diff
            )
            raise ValueError(f"{source} was made for another run ({', '.join(diff)} differ): {detail}")

    @property
    def rejected(self) -> bool:
        """True when the plan's own verification fell back (``stats["verification"] == "fell_back"``)."""
        return self.stats.get("verification") == "fell_back"

    def with_stats(self, **stats: Any) -> Plan:
        """A copy with ``stats`` updated (plans are not mutated by searchers)."""
        return replace(self, stats={**self.stats, **stats})

    def pending_groups(self, registered_now: Any = ()) -> tuple[str, ...]:
        """``registered_groups`` whose buffers this launch did not register (``registered_now``: those it did)."""
        return tuple(g for g in self.registered_groups if g not in set(registered_now))

    def for_launch(self, registered_now: Any = ()) -> Plan:
        """What this launch can apply: the sites of groups whose registration is still pending on NCCL's defaults
        (their entries need registered buffers, which exist from the next launch)."""
        pending = set(self.pending_groups(registered_now))
        if not pending:
            return self
        sites = [sid for sid, e in self.entries.items() if e.group in pending and not e.config.is_default()]
        return replace(self.with_defaults(sites, note="registered buffers from the next launch"), stats=self.stats)

    def verdict(self, phase: str, reason: str | None, *, registered_now: Any = ()) -> Plan:
        """This plan with its verification's outcome in ``stats``. While a registration is pending, this launch
        verified only part of it: the verdict goes to ``verification_unregistered`` and the plan stays unverified,
        so the next launch, with the buffers registered, verifies all of it."""
        if self.pending_groups(registered_now):
            return self.with_stats(
                verification=None, verification_unregistered=phase, verification_unregistered_reason=reason
            )
        return self.with_stats(verification=phase, verification_reason=reason)

    def with_defaults(self, site_ids: Any, *, note: str) -> Plan:
        """A copy with ``site_ids`` on NCCL's defaults, noted (``stats["sites_reverted"]``); KeyError if unknown."""
        entries = dict(self.entries)
        for sid in sorted(site_ids):
            if sid not in entries:
                raise KeyError(f"plan {self.digest()[:12]} has no site {sid!r}")
            e = entries[sid]
            entries[sid] = replace(
                e,
                config=CommConfig(),
                predicted_t_region_us=e.predicted_default_t_region_us,
                note="; ".join(x for x in (e.note, note) if x),
            )
        done = sorted({*self.stats.get("sites_reverted", ()), *site_ids})
        return replace(self, entries=entries, stats={**self.stats, "sites_reverted": done})


def shown(values: dict[str, Any], key: str) -> str:
    """``repr`` of ``values[key]``, or ``(missing)`` when the key is absent (not the ``None`` of ``.get``)."""
    return repr(values[key]) if key in values else "(missing)"


def diff_plans(a: Plan, b: Plan) -> list[str]:
    """Human-readable differences between two plans, one line each; a missing key equals None."""
    lines = []
    for k in sorted(set(a.fingerprint) | set(b.fingerprint)):
        if a.fingerprint.get(k) != b.fingerprint.get(k):
            lines.append(f"fingerprint.{k}: {shown(a.fingerprint, k)} -> {shown(b.fingerprint, k)}")
    if a.method != b.method:
        lines.append(f"method: {a.method} -> {b.method}")
    for k in sorted(set(a.env) | set(b.env)):
        if a.env.get(k) != b.env.get(k):
            lines.append(f"env.{k}: {shown(a.env, k)} -> {shown(b.env, k)}")
    for site in sorted(set(a.entries) | set(b.entries)):
        ea, eb = a.entries.get(site), b.entries.get(site)
        if ea is None or eb is None:
            lines.append(f"{site}: {'only in second' if ea is None else 'only in first'}")
        elif ea.config != eb.config:
            lines.append(f"{site}: {ea.config.to_dict()} -> {eb.config.to_dict()}")
    return lines
