"""Profile and plan readers over ``cli.schemas`` that say so when given a profile for a plan (or the reverse)."""

from __future__ import annotations

from typing import Any
import math
from typing import Any, Literal
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator
from lagom_megatron.engine.files import read_json
from lagom_megatron.engine.profile import BACKENDS, OPS, REGISTRATIONS
from lagom_megatron.engine.search import METHODS
from lagom_megatron.nccl.rules import MECHANISMS


def read_plan(path: str, command: str):
    """``schemas.load_plan(path)``; ValueError ``<path> looks like a profile ...; <command> reads plans`` for one."""

    return _load(load_plan, path, "profile", f"{path} looks like a profile (it has samples, no entries); {command} reads "
                 "plans (a profile is searched with lagom search --profile)")


def read_profile(path: str, command: str):
    """``schemas.load_profile(path)``; ValueError ``<path> looks like a plan ...; <command> reads profiles`` for one."""

    return _load(load_profile, path, "plan", f"{path} looks like a plan (it has entries, no samples); {command} reads "
                 "profiles (a plan is read by lagom plan show | diff | validate | export)")


def _load(loader, path: str, other: str, message: str):
    try:
        return loader(path)
    except ValueError:
        if _kind(path) == other:
            raise ValueError(message) from None
        raise


def _kind(path: str) -> str | None:
    from lagom_megatron.engine.files import read_json

    try:
        data: Any = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if "samples" in data and "entries" not in data:
        return "profile"
    if "entries" in data and "samples" not in data:
        return "plan"
    return None


MAX_NBYTES = 1 << 40
"""Largest message a site may hold, bytes (1 TiB)."""

MECHANISMS_OF: dict[str, tuple[str, ...]] = {"gloo": ("gloo",), "nccl": MECHANISMS, "sim": MECHANISMS}

Op = Literal[OPS]  # type: ignore[valid-type]

DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
          "float8_e5m2fnuz", "int8", "uint8", "int16", "int32", "int64", "bool", "complex64", "complex128", "unknown")
"""torch dtype names as ``megatron.sites.dtype_name`` writes them; ``unknown``: a call without a tensor."""
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SiteSchema(_Strict):
    """A profile's ``sites[]`` item (``engine.profile.CollectiveSite``)."""

    site_id: str = Field(min_length=1)
    op: Op
    nbytes: StrictInt = Field(ge=0, le=MAX_NBYTES)
    dtype: Dtype
    group: str = Field(min_length=1)
    group_size: StrictInt = Field(ge=2)
    n_nodes: StrictInt = Field(default=1, ge=1)
    calls_per_iter: StrictInt = Field(default=1, ge=1)
    reduce_op: str | None = None
    parts: list[list[Any]] = Field(default_factory=list)
    """(dtype, bytes) per tensor of a coalesced call."""
    registered: Literal[REGISTRATIONS] = ""  # type: ignore[valid-type]

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
    """Per call (t_comm_us, t_comp_us, t_region_us), optional."""
    model_config = ConfigDict(extra="forbid", strict=False)

    _finite_times = field_validator("t_comm_us", "t_comp_us", "t_region_us")(_finite)

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
                raise ValueError(f"calls[{k}] must be three finite times >= 0 (t_comm_us, t_comp_us, t_region_us); got {list(c)}")
        return v


class RunFingerprintSchema(BaseModel):
    """A profile's fingerprint: the keys every run and the simulator write; other keys pass."""

    model_config = ConfigDict(extra="allow", strict=True)
    world_size: StrictInt = Field(ge=1)
    backend: Literal[BACKENDS]  # type: ignore[valid-type]
    cluster: str = Field(min_length=1)


class ProfileSchema(_Strict):
    """A profile file (``engine.profile.Profile.to_dict``)."""

    schema_version: Literal[1]
    backend: Literal[BACKENDS]  # type: ignore[valid-type]
    cluster: str = Field(min_length=1)
    iteration_us: float = Field(gt=0)
    fingerprint: RunFingerprintSchema
    sites: list[SiteSchema] = Field(min_length=1)
    samples: list[SampleSchema]
    model_config = ConfigDict(extra="forbid", strict=False)

    _finite_iteration = field_validator("iteration_us")(_finite)

    @model_validator(mode="after")
    def _fingerprint_of_this_run(self) -> "ProfileSchema":
        if self.fingerprint.backend != self.backend:
            raise ValueError(f"fingerprint.backend {self.fingerprint.backend!r} is not the profile's backend "
                             f"{self.backend!r}")
        return self

    @model_validator(mode="after")
    def _unique_sites(self) -> "ProfileSchema":
        seen: set[str] = set()
        for s in self.sites:
            if s.site_id in seen:
                raise ValueError(f"site {s.site_id!r} is listed twice (each site once)")
            seen.add(s.site_id)
        return self


