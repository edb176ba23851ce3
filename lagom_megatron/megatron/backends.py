"""The two communication backends, NCCL on a GPU and gloo on CPU: their knob rules and pool backends."""

from __future__ import annotations

import dataclasses

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import KnobRules
from lagom_megatron.engine.profile import BACKENDS
from lagom_megatron.megatron.comm_pool import PoolBackend
from lagom_megatron.megatron.gloo import GlooPoolBackend, GlooRules
from lagom_megatron.nccl.capabilities import Capabilities
from lagom_megatron.nccl.rules import NcclRules, check_mechanism


def rules_for(backend: str, cluster: ClusterSpec, mechanism: str | None = None,
              capabilities: Capabilities | None = None, pool_budget_bytes: int | None = None) -> KnobRules:
    """The knob rules of ``backend`` (gloo, nccl, sim) on ``cluster``; with agreed ``capabilities`` (NCCL),
    their mechanism and runtime NCCL version. ``pool_budget_bytes`` caps channel domains (``nccl.budget``).
    ValueError for an unknown backend, a mechanism it does not have, or a cluster of another backend."""
    if backend == "gloo":
        return GlooRules(cluster, mechanism=mechanism or "gloo")
    if backend in ("nccl", "sim"):
        if capabilities is not None and backend == "nccl":
            if capabilities.nccl_version is not None:
                cluster = dataclasses.replace(cluster, nccl_version=".".join(map(str, capabilities.nccl_version)))
            heads = capabilities.ranks_per_node if capabilities.nvls_multicast else 0
            return NcclRules(cluster, mechanism=mechanism or capabilities.mechanism(), backend=backend,
                             capabilities=capabilities, pool_budget_bytes=pool_budget_bytes, nvls_heads=heads or 0)
        if mechanism is not None and cluster.backend == "nccl":
            check_mechanism(mechanism, cluster)
        return NcclRules(cluster, mechanism=mechanism, backend=backend, pool_budget_bytes=pool_budget_bytes)
    raise ValueError(f"backend must be one of {list(BACKENDS)}; got {backend!r}")


def make_pool_backend(name: str) -> PoolBackend:
    """The communicator-pool backend for ``gloo`` or ``nccl``; ValueError for any other name."""
    if name == "gloo":
        return GlooPoolBackend()
    if name == "nccl":
        from lagom_megatron.nccl.pool import NcclPoolBackend

        return NcclPoolBackend()
    raise ValueError(f"pool backend must be one of 'gloo', 'nccl'; got {name!r}")
