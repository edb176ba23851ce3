"""Plan and profile files (JSON; ``engine.plan``, ``engine.profile``): one schema each, one reader for every user."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator

from lagom_megatron.engine.files import read_json
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import MECHANISMS, PLAN_SCHEMA_VERSION, Plan, PlanEntry
from lagom_megatron.engine.profile import BACKENDS, OPS, PROFILE_SCHEMA_VERSION, REGISTRATIONS, CollectiveSite, Profile
from lagom_megatron.engine.search import METHODS
from lagom_megatron.engine.steps import Phase

MAX_NBYTES = 1 << 40
VERIFICATION_STATES = (Phase.APPLIED.value, Phase.FELL_BACK.value)
"""A plan's ``stats.verification``: what its run's verification decided (``fell_back``: kept off)."""

Op = Literal[OPS]  # type: ignore[valid-type]
Backend = Literal[BACKENDS]  # type: ignore[valid-type]

DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
    "complex128",
    "unknown",
)
"""torch dtype names as ``megatron.hooks.sites.dtype_name`` writes them; ``unknown``: a call without a tensor."""
Dtype = Literal[DTYPES]  # type: ignore[valid-type]


def _finite(v: float) -> float:
    if not math.isfinite(v):
        raise ValueError("must be a finite number")  # the one-line error adds "; got <value>"
    return v


def _parts(v: list[list[Any]]) -> list[list[Any]]:
    for k, p in enumerate(v):
        if len(p) != 2 or not isinstance(p[0], str) or isinstance(p[1], bool) or not isinstance(p[1], int) or p[1] < 0:
            raise ValueError(f"parts[{k}] must be [dtype, bytes] with bytes an integer >= 0; got {p!r}")
    return v


def _config(v: dict[str, Any]) -> dict[str, Any]:
    CommConfig.from_dict(v)
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _defaults(cls: type) -> dict[str, Any]:
    """A dataclass's field defaults: an optional field of a schema takes its default from the class it builds."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


_SITE, _ENTRY = _defaults(CollectiveSite), _defaults(PlanEntry)


class SiteSchema(_Strict):
    """A profile's ``sites[]`` item (``engine.profile.CollectiveSite``)."""

    site_id: str = Field(min_length=1)
    op: Op
    nbytes: StrictInt = Field(ge=0, le=MAX_NBYTES)
    dtype: Dtype
    group: str = Field(min_length=1)
    group_size: StrictInt = Field(ge=2)
    n_nodes: StrictInt = Field(default=_SITE["n_nodes"], ge=1)
    calls_per_iter: StrictInt = Field(default=_SITE["calls_per_iter"], ge=1)
    reduce_op: str | None = _SITE["reduce_op"]
    parts: list[list[Any]] = Field(default_factory=list)
    registered: Literal[REGISTRATIONS] = _SITE["registered"]  # type: ignore[valid-type]

    _check_parts = field_validator("parts")(lambda v: _parts(v))


