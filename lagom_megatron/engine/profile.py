"""Profile files: what the warm-up profiler (or the simulator) measured; all the search sees of the system.
A ``Sample``: one region under one config (us, slowest rank), ``t_region_us`` from collective start to end of both."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from lagom_megatron.engine.files import write_json_atomic
from lagom_megatron.engine.knobs import CommConfig

PROFILE_SCHEMA_VERSION = 1

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")
REGISTRATIONS: tuple[str, ...] = ("", "pool", "symmetric", "fixed")
BACKENDS: tuple[str, ...] = ("nccl", "gloo", "sim")


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveSite:
    """An overlapped collective's call site, stable across iterations and ranks; ``nbytes``: AG output, RS input."""

    site_id: str
    op: str
    nbytes: int
    dtype: str
    group: str
    """Megatron process-group name: dp, dp_cp, tp, pp, ep, cp, ..."""
    group_size: int
    n_nodes: int = 1
    calls_per_iter: int = 1
    reduce_op: str | None = None
    """NCCL runs no NVLS for ``avg``."""
    parts: tuple[tuple[str, int], ...] = ()
    """(dtype, bytes) per tensor of a coalesced call (NCCL bins them, ``nccl.bins``); empty = one of ``dtype``."""
    registered: str = ""
    """``--use-nccl-ub``: "" none, ``pool``, ``symmetric`` (asks no tuner), ``fixed`` (own communicator only)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple((str(d), int(b)) for d, b in self.parts))
        if self.registered not in REGISTRATIONS:
            raise ValueError(
                f"site {self.site_id!r}: registered must be one of {list(REGISTRATIONS)}; got {self.registered!r}"
            )
        if self.op not in OPS:
            raise ValueError(f"site {self.site_id!r}: op must be one of {list(OPS)}; got {self.op!r}")
        if self.nbytes < 0:
            raise ValueError(f"site {self.site_id!r}: nbytes must be >= 0; got {self.nbytes}")
        if self.group_size < 1 or self.n_nodes < 1 or self.calls_per_iter < 1:
            raise ValueError(
                f"site {self.site_id!r}: group_size ({self.group_size}), n_nodes ({self.n_nodes}) and "
                f"calls_per_iter ({self.calls_per_iter}) must all be >= 1"
            )


CallTimes = tuple[float, float, float]
"""One call's (t_comm_us, t_comp_us, t_region_us); t_comp_us is NaN where it was not measured."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One region under one config (us); ``calls`` in issue order."""

    site_id: str
    config: CommConfig
    t_comm_us: float
    t_comp_us: float
    t_region_us: float
    iteration: int = 0
    calls: tuple[CallTimes, ...] = ()


@dataclass(kw_only=True, slots=True)
class Profile:
    """Everything the search needs: sites, measured samples, and the iteration they belong to."""

    backend: str
    cluster: str
    iteration_us: float
    """Median under NCCL defaults."""
    sites: list[CollectiveSite]
    samples: list[Sample]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    schema_version: int = PROFILE_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "backend": self.backend,
            "cluster": self.cluster,
            "iteration_us": self.iteration_us,
            "fingerprint": self.fingerprint,
            "sites": [_site_dict(s) for s in self.sites],
            "samples": [
                {
                    "site_id": s.site_id,
                    "config": s.config.to_dict(),
                    "t_comm_us": s.t_comm_us,
                    "t_comp_us": s.t_comp_us,
                    "t_region_us": s.t_region_us,
                    "iteration": s.iteration,
                    **({"calls": [list(c) for c in s.calls]} if s.calls else {}),
                }
                for s in self.samples
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Builds a profile from ``to_dict`` output that ``config.plan_files.ProfileSchema`` accepts."""
        samples = [
            Sample(
                site_id=s["site_id"],
                config=CommConfig.from_dict(s["config"]),
                t_comm_us=float(s["t_comm_us"]),
                t_comp_us=float(s["t_comp_us"]),
                t_region_us=float(s["t_region_us"]),
                iteration=s.get("iteration", 0),
                calls=tuple(tuple(map(float, c)) for c in s.get("calls", ())),
            )
            for s in data["samples"]
        ]
        return cls(
            backend=data["backend"],
            cluster=data["cluster"],
            iteration_us=float(data["iteration_us"]),
            sites=[CollectiveSite(**s) for s in data["sites"]],
            samples=samples,
            fingerprint=dict(data.get("fingerprint", {})),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Writes the profile as JSON atomically (temporary file in the same folder + rename)."""
        write_json_atomic(path, self.to_dict())


_SITE_DEFAULTS = {"reduce_op": None, "parts": (), "registered": ""}


def _site_dict(s: CollectiveSite) -> dict[str, Any]:
    out = {k: getattr(s, k) for k in CollectiveSite.__slots__ if k not in _SITE_DEFAULTS}
    for k, default in _SITE_DEFAULTS.items():
        v = getattr(s, k)
        if v != default:
            out[k] = [list(p) for p in v] if k == "parts" else v
    return out
