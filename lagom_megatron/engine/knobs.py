"""Communication configurations (NCCL knobs) and their domains.

A ``CommConfig`` is one point of the knob space of one collective: algorithm, protocol,
n_channels (CTAs), n_threads, chunk_size (bytes), and per-communicator extras (CTA policy, CGA
cluster size). ``None`` in a field means "NCCL's own choice" (stock behaviour).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class CommConfig:
    """One communication configuration. Every field ``None`` = NCCL defaults.

    On the gloo backend (CPU), ``n_channels`` is the number of gloo worker threads of the
    communicator and ``chunk_size`` the size in bytes of the pieces a tensor is split into;
    algorithm, protocol and n_threads do not apply there.
    """

    algorithm: str | None = None
    """NCCL algorithm: Ring, Tree, NVLS, NVLSTree, CollNetDirect, CollNetChain, PAT."""
    protocol: str | None = None
    """NCCL protocol: LL, LL128, Simple."""
    n_channels: int | None = None
    """Channels, one CTA each (1..64 from NCCL 2.25, 1..32 before)."""
    n_threads: int | None = None
    """Threads per CTA: 64, 128, 256 or 512 (NCCL_NTHREADS; process scope)."""
    chunk_size: int | None = None
    """Bytes moved per step of a channel (tuner plugin v6 / NCCL 2.30+)."""
    cta_policy: str | None = None
    """ncclConfig_t.CTAPolicy: DEFAULT, EFFICIENCY, ZERO (communicator scope)."""
    cga_cluster_size: int | None = None
    """ncclConfig_t.cgaClusterSize, 0..8 (communicator scope, sm90+)."""

    def to_dict(self) -> dict[str, Any]:
        """Returns the fields that are set (not ``None``), JSON-ready."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CommConfig":
        """Builds a config from ``to_dict`` output.

        Raises:
            ValueError: on a key that is not a CommConfig field (names the key and the allowed set).
        """
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown CommConfig field(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**data)

    def is_default(self) -> bool:
        """True when every knob is left to NCCL."""
        return not self.to_dict()


DEFAULT = CommConfig()
"""NCCL's own choice for every knob."""
