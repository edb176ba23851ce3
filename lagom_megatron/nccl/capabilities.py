"""What this process can apply on NCCL, agreed by all ranks (else they hang, NVIDIA/nccl#1136); CollNet per
``src/init.cc:63`` @2.30, variables also from conf files (``src/misc/param.cc:27-67``, ``src/os/linux.cc:106-108``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lagom_megatron.engine.knobs import P2P_OPS
from lagom_megatron.engine.p2p import MAXCHANNELS, p2p_channels
from lagom_megatron.nccl.engine import runtime_engine
from lagom_megatron.nccl.options import KNOB_OVERRIDES, nccl_config_fields, runtime_nccl_version

ALGORITHM_SWITCHES: tuple[str, ...] = ("NCCL_NVLS_ENABLE", "NCCL_COLLNET_ENABLE", "NCCL_PAT_ENABLE", "NCCL_NET_PLUGIN")
"""Variables shaping the algorithm domain (a ``NCCL_NET_PLUGIN`` may rule out PAT, ``src/graph/tuning.cc:215-221``)."""

P2P_SWITCHES: tuple[str, ...] = ("NCCL_MIN_P2P_NCHANNELS", "NCCL_MAX_P2P_NCHANNELS")
"""Variables bounding P2P channels (``comm->p2pnChannels``, v2.30.7 ``src/graph/paths.cc:956-991``)."""

ENV_FAULT = ("NCCL_MAX_CTAS", "4")

FAULT_ENV = "LAGOM_INJECT_CAPABILITY_FAULT"
"""``<rank>[:<field>]``: that rank perturbs its record before comparing (tests; default ``plugin_loaded``)."""


@dataclass(frozen=True)
class Capabilities:
    """What one rank can apply; ``host`` is not compared, ``plugin_abi`` 0 unloaded, ``nvls_multicast`` None unknown."""

    torch_version: str
    nccl_version: tuple[int, int, int] | None
    config_fields: tuple[str, ...]
    plugin_loaded: bool
    plugin_abi: int
    nvls_multicast: bool | None
    collnet: bool
    overrides: tuple[tuple[str, str], ...]
    host: str = field(default="", compare=False)
    n_nodes: int = 1
    ranks_per_node: int = 1
    nccl_engine: str | None = None
    """``nccl.engine.NCCL2`` / ``LEGACY``: the class behind ``backend="nccl"``; None without NCCL."""

    COMPARED = (
        "torch_version",
        "nccl_version",
        "config_fields",
        "plugin_loaded",
        "plugin_abi",
        "nvls_multicast",
        "collnet",
        "overrides",
        "nccl_engine",
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples become lists)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Capabilities:
        """Rebuilds a record from ``to_dict`` output; ValueError names a key that is not a field."""
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown capability field(s) {unknown}; allowed: {sorted(allowed)}")
        d = dict(data)
        if d.get("nccl_version") is not None:
            d["nccl_version"] = tuple(d["nccl_version"])
        d["config_fields"] = tuple(d.get("config_fields", ()))
        d["overrides"] = tuple(tuple(x) for x in d.get("overrides", ()))
        return cls(**d)

    def with_topology(self, hosts: list[str]) -> Capabilities:
        """This record with ``n_nodes`` / ``ranks_per_node`` counted from every rank's host."""
        counts: dict[str, int] = {}
        for h in hosts:
            counts[h] = counts.get(h, 0) + 1
        return Capabilities(
            **{
                **asdict(self),
                "n_nodes": len(counts),
                "ranks_per_node": max(counts.values(), default=1),
                "nccl_version": self.nccl_version,
                "config_fields": self.config_fields,
                "overrides": self.overrides,
            }
        )

    def fixed_knobs(self) -> dict[str, str]:
        """Knob -> the variable (``NAME=value``) that fixes it for the whole process."""
        out: dict[str, str] = {}
        for var, value in self.overrides:
            for knob in KNOB_OVERRIDES.get(var, ()):
                out.setdefault(knob, f"{var}={value}")
        return out

    def switch(self, var: str) -> str | None:
        """Value of an ``ALGORITHM_SWITCHES`` variable, or None when unset."""
        return dict(self.overrides).get(var)

    def mechanism(self) -> str:
        """``tuner`` when NCCL loaded lagom's plugin with ABI v3+ (NCCL 2.22+), else ``communicator``."""
        return "tuner" if self.plugin_loaded and self.plugin_abi >= 3 else "communicator"


def differences(records: list[Capabilities]) -> list[tuple[int, str, Any, Any]]:
    """(rank, field, rank 0's value, that rank's value) for every compared field that differs."""
    out = []
    for r, rec in enumerate(records[1:], start=1):
        for name in Capabilities.COMPARED:
            a, b = getattr(records[0], name), getattr(rec, name)
            if a != b:
                out.append((r, name, a, b))
    return out


