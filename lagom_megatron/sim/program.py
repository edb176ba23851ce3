"""A program: the compute stream of one iteration in issue order, with the collectives it launches.

Built by ``lagom_megatron.sim.workload`` and run by ``lagom_megatron.sim.timeline``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

from lagom_megatron.sim.constants import get
from lagom_megatron.sim.device import Collective, ComputeKernel

TILE_M = 128
"""Output tile height of a bf16 GEMM kernel (CUTLASS / cuBLAS); the width is ``tile_n`` (ranged)."""


@dataclass(slots=True)
class Call:
    """One collective call: ``site_id`` None = not a site (runs under NCCL defaults, unmeasured)."""

    site_id: str | None
    coll: Collective
    stream: str
    microbatch: int = 0


@dataclass(slots=True)
class Program:
    """The compute stream in issue order plus the collective calls it launches.

    ``ops``: ("K", ComputeKernel, microbatch) | ("L", call index) | ("W", call index) | ("I", us, microbatch).
    """

    ops: list[tuple] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    mb_start_op: dict[int, int] = field(default_factory=dict)
    """Index of the first op of each micro-batch (to measure the steady micro-batch's span)."""

    def kernel(self, k: ComputeKernel, mb: int) -> None:
        self.ops.append(("K", k, mb))

    def launch(self, call: Call) -> int:
        """Appends a launch; returns the call index, or -1 for a group of one rank (no collective)."""
        if call.coll.group_size <= 1:
            return -1
        self.calls.append(call)
        idx = len(self.calls) - 1
        self.ops.append(("L", idx))
        return idx

    def wait(self, idx: int) -> None:
        if idx >= 0:
            self.ops.append(("W", idx))

    def blocking(self, call: Call) -> None:
        self.wait(self.launch(call))


def gemm(name: str, m: float, n: float, k: float, max_sms: int | None = None) -> ComputeKernel:
    """A bf16 GEMM (m x k) @ (k x n): 2mnk FLOPs, operands and result read/written once, one CTA
    per ``TILE_M x tile_n`` output tile (``device.wave_factor``; ``tile_n`` in ``sim.constants``)."""
    tiles = math.ceil(m / TILE_M) * math.ceil(n / get("tile_n"))
    return ComputeKernel(name, "gemm", 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n), max_sms, tiles=int(tiles))


def elementwise(name: str, nbytes: float, kind: str = "elementwise") -> ComputeKernel:
    return ComputeKernel(name, kind, nbytes / 4.0, nbytes)


def group_nodes(*, stride: int, size: int, gpus_per_node: int) -> int:
    """Nodes spanned by a group of ``size`` ranks ``stride`` apart starting at rank 0."""
    return len({(i * stride) // gpus_per_node for i in range(size)})
