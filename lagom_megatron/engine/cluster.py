"""Cluster files (``configs/clusters/<name>.yaml``): the hardware facts behind the cost model's priors, not detected.
Units in key names: ``*_gbps`` GB/s (bytes, as NCCL's bus bandwidth), ``*_us`` microseconds."""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from lagom_megatron import configs_dir
from lagom_megatron.engine.files import yaml_error_text

CLUSTERS_DIR = configs_dir()[0] / "clusters"
PROTOCOLS = ("LL", "LL128", "Simple")
"""NCCL protocol names, as ``engine.knobs.PROTOCOLS`` (which imports this module; a test keeps them equal)."""
MAX_GPUS_PER_NODE = 1024
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """A node type, its interconnect and NCCL; gloo: ``sms_per_gpu`` = shared CPU cores, ``hbm_gbps`` = DRAM."""

    name: str
    gpu: str
    sms_per_gpu: int
    hbm_gbps: float
    nvlink_gbps_per_gpu: float
    """Intra-node, per direction (loopback on gloo)."""
    gpus_per_node: int
    net_gbps_per_gpu: float
    """Per direction (a 400 Gb/s NIC per GPU = 50)."""
    peak_bf16_tflops: float
    nccl_version: str
    sm_arch: int
    """Compute capability times ten: 80 = Ampere, 90 = Hopper, 100 = Blackwell; 0 on CPU."""
    nvswitch: bool
    """NVSwitch in the node (needed, with sm90+, for the NVLS algorithms)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    collnet: bool = False
    nvlink_latency_us: float = 1.0
    """One algorithm step (Simple protocol); ``net_latency_us`` across nodes."""
    intra_link: Literal["nvlink", "pcie"] = "nvlink"
    """``nvlink`` or ``pcie`` (then ``nvlink_gbps_per_gpu`` is PCIe GB/s per GPU and direction)."""
    nics_per_node: int | None = None
    """Network cards per node; None = one per GPU (DGX-class). NCCL runs one ring per NIC."""
    kappa_mem: float | None = None
    """Simulator only: memory- (``kappa_compute``: compute-) bound kernels' queueing behind collective HBM traffic."""
    kappa_compute: float | None = None
    net_latency_us: float = 5.0
    nvlink_bridge_gbps: float | None = None
    """GB/s per direction of NVLink bridges between GPU pairs of a PCIe node (A40: 56.25); None = none."""
    coll_channels: int | None = None
    """NCCL's collective channels in one node, from its INFO log ("N coll channels"); None = the model's guess."""
    coll_channels_inter: int | None = None
    """The same across nodes; None = 16 on NVSwitch nodes (nccl#689), else ``coll_channels``."""
    # fitted by ``lagom calibrate bandwidth`` (docs/simulator.md); None or a protocol left out: ``sim.device``'s
    per_channel_gbps: dict[str, float] | None = None
    channel_thread_exponent: float | None = None
    bw_saturation_p: float | None = None
    link_eff: dict[str, float] | None = None
    net_eff: dict[str, float] | None = None
    nvlink_domain_gpus: int | None = None
    """GPUs of one multi-node NVLink domain (GB200 NVL72: 72); None = the node's GPUs."""

    def nccl_nodes(self, hosts: int, group_size: int) -> int:
        """Nodes NCCL counts: one per NVLink domain spanned (MNNVL clique, nccl v2.30.7 src/init.cc:1285-1297)."""
        if not self.nvlink_domain_gpus or self.nvlink_domain_gpus <= self.gpus_per_node:
            return int(hosts)
        hosts_per_domain = max(1, self.nvlink_domain_gpus // self.gpus_per_node)
        return max(1, -(-int(hosts) // hosts_per_domain))

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"cluster {self.name!r}: backend must be one of ['nccl', 'gloo']; got {self.backend!r}")
        for key in ("sms_per_gpu", "gpus_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster {self.name!r}: {key} must be an integer >= 1; got {value!r}")
        for key in ("hbm_gbps", "nvlink_gbps_per_gpu", "net_gbps_per_gpu", "peak_bf16_tflops"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"cluster {self.name!r}: {key} must be a number > 0 (GB/s or TFLOP/s); got {value!r}")
        for key in ("nvlink_latency_us", "net_latency_us"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"cluster {self.name!r}: {key} must be a number >= 0 (us); got {value!r}")
        if self.intra_link not in ("nvlink", "pcie"):
            raise ValueError(
                f"cluster {self.name!r}: intra_link must be one of ['nvlink', 'pcie']; got {self.intra_link!r}"
            )
        if self.nvlink_domain_gpus is not None and (
            isinstance(self.nvlink_domain_gpus, bool)
            or not isinstance(self.nvlink_domain_gpus, int)
            or self.nvlink_domain_gpus < self.gpus_per_node
        ):
            raise ValueError(
                f"cluster {self.name!r}: nvlink_domain_gpus must be an integer >= gpus_per_node "
                f"({self.gpus_per_node}) or absent; got {self.nvlink_domain_gpus!r}"
            )
        if self.nics_per_node is not None and (
            isinstance(self.nics_per_node, bool) or not isinstance(self.nics_per_node, int) or self.nics_per_node < 1
        ):
            raise ValueError(
                f"cluster {self.name!r}: nics_per_node must be an integer >= 1 or absent; got {self.nics_per_node!r}"
            )
        for key in ("kappa_mem", "kappa_compute"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"cluster {self.name!r}: {key} must be a number >= 0 or absent; got {value!r}")
        for key in ("coll_channels", "coll_channels_inter"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64):
                raise ValueError(f"cluster {self.name!r}: {key} must be an integer 1..64 or absent; got {value!r}")
        bridge = self.nvlink_bridge_gbps
        if bridge is not None and (isinstance(bridge, bool) or not isinstance(bridge, (int, float)) or not bridge > 0):
            raise ValueError(
                f"cluster {self.name!r}: nvlink_bridge_gbps must be a number > 0 (GB/s) or absent; got {bridge!r}"
            )
        if bridge is not None and self.intra_link != "pcie":
            raise ValueError(
                f"cluster {self.name!r}: nvlink_bridge_gbps describes NVLink bridges on a PCIe node; "
                f"it needs intra_link: pcie, got intra_link: {self.intra_link!r}"
            )
        for key in ("per_channel_gbps", "link_eff", "net_eff"):
            _check_per_protocol(self.name, key, getattr(self, key))
        for key, lo in (("channel_thread_exponent", 0.0), ("bw_saturation_p", 1.0)):
            value = getattr(self, key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= lo
            ):
                raise ValueError(f"cluster {self.name!r}: {key} must be a number >= {lo:g} or absent; got {value!r}")
        if self.backend == "nccl":
            parse_version(self.nccl_version)  # raises on a malformed version

    @property
    def nccl(self) -> tuple[int, int, int]:
        """The NCCL version as a tuple, ``(0, 0, 0)`` on gloo."""
        return parse_version(self.nccl_version) if self.backend == "nccl" else (0, 0, 0)

    def to_dict(self) -> dict[str, Any]:
        """All fields, JSON/YAML-ready."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "<cluster>") -> ClusterSpec:
        """Builds a spec from a mapping (parsed YAML); ValueError naming ``source`` on a bad, missing or unknown key."""
        if not isinstance(data, dict):
            got = "an empty file" if data is None else f"a {type(data).__name__}"
            raise ValueError(f"{source}: a cluster file must be a mapping of keys to values; got {got}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(f"{source}: unknown cluster key(s) {unknown}; allowed: {allowed}")
        missing = [k for k in required_keys() if k not in data]
        if missing:
            raise ValueError(
                f"{source}: missing cluster key(s) {', '.join(missing)}; every cluster file sets "
                f"{', '.join(required_keys())}"
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, name_or_path: str | os.PathLike | ClusterSpec) -> ClusterSpec:
        """Loads ``configs/clusters/<name>.yaml`` or a YAML path; FileNotFoundError if neither, ValueError if bad."""
        if isinstance(name_or_path, ClusterSpec):
            return name_or_path
        path = Path(name_or_path)
        if not path.is_file():
            candidate = CLUSTERS_DIR / f"{name_or_path}.yaml"
            if not candidate.is_file() and path.is_dir():
                raise ValueError(
                    f"cluster {str(name_or_path)!r} is a folder; give a cluster YAML file or one of: "
                    f"{', '.join(available_clusters())}"
                )
            if not candidate.is_file():
                raise FileNotFoundError(
                    f"cluster {str(name_or_path)!r} is neither a file nor one of {available_clusters()}"
                )
            path = candidate
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: {yaml_error_text(exc)}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None
        return cls.from_dict(data, source=str(path))


def _check_per_protocol(name: str, key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or not value:
        raise ValueError(f"cluster {name!r}: {key} must map protocols {list(PROTOCOLS)} to numbers > 0; got {value!r}")
    for proto, number in value.items():
        if proto not in PROTOCOLS:
            raise ValueError(f"cluster {name!r}: {key}: unknown protocol {proto!r}; allowed: {list(PROTOCOLS)}")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0 or number == float("inf"):
            raise ValueError(f"cluster {name!r}: {key}[{proto!r}] must be a finite number > 0; got {number!r}")


def required_keys() -> list[str]:
    """The keys a cluster file must set (the fields without a default), in field order."""
    return [f.name for f in fields(ClusterSpec) if f.default is MISSING and f.default_factory is MISSING]


def available_clusters() -> list[str]:
    """Names of the cluster files under ``configs/clusters``."""
    return sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml")) if CLUSTERS_DIR.is_dir() else []


def release(version: str) -> tuple[int, ...]:
    """Release numbers: ``"2.8.0a0+nv25"`` -> (2, 8, 0); ValueError unless it starts with a dotted number."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def parse_version(version: str) -> tuple[int, int, int]:
    """``"2.27.5"`` -> ``(2, 27, 5)``, ``"2.30"`` -> ``(2, 30, 0)``; ValueError otherwise."""
    parts = str(version).split(".")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        nums = []
    if not 2 <= len(nums) <= 3:
        raise ValueError(f"nccl_version must look like '2.27.5'; got {version!r}")
    nums += [0] * (3 - len(nums))
    return (nums[0], nums[1], nums[2])