def conf_file_values(environ: Mapping[str, str], home: str | None = None) -> dict[str, str]:
    """Variables NCCL would load from its conf files at init that ``environ`` lacks (unreadable files skipped)."""
    paths = []
    user = environ.get("NCCL_CONF_FILE")
    if user:
        paths.append(Path(user))
    else:
        home = home if home is not None else environ.get("HOME")
        if home:
            paths.append(Path(home) / ".nccl.conf")
    paths.append(Path("/etc/nccl.conf"))
    out: dict[str, str] = {}
    for p in paths:
        try:
            lines = p.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            line = line.rstrip("\r")
            if not line or line.startswith("#") or "=" not in line:
                continue
            var, value = line.split("=", 1)
            if var not in environ and var not in out:
                out[var] = value
    return out


def knob_overrides(environ: Mapping[str, str], home: str | None = None) -> tuple[tuple[str, str], ...]:
    """Sorted (variable, value) pairs of ``environ`` and conf files that fix a knob or switch an algorithm."""
    merged = {**conf_file_values(environ, home), **{k: v for k, v in environ.items()}}
    wanted = set(KNOB_OVERRIDES) | set(ALGORITHM_SWITCHES) | set(P2P_SWITCHES)
    return tuple(sorted((k, str(v)) for k, v in merged.items() if k in wanted))


def host_id(environ: Mapping[str, str], boot_id_file: str = "/proc/sys/kernel/random/boot_id") -> str:
    """The host as NCCL tells hosts apart: ``NCCL_HOSTID``, else host name + boot id (``src/misc/utils.cc:117-135``)."""
    if environ.get("NCCL_HOSTID"):
        return environ["NCCL_HOSTID"]
    try:
        boot = Path(boot_id_file).read_text().strip()
    except OSError:
        boot = ""
    return socket.gethostname() + boot


