"""The simulator's ranged constants: values no source pins down, each with its range and support (``source``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Ranged:
    """One constant: central ``value``, plausible ``low`` .. ``high``, ``unit``, and ``source``."""

    name: str
    value: float
    low: float
    high: float
    unit: str
    source: str


CONSTANTS: dict[str, Ranged] = {
    c.name: c
    for c in (
        Ranged(
            "cta_gbs_sm90",
            30.0,
            11.6,
            30.0,
            "GB/s",
            "one CTA of Ring/Simple at 512 threads on Hopper when the link is not the limit. NCCL's "
            "search assigns one search channel at most 60 GB/s on sm90 (src/graph/search.cc:1057, "
            "sm90SpeedArrayIntra) and runs two CTAs per search channel (src/graph/connect.cc:460): "
            "30. Low end: NCCL's own model at its defaults, where its 32 CTAs exactly fill the "
            "~370 GB/s NVLink ring (nccl-tests#212): 370/32",
        ),
        Ranged(
            "cta_gbs_sm80",
            20.0,
            9.5,
            20.0,
            "GB/s",
            "the same on A100: at most 40 GB/s per search channel (search.cc:1051, speedArrayIntra) "
            "over two CTAs: 20. Low end: 24 CTAs exactly filling ~228 GB/s (nccl-tests#149, #178)",
        ),
        Ranged(
            "cta_gbs_sm86",
            20.0,
            8.8,
            20.0,
            "GB/s",
            "the same on A40 (GA102). NCCL treats sm86 with its Ampere tables (src/graph/tuning.cc:263-266; "
            "only its NVLink link speed differs, src/graph/topo.h:23): 20. No measurement of one "
            "CTA on GA102 found. Low end: A100's value scaled by DRAM bandwidth per SM "
            "(696 GB/s / 84 SMs against 2039 GB/s / 108 SMs, datasheets): a latency-bound copy "
            "loop moves what its share of the memory system returns",
        ),
        Ranged(
            "pcie_link_eff",
            20.0 / 24.0,
            0.76,
            0.90,
            "fraction",
            "Ring/Simple bandwidth over a PCIe Gen4 x16 hop as a share of its 24 GB/s (NCCL's value, "
            "src/graph/topo.cc:545-556 kvDictPciGen): NCCL's search runs such a path at 20 GB/s, the "
            "fastest speed of its table below 24 (search.cc:1051). No measurement of NCCL on A40 PCIe "
            "read in full. Range: 18 GB/s (P2P writes through a CPU root complex; nccl#1639, a "
            "maintainer: on PCI systems the CPU and memory set the result) to 21.6 GB/s (Gen4 x16 "
            "payload after TLP overhead)",
        ),
        Ranged(
            "sat_p",
            8.0,
            3.0,
            16.0,
            "exponent",
            "sharpness of bandwidth saturation bw = (rate^-p + link^-p)^(-1/p). No source: a shape "
            "assumption. p = 3 leaves 21% below the link where channels x rate reach it, p = 16 3%",
        ),
        Ranged(
            "threads_exp",
            0.6,
            0.3,
            1.0,
            "exponent",
            "one CTA's rate scales as (threads / 512)^exp. No source: NCCL's model keeps a channel's "
            "bandwidth whatever its threads (src/graph/tuning.cc:324) and only halves threads for "
            "small messages (src/enqueue.cc:2101-2104); 1.0 = rate proportional to threads",
        ),
        Ranged(
            "kappa_compute",
            0.8,
            0.3,
            1.3,
            "factor",
            "compute math slowdown per unit of HBM share a collective draws. No numeric source "
            "(nccl#1433: both sides slow down with spare SMs, qualitative); the range keeps the "
            "GEMM-beside-all-gather slowdown (8192^3 on 8 A100, 256 MiB) at or below nccl#1428's 1.76x at 1.3",
        ),
        Ranged(
            "kappa_mem",
            3.0,
            2.0,
            4.0,
            "factor",
            "memory-bound kernels' queueing behind a collective's HBM traffic: fitted on nccl#1428 "
            "(A100, element-wise 2.5x, attention 1.83x beside an all-gather); the range keeps the "
            "1.8-2.5x window of that issue",
        ),
        Ranged(
            "kappa_comm",
            0.5,
            0.0,
            1.0,
            "factor",
            "a collective's bandwidth loss per unit of HBM share compute draws. No source "
            "(nccl#1433: communication up to 2x slower beside a GEMM, qualitative)",
        ),
        Ranged(
            "nvls_hbm_mult",
            1.2,
            1.0,
            2.0,
            "bytes/byte",
            "HBM bytes per wire byte of NVLS (the switch reduces; each GPU reads its operand and "
            "writes its result). No measurement; ring reductions are 2-3 (nccl#1428 maintainer)",
        ),
        Ranged(
            "chunk_hbm_weight",
            0.25,
            0.0,
            0.5,
            "fraction",
            "share of a Simple collective's HBM traffic that scales with its chunk size (larger "
            "chunks spill L2). No source: Lagom's introduction says chunk size moves compute, "
            "not by how much",
        ),
        Ranged(
            "gemm_eff_ampere",
            0.60,
            0.45,
            0.70,
            "fraction",
            "achieved share of peak bf16 FLOP/s of transformer GEMMs on A100 / A40. The 0.60 is "
            "fitted on H100 (Megatron-LM README: up to 47% MFU, GPT-3 175B); no per-GPU source",
        ),
        Ranged(
            "overlap_gamma",
            0.25,
            0.1,
            0.4,
            "fraction",
            "share of the shorter of math and memory time a kernel fails to hide. No source",
        ),
        Ranged(
            "tile_n",
            256.0,
            128.0,
            256.0,
            "elements",
            "GEMM output tile width (128 x N per CTA) for wave quantization: 128x256 is the Hopper "
            "CUTLASS default; Ampere kernels also run 128x128. No per-GPU source",
        ),
        Ranged(
            "sigma_iteration",
            0.01,
            0.005,
            0.02,
            "fraction",
            "relative standard deviation of whole-iteration noise (stragglers, clocks). No source",
        ),
        Ranged(
            "sigma_comm",
            0.03,
            0.01,
            0.05,
            "fraction",
            "relative standard deviation of one collective's time. No source",
        ),
    )
}
"""Every ranged constant by name (``docs/simulator.md`` prints this table)."""

_current: dict[str, float] = {name: c.value for name, c in CONSTANTS.items()}


def get(name: str) -> float:
    """The current value of constant ``name``; KeyError for an unknown name."""
    try:
        return _current[name]
    except KeyError:
        raise KeyError(f"unknown simulator constant {name!r}; known: {sorted(CONSTANTS)}") from None


@contextmanager
def overridden(values: dict[str, float]) -> Iterator[None]:
    """Sets constants for the block, then restores them; KeyError for an unknown name, ValueError outside its range."""
    for name, v in values.items():
        c = CONSTANTS.get(name)
        if c is None:
            raise KeyError(f"unknown simulator constant {name!r}; known: {sorted(CONSTANTS)}")
        if not c.low - 1e-12 <= v <= c.high + 1e-12:
            raise ValueError(f"{name} = {v} is outside its range {c.low}..{c.high} {c.unit}")
    saved = dict(_current)
    _current.update(values)
    try:
        yield
    finally:
        _current.clear()
        _current.update(saved)
