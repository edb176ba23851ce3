"""``CommConfig`` knobs as ``ProcessGroupNCCL.Options`` attributes, or without the plugin per-function NCCL_ALGO and
NCCL_PROTO around an eager creation (NCCL 2.24+, re-read per communicator, ``src/graph/tuning.cc``; docs/nccl.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.nccl.env_vars import PER_COMMUNICATOR_OVERRIDES, TUNER_OVERRIDES

TUNER_COMM_TAG_ENV = "LAGOM_TUNER_COMM_TAG"
TUNER_CONFIG_ENV = "LAGOM_TUNER_CONFIG"
"""The plugin's plan table, read in ``init`` (``plugin.c`` ``lagomInit``); unset: ``NCCL_TUNER_CONFIG_FILE``."""
TUNER_NO_TABLE = "none"
"""``LAGOM_TUNER_CONFIG`` value for "no table", as ``""`` (no fallback; ``LAGOM_TUNER_NO_TABLE``, ``lagom_tuner.h``)."""
NONBLOCKING_ENV = "TORCH_NCCL_USE_COMM_NONBLOCKING"

KNOWN_CONFIG_FIELDS: frozenset[str] = frozenset(
    {
        "blocking",
        "cga_cluster_size",
        "min_ctas",
        "max_ctas",
        "net_name",
        "split_share",
        "traffic_class",
        "collnet_enable",
        "cta_policy",
        "nvls_ctas",
        "comm_name",
        "n_channels_per_net_peer",
    }
)
"""NCCLConfig attributes some torch binds (2.5-2.7: the first six; 2.8+: four more). ``n_channels_per_net_peer`` (NCCL
2.28) is bound by no torch we read (``torch/csrc/distributed/c10d/init.cpp`` @ce00583b): detected, never assumed."""

CTA_POLICIES: dict[str, int] = {"DEFAULT": 0, "EFFICIENCY": 1, "ZERO": 2}
"""ncclConfig_t.CTAPolicy values (NCCL_CTA_POLICY_*; ZERO usable from NCCL 2.28)."""

ALGORITHMS: dict[str, str] = {
    "tree": "Tree",
    "ring": "Ring",
    "collnetdirect": "CollNetDirect",
    "collnetchain": "CollNetChain",
    "nvls": "NVLS",
    "nvlstree": "NVLSTree",
    "pat": "PAT",
}

ALGORITHM_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "Ring": ("broadcast", "reduce", "allgather", "reducescatter", "allreduce"),
    "Tree": ("allreduce",),
    "CollNetDirect": ("allreduce", "allgather", "reducescatter"),
    "CollNetChain": ("allreduce",),
    "NVLS": ("allreduce", "allgather", "reducescatter"),
    "NVLSTree": ("allreduce",),
    "PAT": ("allgather", "reducescatter"),
}
"""NCCL functions each algorithm implements (NCCL_ALGO is per function: a bare ``Tree`` leaves all-gather none)."""

SIMPLE_ONLY_ALGORITHMS = frozenset({"CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT"})

PROTOCOLS: dict[str, str] = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}

OP_FUNCTIONS: dict[str, str | None] = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "reduce_scatter": "reducescatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_to_all": None,
    "send": None,
    "recv": None,
}


KNOB_OVERRIDES: dict[str, tuple[str, ...]] = {
    "NCCL_ALGO": ("algorithm",),
    "NCCL_PROTO": ("protocol",),
    "NCCL_MIN_CTAS": ("n_channels",),
    "NCCL_MAX_CTAS": ("n_channels",),
    "NCCL_MIN_NCHANNELS": ("n_channels",),
    "NCCL_MAX_NCHANNELS": ("n_channels",),
    "NCCL_NVLS_NCHANNELS": ("n_channels",),
    "NCCL_NTHREADS": ("n_threads",),
    "NCCL_LL128_NTHREADS": ("n_threads",),
    "NCCL_BUFFSIZE": ("chunk_size",),
    "NCCL_LL_BUFFSIZE": ("chunk_size",),
    "NCCL_LL128_BUFFSIZE": ("chunk_size",),
    "NCCL_CGA_CLUSTER_SIZE": ("cga_cluster_size",),
    "NCCL_CTA_POLICY": ("cta_policy",),
    "NCCL_NCHANNELS_PER_NET_PEER": ("net_peer_channels",),
    "TORCH_NCCL_HIGH_PRIORITY": ("high_priority_stream",),
}
"""Variable -> knobs it fixes globally: ``ncclConfig_t`` overrides (``src/init.cc`` ``envConfigOverride``),
NCCL_ALGO/NCCL_PROTO (``src/graph/tuning.cc:453-461``), NCCL_NTHREADS (``tuning.cc:14``), buffer sizes cap the chunk
(``src/init.cc:810-824``), TORCH_NCCL_HIGH_PRIORITY (``initNCCLComm``: ``getStreamFromPool(... || force_high)``)."""


