"""Which tuner plugin ABI an NCCL release loads, and so which mechanism can apply a plan on a cluster.

NCCL looks up its tuner plugin's struct by ABI version (``ncclTunerPlugin_v<N>``): v3 from NCCL
2.22 (``src/misc/tuner.cc``), v4 from 2.24, v5 from 2.28, v6 from 2.30. lagom's plugin exports
v3-v6, so on an older NCCL (2.21.5 of ``a100-ib100``) no lagom plugin loads, and a plan there is
applied as CTA bounds per communicator (``communicator``), which is what a run there falls back to
(``nccl.capabilities``).
"""

from __future__ import annotations

from lagom_megatron.engine.cluster import ClusterSpec

TUNER_ABI_SINCE: tuple[tuple[tuple[int, int, int], int], ...] = (
    ((2, 30, 0), 6), ((2, 28, 0), 5), ((2, 24, 0), 4), ((2, 22, 0), 3), ((2, 21, 0), 2), ((2, 19, 0), 1),
)
"""Newest tuner plugin ABI per NCCL version: v3 (2.22) edits the cost table, v4 (2.24) adds regBuff,
v5 (2.28) per-communicator constants, v6 (2.30) getChunkSize. lagom's plugin implements v3-v6."""


def tuner_abi(nccl_version: tuple[int, int, int]) -> int:
    """Newest tuner plugin ABI NCCL ``nccl_version`` loads (0 = none)."""
    return next((abi for since, abi in TUNER_ABI_SINCE if nccl_version >= since), 0)


LAGOM_TUNER_ABI_MIN = 3
"""Oldest tuner ABI lagom's plugin exports (``ncclTunerPlugin_v3``, NCCL 2.22)."""


def default_mechanism(cluster: ClusterSpec) -> str:
    """``tuner`` where the cluster's NCCL loads lagom's plugin (tuner ABI v3+, NCCL 2.22+), else
    ``communicator`` (CTA bounds per communicator: what a run there applies, ``nccl.capabilities``)."""
    return "tuner" if tuner_abi(cluster.nccl) >= LAGOM_TUNER_ABI_MIN else "communicator"


def check_mechanism(mechanism: str, cluster: ClusterSpec) -> None:
    """Refuses ``tuner`` on a cluster whose NCCL cannot load lagom's plugin.

    Raises:
        ValueError: names the mechanism, the cluster and its NCCL version, and what is allowed.
    """
    if mechanism == "tuner" and tuner_abi(cluster.nccl) < LAGOM_TUNER_ABI_MIN:
        raise ValueError(f"mechanism 'tuner' needs NCCL 2.22 or newer (lagom's tuner plugin, ABI v3); cluster "
                         f"{cluster.name!r} has NCCL {cluster.nccl_version}: use mechanism 'communicator' or 'env'")
