"""A program: one iteration's compute stream in issue order, with the collectives it launches."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lagom_megatron.sim.constants import get
from lagom_megatron.sim.device import Collective, ComputeKernel

TILE_M = 128
"""Output tile height of a bf16 GEMM (CUTLASS / cuBLAS); the width is ranged ``tile_n``."""


@dataclass(slots=True)
class Call:
    """One collective call; ``site_id`` None: not a site (NCCL defaults, unmeasured)."""

    site_id: str | None
    coll: Collective
    stream: str
    microbatch: int = 0


@dataclass(slots=True)
class Program:
    """``ops``: ("K", ComputeKernel, microbatch) | ("L", call index) | ("W", call index) | ("I", us, microbatch)."""

    ops: list[tuple] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    mb_start_op: dict[int, int] = field(default_factory=dict)

    def kernel(self, k: ComputeKernel, mb: int) -> None:
        self.ops.append(("K", k, mb))

    def launch(self, call: Call) -> int:
        """Appends a launch; returns the call index, or -1 for a group of one rank."""
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
    """A bf16 GEMM (m x k) @ (k x n): 2mnk FLOPs, one CTA per ``TILE_M x tile_n`` output tile."""
    tiles = math.ceil(m / TILE_M) * math.ceil(n / get("tile_n"))
    return ComputeKernel(name, "gemm", 2.0 * m * n * k, 2.0 * (m * k + k * n + m * n), max_sms, tiles=int(tiles))


def elementwise(name: str, nbytes: float, kind: str = "elementwise") -> ComputeKernel:
    return ComputeKernel(name, kind, nbytes / 4.0, nbytes)


def group_nodes(*, stride: int, size: int, gpus_per_node: int) -> int:
    """Nodes spanned by a group of ``size`` ranks ``stride`` apart starting at rank 0."""
    return len({(i * stride) // gpus_per_node for i in range(size)})