def multicast_supported(device: int = 0) -> bool | None:
    """``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` (CUDA 12.1+) as ``src/transport/nvls.cc:273`` asks; None: unknown."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        value, dev = ctypes.c_int(0), ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), device) != 0:
            return None
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), 132, dev) != 0:
            return None
        return bool(value.value)
    except (OSError, AttributeError):
        return None


def nvls_available(multicast: bool | None, environ: Mapping[str, str]) -> bool | None:
    """Whether NCCL enables NVLS (``NCCL_NVLS_ENABLE`` 0, 1, else multicast; ``src/transport/nvls.cc:262-277``)."""
    flag = str(environ.get("NCCL_NVLS_ENABLE", "2")).strip()
    if flag == "0":
        return False
    if flag == "1":
        return True
    return multicast


def gather_local(
    *,
    environ: Mapping[str, str] | None = None,
    status_reader: Callable[[], Any] | None = None,
    nccl_version: tuple[int, int, int] | None | str = "detect",
    config_fields: tuple[str, ...] | None = None,
    multicast: bool | None | str = "detect",
    torch_version: str | None = None,
    nccl_engine: str | None = "detect",
) -> Capabilities:
    """This rank's ``Capabilities``, after NCCL's first communicator has loaded the plugin (``src/plugin/tuner.cc``)."""
    from lagom_megatron.nccl.plugin_status import read_plugin_status

    env = os.environ if environ is None else environ
    if torch_version is None:
        import torch

        torch_version = str(torch.__version__)
    version = runtime_nccl_version() if nccl_version == "detect" else nccl_version
    if config_fields is None:
        try:
            config_fields = tuple(sorted(nccl_config_fields())) if version is not None else ()
        except RuntimeError:
            config_fields = ()
    status = (status_reader or read_plugin_status)() if version is not None else None
    if multicast == "detect":
        multicast = None
        if version is not None:
            import torch

            multicast = multicast_supported(torch.cuda.current_device())
    loaded = status is not None and status.init_count > 0 and status.abi_version >= 3
    if nccl_engine == "detect":
        nccl_engine = runtime_engine() if version is not None else None
    return Capabilities(
        torch_version=torch_version,
        nccl_version=tuple(version) if version is not None else None,
        config_fields=tuple(sorted(config_fields)),
        plugin_loaded=loaded,
        plugin_abi=int(status.abi_version) if loaded else 0,
        nvls_multicast=nvls_available(multicast, env) if version is not None else None,
        collnet=str(env.get("NCCL_COLLNET_ENABLE", "0")).strip() == "1",
        overrides=knob_overrides(env),
        host=host_id(env),
        nccl_engine=nccl_engine,
    )


def perturb(caps: Capabilities, what: str = "plugin_loaded") -> Capabilities:
    """``caps`` with compared field ``what`` changed (fault injection, ``FAULT_ENV``); ValueError for other fields."""
    if what not in Capabilities.COMPARED:
        raise ValueError(f"{FAULT_ENV} field must be one of {list(Capabilities.COMPARED)}; got {what!r}")
    d = asdict(caps)
    if what == "plugin_loaded":
        d["plugin_loaded"], d["plugin_abi"] = not caps.plugin_loaded, (0 if caps.plugin_loaded else 6)
    elif what == "overrides":
        d["overrides"] = tuple(sorted((*caps.overrides, ("NCCL_MAX_CTAS", "4"))))
    elif what == "nvls_multicast":
        d["nvls_multicast"] = not caps.nvls_multicast
    elif what == "collnet":
        d["collnet"] = not caps.collnet
    elif what == "plugin_abi":
        d["plugin_abi"] = caps.plugin_abi + 1
    elif what == "nccl_version":
        d["nccl_version"] = (2, 21, 5) if caps.nccl_version != (2, 21, 5) else (2, 30, 3)
    elif what == "config_fields":
        d["config_fields"] = tuple(sorted({*caps.config_fields, "comm_name"}))
    else:
        d["torch_version"] = caps.torch_version + "+other"
    d["overrides"] = tuple(tuple(x) for x in d["overrides"])
    d["config_fields"] = tuple(d["config_fields"])
    return Capabilities(**d)


def fixed_knob_warning(knob: str, var: str) -> str:
    """The warning for a knob that variable ``var`` (``NAME=value``) fixes."""
    return f"{var} fixes {knob} for every communicator: {knob} is not searched (unset {var.split('=')[0]} to let lagom tune it)"


def restrict_domains(
    domains: dict[str, tuple], caps: Capabilities, *, op: str, n_nodes: int, mechanism: str
) -> tuple[dict[str, tuple], list[str]]:
    """``domains`` cut to what ``mechanism`` applies under ``caps``, and a warning per fixed knob: never ``n_threads``
    (read once, ``src/graph/tuning.cc:14``); NVLS needs support (``src/enqueue.cc:2004-2006``), across nodes CollNet
    (:2008, ``tuning.cc:503-506``); no PAT with NCCL_PAT_ENABLE=0 (:215) or a net plugin (:220) unless =1 (:217-219)."""
    d = dict(domains)
    warnings = []
    for knob, var in sorted(caps.fixed_knobs().items()):
        if knob in d and d[knob] != (None,):
            d[knob] = (None,)
            warnings.append(fixed_knob_warning(knob, var))
    d["n_threads"] = (None,)
    if op in P2P_OPS and d.get("n_channels", (None,)) != (None,):
        d["n_channels"] = _p2p_bounds(d["n_channels"], caps)
    if not (mechanism == "tuner" and caps.plugin_abi >= 6):
        d["chunk_size"] = (None,)
    algs = d.get("algorithm", (None,))
    if algs != (None,):
        keep = []
        for alg in algs:
            if alg in ("NVLS", "NVLSTree") and not caps.nvls_multicast:
                continue
            if alg == "NVLS" and n_nodes > 1 and not caps.collnet:
                continue
            if alg.startswith("CollNet") and not caps.collnet:
                continue
            if alg == "PAT" and str(caps.switch("NCCL_PAT_ENABLE") or "2").strip() == "0":
                continue
            if (
                alg == "PAT"
                and str(caps.switch("NCCL_NET_PLUGIN") or "none").strip().lower() not in ("none", "")
                and str(caps.switch("NCCL_PAT_ENABLE") or "2").strip() != "1"
            ):  # =1 skips the device test
                continue
            keep.append(alg)
        d["algorithm"] = tuple(keep) if len(keep) > 1 else (None,)
    return d, warnings


def _p2p_bounds(bounds: tuple, caps: Capabilities) -> tuple:
    """The least bound per distinct ``p2pnChannels`` under the run's P2P variables; ``(None,)`` when one is left."""

    def param(var: str, default: int) -> int:
        value = str(caps.switch(var) or "").strip()
        try:
            return int(value, 0)  # NCCL reads it with strtoll(.., 0) (src/misc/param.cc:93-96)
        except ValueError:
            return default

    lo, hi = param("NCCL_MIN_P2P_NCHANNELS", 1), param("NCCL_MAX_P2P_NCHANNELS", MAXCHANNELS)
    seen: dict[float, int] = {}
    for b in bounds:
        seen.setdefault(float(p2p_channels(b, min_p2p=lo, max_p2p=hi)), b)
    out = tuple(sorted(seen.values()))
    return out if len(out) > 1 else (None,)