class SampleSchema(_Strict):
    """A profile's ``samples[]`` item (``engine.profile.Sample``); times in microseconds, >= 0."""

    site_id: str
    config: dict[str, Any]
    t_comm_us: float = Field(ge=0)
    t_comp_us: float = Field(ge=0)
    t_region_us: float = Field(ge=0)
    iteration: StrictInt = 0
    calls: list[tuple[float, float, float]] = Field(default_factory=list)
    model_config = ConfigDict(extra="forbid", strict=False)

    _finite_times = field_validator("t_comm_us", "t_comp_us", "t_region_us")(_finite)
    _check_config = field_validator("config")(_config)

    @field_validator("calls", mode="before")
    @classmethod
    def _call_shape(cls, v: Any) -> Any:
        if not isinstance(v, list):
            raise ValueError(f"must be a list of [t_comm_us, t_comp_us, t_region_us] (one per call); got {v!r}")
        for k, c in enumerate(v):
            if not isinstance(c, list) or len(c) != 3:
                raise ValueError(f"calls[{k}] must be three times [t_comm_us, t_comp_us, t_region_us]; got {c!r}")
        return v

    @field_validator("calls")
    @classmethod
    def _call_times(cls, v: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
        for k, c in enumerate(v):
            if not all(math.isfinite(x) and x >= 0 for x in c):
                raise ValueError(
                    f"calls[{k}] must be three finite times >= 0 (t_comm_us, t_comp_us, t_region_us); got {list(c)}"
                )
        return v


class RunFingerprintSchema(BaseModel):
    """The keys every run and the simulator write; other keys pass."""

    model_config = ConfigDict(extra="allow", strict=True)
    world_size: StrictInt = Field(ge=1)
    backend: Backend
    cluster: str = Field(min_length=1)


class ProfileSchema(_Strict):
    """A profile file (``engine.profile.Profile.to_dict``)."""

    schema_version: Literal[PROFILE_SCHEMA_VERSION]  # type: ignore[valid-type]
    backend: Backend
    cluster: str = Field(min_length=1)
    iteration_us: float = Field(gt=0)
    fingerprint: RunFingerprintSchema
    sites: list[SiteSchema] = Field(min_length=1)
    samples: list[SampleSchema]
    model_config = ConfigDict(extra="forbid", strict=False)

    _finite_iteration = field_validator("iteration_us")(_finite)

    @model_validator(mode="after")
    def _fingerprint_of_this_run(self) -> ProfileSchema:
        if self.fingerprint.backend != self.backend:
            raise ValueError(
                f"fingerprint.backend {self.fingerprint.backend!r} is not the profile's backend {self.backend!r}"
            )
        return self

    @model_validator(mode="after")
    def _sites_once_and_sampled_sites_listed(self) -> ProfileSchema:
        seen: set[str] = set()
        for s in self.sites:
            if s.site_id in seen:
                raise ValueError(f"site {s.site_id!r} is listed twice (each site once)")
            seen.add(s.site_id)
        for smp in self.samples:
            if smp.site_id not in seen:
                raise ValueError(f"sample for unknown site {smp.site_id!r}")
        return self

    @model_validator(mode="after")
    def _sizes_within_the_run(self) -> ProfileSchema:
        for s in self.sites:  # each node of a group holds at least one of its ranks
            if s.n_nodes > s.group_size:
                raise ValueError(
                    f"site {s.site_id!r}: n_nodes {s.n_nodes} exceeds its group_size {s.group_size}; "
                    f"allowed: 1..{s.group_size} (each node holds at least one rank of the group)"
                )
        for k, smp in enumerate(self.samples):  # a region's compute is part of one iteration
            if smp.t_comp_us > self.iteration_us:
                raise ValueError(
                    f"samples[{k}] (site {smp.site_id!r}): t_comp_us {smp.t_comp_us:g} exceeds the profile's "
                    f"iteration_us {self.iteration_us:g}; allowed: 0..{self.iteration_us:g} (a region's compute "
                    "is part of one iteration)"
                )
        return self


class EntrySchema(_Strict):
    """A plan's ``entries{}`` value (``engine.plan.PlanEntry``)."""

    config: dict[str, Any]
    predicted_t_comm_us: float = Field(ge=0)
    predicted_t_region_us: float = Field(ge=0)
    predicted_default_t_region_us: float = Field(default=_ENTRY["predicted_default_t_region_us"], ge=0)
    group: str = Field(min_length=1)
    op: Op = _ENTRY["op"]
    nbytes: StrictInt = Field(default=_ENTRY["nbytes"], ge=0, le=MAX_NBYTES)
    group_size: StrictInt = Field(default=_ENTRY["group_size"], ge=0)
    n_nodes: StrictInt = Field(default=_ENTRY["n_nodes"], ge=1)
    tunable: list[str] = Field(default_factory=list)
    note: str = _ENTRY["note"]
    reduce_op: str | None = _ENTRY["reduce_op"]
    parts: list[list[Any]] = Field(default_factory=list)
    model_config = ConfigDict(extra="forbid", strict=False)

    _check_parts = field_validator("parts")(lambda v: _parts(v))
    _check_config = field_validator("config")(_config)


class FingerprintSchema(BaseModel):
    """A plan's fingerprint fields that have a valid range; other keys pass."""

    model_config = ConfigDict(extra="allow", strict=True)
    world_size: StrictInt | None = Field(default=None, ge=1)
    backend: Backend | None = None


class PlanSchema(_Strict):
    """A plan file (``engine.plan.Plan.to_dict``); absent fields take ``Plan``'s defaults."""

    schema_version: Literal[PLAN_SCHEMA_VERSION]  # type: ignore[valid-type]
    method: Literal[METHODS] = Plan.method  # type: ignore[valid-type]
    backend: Backend = Plan.backend
    mechanism: str = Plan.mechanism
    fingerprint: FingerprintSchema = Field(default_factory=FingerprintSchema)
    env: dict[str, str] = Field(default_factory=dict)
    entries: dict[str, EntrySchema]
    stats: dict[str, Any] = Field(default_factory=dict)
    registered_groups: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _registered_groups(self) -> PlanSchema:
        groups = {e.group for e in self.entries.values()}
        bad = [g for g in self.registered_groups if g not in groups]
        if bad or len(set(self.registered_groups)) != len(self.registered_groups):
            raise ValueError(
                f"registered_groups must name distinct process groups of the plan's entries {sorted(groups)}; "
                f"got {self.registered_groups}"
            )
        return self

    @model_validator(mode="after")
    def _verification_state(self) -> PlanSchema:
        state = self.stats.get("verification")
        if state is not None and state not in VERIFICATION_STATES:
            raise ValueError(
                f"stats.verification must be one of {list(VERIFICATION_STATES)} or absent (never verified: a "
                f"run measures it before applying it); got {state!r}, which a run would apply unmeasured"
            )
        return self

    @model_validator(mode="after")
    def _mechanism_of_backend(self) -> PlanSchema:
        allowed = MECHANISMS[self.backend]
        if self.mechanism not in allowed:
            raise ValueError(
                f"mechanism must be one of {list(allowed)} for backend {self.backend!r}; got {self.mechanism!r}"
            )
        return self


def _one_line(exc: ValidationError, source: str) -> ValueError:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    said = "; got " in msg  # a validator of ours that names the value already
    shown = "" if isinstance(value, (dict, list)) or err["type"] == "missing" or said else f"; got {value!r}"
    return ValueError(f"{source}: {loc + ': ' if loc else ''}{msg}{shown}")


def _check(schema: type[BaseModel], data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(
            f"{source}: expected a JSON object (a {schema.__name__.removesuffix('Schema').lower()}); "
            f"got a JSON {type(data).__name__}"
        )
    try:
        schema.model_validate(data)
    except ValidationError as exc:
        raise _one_line(exc, source) from None


def _has_only(data: Any, key: str, other: str) -> bool:
    return isinstance(data, dict) and key in data and other not in data


def load_plan(path: str | os.PathLike, command: str | None = None) -> Plan:
    """Reads, checks and builds a plan; FileNotFoundError, or a one-line ValueError (JSON position, schema error)."""
    data = read_json(path)
    if command and _has_only(data, "samples", "entries"):
        raise ValueError(
            f"{path} looks like a profile (it has samples, no entries); {command} reads plans "
            "(a profile is searched with lagom search --profile)"
        )
    _check(PlanSchema, data, str(path))
    return Plan.from_dict(data)


def load_profile(path: str | os.PathLike, command: str | None = None) -> Profile:
    """Reads, checks and builds a profile; raises as :func:`load_plan` (``looks like a plan`` with ``command``)."""
    data = read_json(path)
    if command and _has_only(data, "entries", "samples"):
        raise ValueError(
            f"{path} looks like a plan (it has entries, no samples); {command} reads profiles "
            "(a plan is read by lagom plan show | diff | validate | export)"
        )
    _check(ProfileSchema, data, str(path))
    return Profile.from_dict(data)