class EntrySchema(_Strict):
    """A plan's ``entries{}`` value (``engine.plan.PlanEntry``)."""

    config: dict[str, Any]
    predicted_t_comm_us: float = Field(ge=0)
    predicted_t_region_us: float = Field(ge=0)
    predicted_default_t_region_us: float = Field(default=0.0, ge=0)
    group: str = Field(min_length=1)
    op: Op = "all_reduce"
    nbytes: StrictInt = Field(default=0, ge=0, le=MAX_NBYTES)
    group_size: StrictInt = Field(default=0, ge=0)
    n_nodes: StrictInt = Field(default=1, ge=1)
    tunable: list[str] = Field(default_factory=list)
    note: str = ""
    reduce_op: str | None = None
    parts: list[list[Any]] = Field(default_factory=list)
    model_config = ConfigDict(extra="forbid", strict=False)

    _check_parts = field_validator("parts")(lambda v: _parts(v))


class FingerprintSchema(BaseModel):
    """A plan's fingerprint fields that have a valid range; other keys pass."""

    model_config = ConfigDict(extra="allow", strict=True)
    world_size: StrictInt | None = Field(default=None, ge=1)
    backend: Literal[BACKENDS] | None = None  # type: ignore[valid-type]


class PlanSchema(_Strict):
    """A plan file (``engine.plan.Plan.to_dict``)."""

    schema_version: Literal[1]
    method: Literal[METHODS] = "priority"  # type: ignore[valid-type]
    backend: Literal[BACKENDS] = "nccl"  # type: ignore[valid-type]
    mechanism: str = "tuner"
    fingerprint: FingerprintSchema = Field(default_factory=FingerprintSchema)
    env: dict[str, str] = Field(default_factory=dict)
    entries: dict[str, EntrySchema]
    stats: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _mechanism_of_backend(self) -> "PlanSchema":
        allowed = MECHANISMS_OF[self.backend]
        if self.mechanism not in allowed:
            raise ValueError(f"mechanism must be one of {list(allowed)} for backend {self.backend!r}; "
                             f"got {self.mechanism!r}")
        return self


def _one_line(exc: ValidationError, source: str) -> ValueError:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    said = "; got " in msg  # a validator of ours that names the value already
    shown = "" if isinstance(value, (dict, list)) or err["type"] == "missing" or said else f"; got {value!r}"
    return ValueError(f"{source}: {loc + ': ' if loc else ''}{msg}{shown}")


def check_profile(data: Any, source: str) -> None:
    """Raises ValueError (one line) when ``data`` is not a valid profile (``ProfileSchema``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object (a profile); got a JSON {type(data).__name__}")
    try:
        ProfileSchema.model_validate(data)
    except ValidationError as exc:
        raise _one_line(exc, source) from None


def check_plan(data: Any, source: str) -> None:
    """Raises ValueError (one line) when ``data`` is not a valid plan (``PlanSchema``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a plan must be a JSON object; got {type(data).__name__}")
    try:
        PlanSchema.model_validate(data)
    except ValidationError as exc:
        raise _one_line(exc, source) from None


def load_profile(path: str):
    """Reads, checks and builds a profile; FileNotFoundError, or ValueError (one line) for an invalid one."""
    from lagom_megatron.engine.profile import Profile

    data = read_json(path)
    check_profile(data, str(path))
    return Profile.from_dict(data, source=str(path))


def load_plan(path: str):
    """Reads, checks and builds a plan; FileNotFoundError, or ValueError (one line) for an invalid one."""
    from lagom_megatron.engine.plan import Plan

    data = read_json(path)
    check_plan(data, str(path))
    return Plan.from_dict(data, source=str(path))
