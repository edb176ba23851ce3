"""Which tuner plugin ABI an NCCL release loads (``ncclTunerPlugin_v<N>``, ``src/misc/tuner.cc``), so which mechanism
applies a plan: lagom exports v3-v6; before NCCL 2.22 (2.21.5 of ``a100-ib100``) only ``communicator``."""

from __future__ import annotations

from lagom_megatron.engine.cluster import ClusterSpec

TUNER_ABI_SINCE: tuple[tuple[tuple[int, int, int], int], ...] = (
    ((2, 30, 0), 6), ((2, 28, 0), 5), ((2, 24, 0), 4), ((2, 22, 0), 3), ((2, 21, 0), 2), ((2, 19, 0), 1),
)
"""Newest tuner ABI per NCCL version: v3 edits the cost table, v4 adds regBuff, v5 per-comm constants, v6 chunk size."""


def tuner_abi(nccl_version: tuple[int, int, int]) -> int:
    """Newest tuner plugin ABI NCCL ``nccl_version`` loads (0 = none)."""
    return next((abi for since, abi in TUNER_ABI_SINCE if nccl_version >= since), 0)


LAGOM_TUNER_ABI_MIN = 3
"""Oldest tuner ABI lagom's plugin exports (``ncclTunerPlugin_v3``, NCCL 2.22)."""


def default_mechanism(cluster: ClusterSpec) -> str:
    """``tuner`` where the cluster's NCCL loads lagom's plugin (NCCL 2.22+), else ``communicator``."""
    return "tuner" if tuner_abi(cluster.nccl) >= LAGOM_TUNER_ABI_MIN else "communicator"


def check_mechanism(mechanism: str, cluster: ClusterSpec) -> None:
    """Refuses ``tuner`` (ValueError) on a cluster whose NCCL cannot load lagom's plugin."""
    if mechanism == "tuner" and tuner_abi(cluster.nccl) < LAGOM_TUNER_ABI_MIN:
        raise ValueError(f"mechanism 'tuner' needs NCCL 2.22 or newer (lagom's tuner plugin, ABI v3); cluster "
                         f"{cluster.name!r} has NCCL {cluster.nccl_version}: use mechanism 'communicator' or 'env'")
