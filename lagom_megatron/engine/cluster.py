"""Cluster descriptions (``configs/clusters/<name>.yaml``): the hardware facts behind the cost model's priors.

Units in key names: ``*_gbps`` GB/s (bytes, as NCCL's bus bandwidth), ``*_us`` microseconds. Not a topology detector."""

from __future__ import annotations

import os
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
"""Bounds of a job's shape (``lagom doctor --gpus-per-node``, ``--world-size``, ``$WORLD_SIZE``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """One cluster: a node type, its interconnect and its NCCL version. On gloo: ``sms_per_gpu`` = CPU cores
    the ranks share, ``hbm_gbps`` = DRAM, ``nvlink_gbps_per_gpu`` = loopback."""

    name: str
    """Short name, also the YAML file's stem: ``h100-sxm-ib400``."""
    gpu: str
    sms_per_gpu: int
    """Streaming multiprocessors per GPU (CPU cores on gloo): one NCCL CTA occupies one SM."""
    hbm_gbps: float
    nvlink_gbps_per_gpu: float
    """Intra-node bandwidth per GPU and direction, GB/s (NVLink; loopback on gloo)."""
    gpus_per_node: int
    net_gbps_per_gpu: float
    """Inter-node network bandwidth per GPU and direction, GB/s (400 Gb/s NIC = 50 GB/s)."""
    peak_bf16_tflops: float
    """Dense BF16 peak, TFLOP/s (compute-time lower bounds in the simulator)."""
    nccl_version: str
    """NCCL runtime version, ``"2.27.5"``; ``"none"`` on gloo."""
    sm_arch: int
    """Compute capability times ten: 80 = Ampere, 90 = Hopper, 100 = Blackwell; 0 on CPU."""
    nvswitch: bool
    """NVSwitch in the node (needed, with sm90+, for the NVLS algorithms)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    collnet: bool = False
    """IB SHARP (CollNet) available in the network."""
    nvlink_latency_us: float = 1.0
    """Latency of one algorithm step inside a node, microseconds (Simple protocol)."""
    intra_link: Literal["nvlink", "pcie"] = "nvlink"
    """``nvlink`` or ``pcie`` (then ``nvlink_gbps_per_gpu`` is PCIe GB/s per GPU and direction)."""
    nics_per_node: int | None = None
    """Network cards per node; None = one per GPU (DGX-class). NCCL runs one ring per NIC."""
    kappa_mem: float | None = None
    """Simulator only: memory-bound kernels' queueing behind collective HBM traffic (``lagom calibrate contention``)."""
    kappa_compute: float | None = None
    """Simulator only: the same for compute-bound kernels; None = the simulator's default."""
    net_latency_us: float = 5.0
    """Latency of one algorithm step across nodes, microseconds (Simple protocol)."""
    nvlink_bridge_gbps: float | None = None
    """GB/s per direction of NVLink bridges between GPU pairs of a PCIe node (A40: 56.25); None = none."""
    coll_channels: int | None = None
    """NCCL's collective channels in one node, from its INFO log ("N coll channels"); None = the model's guess."""
    coll_channels_inter: int | None = None
    """The same across nodes; None = 16 on NVSwitch nodes (nccl#689), else ``coll_channels``."""
    # Measured bandwidth shape, written by ``lagom calibrate bandwidth`` from nccl-tests sweeps
    # (``sim.calibrate_bandwidth.fit_to_cluster_fields``); None or a protocol left out = the
    # simulator's own tables (``sim.device``).
    per_channel_gbps: dict[str, float] | None = None
    """GB/s of one Ring channel per protocol at 512 threads and NCCL's default chunk, before the link cap."""
    channel_thread_exponent: float | None = None
    """Per-channel bandwidth scales as ``(threads / 512) ** exponent`` (Simple and LL)."""
    bw_saturation_p: float | None = None
    """Sharpness ``p`` of the saturation ``bw = ((channels * per_channel)^-p + ceiling^-p)^(-1/p)``."""
    link_eff: dict[str, float] | None = None
    """Per protocol: the Ring bus-bandwidth ceiling inside a node over ``nvlink_gbps_per_gpu``."""
    net_eff: dict[str, float] | None = None
    """Per protocol: the Ring bus-bandwidth ceiling across nodes over ``net_gbps_per_gpu`` x ranks per node."""
    nvlink_domain_gpus: int | None = None
    """GPUs of one multi-node NVLink domain (GB200 NVL72: 72); None = the node's GPUs."""

    def nccl_nodes(self, hosts: int, group_size: int) -> int:
        """Nodes NCCL counts for ``group_size`` ranks over ``hosts`` hosts: one per NVLink domain spanned
        (NVIDIA/nccl v2.30.7 src/init.cc:1285-1297: an MNNVL clique is one ring node)."""
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
        """Loads ``configs/clusters/<name>.yaml`` or a YAML path (a ClusterSpec passes through); FileNotFoundError
        if neither; ValueError naming the file for a folder, bad text or YAML (line, column), or an invalid cluster."""
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