def nccl_version_tuple(version: Any) -> tuple[int, int, int] | None:
    """Normalises ``torch.cuda.nccl.version()`` (a tuple, or an int code in old torch)."""
    if version is None:
        return None
    if isinstance(version, tuple):
        return tuple(int(v) for v in version[:3])  # type: ignore[return-value]
    code = int(version)
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return (code // 10000, code // 100 % 100, code % 100)
    return (code // 1000, code // 100 % 10, code % 100)


def runtime_nccl_version() -> tuple[int, int, int] | None:
    """The NCCL version torch runs with, e.g. ``(2, 27, 5)``; None when NCCL is unavailable."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return nccl_version_tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - any failure here means "unknown"
        return None


def nccl_config_fields(options_cls: Any = None) -> frozenset[str]:
    """``KNOWN_CONFIG_FIELDS`` that ``options_cls`` (default: torch's) exposes; RuntimeError when torch has no NCCL."""
    if options_cls is None:
        options_cls = nccl_module_parts()[1].Options
    config = options_cls().config
    return frozenset(name for name in KNOWN_CONFIG_FIELDS if hasattr(config, name))


def _canonical(value: str, table: Mapping[str, str], what: str) -> str:
    key = value.replace("_", "").replace("-", "").lower()
    if key not in table:
        raise ValueError(f"{what} {value!r} is not one of {sorted(set(table.values()))}")
    return table[key]


def _per_function(functions: Iterable[str], value: str) -> str:
    return ";".join(f"{fn}:{value}" for fn in functions)


def nccl_options_for(
    config: CommConfig,
    *,
    fields: Iterable[str] | None = None,
    nccl_version: tuple[int, int, int] | None = None,
    use_tuner_plugin: bool = False,
    op: str | None = None,
    tag: str | None = None,
) -> dict[str, dict[str, Any]]:
    """``config`` as one pool entry's NCCLConfig attributes and creation-time env, without ``n_threads``/``chunk_size``
    (``fields`` None = all known, ``nccl_version`` None = 2.28+); ValueError names the value and what is allowed."""
    fields = frozenset(KNOWN_CONFIG_FIELDS if fields is None else fields)
    version = nccl_version or (2, 99, 0)
    out: dict[str, Any] = {}
    env: dict[str, str] = {}

    def need(field: str, knob: str, since: str) -> None:
        if field not in fields:
            raise ValueError(
                f"{knob} needs NCCLConfig.{field}, which this torch does not bind "
                f"(bound: {sorted(fields)}); it needs torch {since}"
            )

    if config.n_channels is not None:
        limit = 64 if version >= (2, 25, 0) else 32
        n = config.n_channels
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= limit:
            raise ValueError(
                f"n_channels must be an integer in 1..{limit} for NCCL {'.'.join(map(str, version))}; got {n!r}"
            )
        need("min_ctas", "n_channels", ">= 2.1")
        need("max_ctas", "n_channels", ">= 2.1")
        out["min_ctas"] = out["max_ctas"] = n  # both ends: never a one-sided CTA range
        if "nvls_ctas" in fields:
            out["nvls_ctas"] = n
    if config.cga_cluster_size is not None:
        c = config.cga_cluster_size
        if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= 8:
            raise ValueError(f"cga_cluster_size must be an integer in 0..8; got {c!r}")
        need("cga_cluster_size", "cga_cluster_size", ">= 2.1")
        out["cga_cluster_size"] = c
    if config.net_peer_channels is not None:
        n = config.net_peer_channels
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64 or n & (n - 1):
            raise ValueError(f"net_peer_channels must be a power of two in 1..64; got {n!r}")
        if version < (2, 28, 0):
            raise ValueError(
                f"net_peer_channels as ncclConfig_t.nChannelsPerNetPeer needs NCCL >= 2.28; runtime "
                f"NCCL is {'.'.join(map(str, version))} (NCCL_NCHANNELS_PER_NET_PEER sets it per process)"
            )
        need("n_channels_per_net_peer", "net_peer_channels", "built with NCCL >= 2.28 that binds it")
        out["n_channels_per_net_peer"] = n
    if config.cta_policy is not None:
        name = str(config.cta_policy).upper()
        if name not in CTA_POLICIES:
            raise ValueError(f"cta_policy must be one of {list(CTA_POLICIES)}; got {config.cta_policy!r}")
        if name == "ZERO" and version < (2, 28, 0):
            raise ValueError(f"cta_policy ZERO needs NCCL >= 2.28; runtime NCCL is {'.'.join(map(str, version))}")
        need("cta_policy", "cta_policy", ">= 2.8")
        out["cta_policy"] = CTA_POLICIES[name]

    if not use_tuner_plugin and (config.algorithm is not None or config.protocol is not None):
        env.update(_algo_proto_env(config, op=op, version=version))
    if tag is not None:
        if not tag or len(tag) > 63 or not all(ch.isalnum() or ch in "_.:/-[]" for ch in tag):
            raise ValueError(f"tag must be 1-63 characters of letters, digits and _.:/-[]; got {tag!r}")
        env[TUNER_COMM_TAG_ENV] = tag
    return {"config": out, "env": env}


def _algo_proto_env(config: CommConfig, *, op: str | None, version: tuple[int, int, int]) -> dict[str, str]:
    functions: tuple[str, ...] = ALGORITHM_FUNCTIONS["Ring"]
    if op is not None:
        if op not in OP_FUNCTIONS:
            raise ValueError(f"op must be one of {sorted(OP_FUNCTIONS)}; got {op!r}")
        fn = OP_FUNCTIONS[op]
        if fn is None:
            raise ValueError(
                f"{op} is point-to-point: NCCL has no algorithm/protocol choice for it; "
                f"got algorithm={config.algorithm!r} protocol={config.protocol!r}"
            )
        functions = (fn,)
    if version < (2, 24, 0):
        raise ValueError(
            f"a per-communicator algorithm/protocol needs NCCL >= 2.24 (per-function "
            f"NCCL_ALGO syntax); runtime NCCL is {'.'.join(map(str, version))}: use the tuner plugin"
        )
    env: dict[str, str] = {}
    algo = None
    if config.algorithm is not None:
        algo = _canonical(config.algorithm, ALGORITHMS, "algorithm")
        functions = tuple(fn for fn in functions if fn in ALGORITHM_FUNCTIONS[algo])
        if not functions:
            raise ValueError(f"NCCL's {algo} does not implement {op}; it implements {list(ALGORITHM_FUNCTIONS[algo])}")
        env["NCCL_ALGO"] = _per_function(functions, algo)
    if config.protocol is not None:
        proto = _canonical(config.protocol, PROTOCOLS, "protocol")
        if proto == "LL128":
            raise ValueError(
                "protocol LL128 is never forced through NCCL_PROTO (NCCL enables it only "
                "where it is safe); use the tuner plugin, which prefers it only where NCCL enabled it"
            )
        if algo in SIMPLE_ONLY_ALGORITHMS and proto != "Simple":
            raise ValueError(f"NCCL runs {algo} with the Simple protocol only; got protocol {config.protocol!r}")
        env["NCCL_PROTO"] = _per_function(functions, proto)
    return env


def check_env_conflicts(
    environ: Mapping[str, str], *, use_tuner_plugin: bool, config: CommConfig | None = None, blocking_bound: bool = True
) -> None:
    """ValueError listing each variable ("" too; with ``config``, those fixing its knobs) that silently overrides a
    pool entry; a bound ``NCCLConfig.blocking`` beats ``NONBLOCKING_ENV`` (``ProcessGroupNCCL::useNonblocking``)."""

    def counts(var: str) -> bool:
        if var not in environ:
            return False
        if config is None:
            return True
        knobs = KNOB_OVERRIDES.get(var, ())
        return any(getattr(config, k, None) is not None for k in knobs)

    problems = [
        f"{var}={environ[var]!r} overrides {field} in every communicator"
        for var, field in PER_COMMUNICATOR_OVERRIDES.items()
        if counts(var)
    ]
    if use_tuner_plugin:
        problems += [f"{var}={environ[var]!r} {why}" for var, why in TUNER_OVERRIDES.items() if counts(var)]
    flag = environ.get(NONBLOCKING_ENV, "").strip().lower()
    if not blocking_bound and flag not in ("", "0", "false", "no", "off"):
        problems.append(
            f"{NONBLOCKING_ENV}={environ[NONBLOCKING_ENV]!r} creates communicators in a "
            "background thread, where per-communicator NCCL_ALGO/NCCL_PROTO and the "
            "tuner's communicator tag are not seen (this torch cannot make an entry blocking)"
        )
    if problems:
        raise ValueError(
            "the environment conflicts with lagom's per-communicator NCCL configuration: "
            + "; ".join(problems)
            + ". Unset these variables (lagom sets them per communicator)."
        )


def nccl_module_parts():
    """Returns (torch, ProcessGroupNCCL, torch.distributed) or raises "NCCL is not available"."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        raise RuntimeError(f"NCCL is not available: torch cannot be imported ({exc})") from exc
    if not dist.is_available() or not dist.is_nccl_available():
        raise RuntimeError(
            f"NCCL is not available: torch {torch.__version__} was built without NCCL "
            "(a CPU build); use the gloo backend"
        )
    return torch, dist.ProcessGroupNCCL, dist


def build_options(config_fields: Mapping[str, Any], *, options_cls: Any, high_priority_stream: bool = False) -> Any:
    """``options_cls(...)`` with ``config_fields`` and, where bound, ``blocking = 1``; ValueError: unknown attribute."""
    opts = options_cls(is_high_priority_stream=high_priority_stream)
    for name, value in {**config_fields, **({"blocking": 1} if hasattr(opts.config, "blocking") else {})}.items():
        if not hasattr(opts.config, name):
            raise ValueError(f"NCCLConfig of this torch has no attribute {name!r}")
        setattr(opts.config, name, value)
    return opts
