"""The simulator's ranged constants: values no source pins down, each with its range and support (``source``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lagom_megatron.sim import tuning_model as nm


@dataclass(frozen=True, slots=True)
class Ranged:
    """One constant: central ``value``, plausible ``low`` .. ``high``, ``unit``, and ``source``."""

    name: str
    value: float
    low: float
    high: float
    unit: str
    source: str


def _graph_cta_gbs(arch: int) -> float:
    """GB/s NCCL's ring graph asks of one CTA on the fastest NVLink topology of ``arch`` (``cta_gbs_sm*``'s sources)."""
    links = {90: 18, 80: 12, 86: 4}[arch]
    return nm.ring_graph(links * nm.NVLINK_BW[arch], sm_arch=arch, inter=False)[1] / 2.0


CONSTANTS: dict[str, Ranged] = {
    c.name: c
    for c in (
        Ranged(
            "cta_gbs_sm90",
            _graph_cta_gbs(90),
            11.6,
            20.0,
            "GB/s",
            "one CTA of Ring/Simple at 512 threads on Hopper when the link is not the limit: what NCCL's own ring "
            "graph asks of it. On DGX H100 (18 NVLinks x 20.6, topo.h:23) the search settles at 6 channels of 60 GB/s "
            "(sm90SpeedArrayIntra, search.cc:1057); ncclTopoDupChannels halves any speed >= 25 and doubles the "
            "channels (search.cc:1039, 1045-1047): 12 at 30; connect.cc:460 runs two CTAs per channel: 24 CTAs at 15. "
            "Maintainers: two CTAs per NVLink saturate it (nccl#1703, nccl#1225). Low end: NCCL's 32 CTAs exactly "
            "filling the ~370 GB/s ring (nccl-tests#212): 370/32. High end: a 40 GB/s graph of more than 4 "
            "channels, which search.cc:1040 leaves unduplicated: 40/2",
        ),
        Ranged(
            "cta_gbs_sm80",
            _graph_cta_gbs(80),
            9.5,
            12.5,
            "GB/s",
            "the same on A100: 12 NVLinks x 20 (topo.h:21), 6 channels of 40 GB/s (speedArrayIntra, search.cc:1051), "
            "duplicated to 12 of 20 (search.cc:1039, 1045), two CTAs each (connect.cc:460): 24 CTAs at 10, the 24 of "
            "NCCL's DGX A100 logs (nccl#1225: 12 NVLinks, 24 CTAs). Low end: 24 CTAs exactly filling ~228 GB/s "
            "(nccl-tests#149, #178). High end: two CTAs per 25 GB/s NVLink (nccl#1703; line rate, nccl-tests#149)",
        ),
        Ranged(
            "cta_gbs_sm86",
            _graph_cta_gbs(86),
            8.8,
            12.5,
            "GB/s",
            "the same on A40 (GA102), which NCCL runs with its Ampere tables (src/graph/tuning.cc:263-266; "
            "search.cc:1157): its fastest graph, a bridged pair (4 links x 12, topo.h:23), is 1 channel of 40 GB/s, "
            "duplicated to 2 of 20 (search.cc:1039, 1045), two CTAs each: 10. No measurement of one CTA on GA102 "
            "found. Low end: A100's graph value scaled by DRAM bandwidth per SM (696 GB/s / 84 SMs against "
            "2039 GB/s / 108 SMs, datasheets). High end: A100's",
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
            2.1,
            4.0,
            "factor",
            "memory-bound kernels' queueing behind a collective's HBM traffic: fitted on nccl#1428 "
            "(A100, element-wise 2.5x, attention 1.83x beside an all-gather); the range keeps the "
            "1.76-2.5x window of that issue (at 24 A100 CTAs of 10 GB/s, 2.0 gives 1.75)",
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
            "nvls_gather_link_eff",
            300.0 / 450.0,
            0.6,
            0.82,
            "fraction",
            "busbw ceiling of NVLS all-gather / reduce-scatter as a share of H100's 450 GB/s NVLink: 300 GB/s measured "
            "at 1 GB on 8 x H100 against 350 for Ring (nccl#1506; a maintainer there: NVLS promises no bandwidth gain "
            "for these, only fewer SMs). Low end: below the measured peak size (unmeasured); high end: the Ring "
            "ceiling (nccl-tests#212, ~370)",
        ),
        Ranged(
            "nvls_cta_mult",
            2.0,
            1.0,
            2.0,
            "x cta_gbs",
            "one NVLS CTA's rate over a ring CTA's: ncclTopoDupChannels skips NVLS graphs (search.cc:1038), so NCCL's "
            "graph asks an NVLS CTA twice what it asks a ring CTA; with it NCCL's 16 NVLS CTAs (nvls.cc:155) reach "
            "nccl-tests#212's ~480 GB/s all-reduce. Low end: the ring CTA's rate (NVLS all-reduce then ~400 GB/s, "
            "below that measurement)",
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
            "last_wave_wait",
            1.0,
            0.0,
            1.0,
            "fraction",
            "how far into the running kernel's tail a ready collective on a normal-priority stream waits before it "
            "gets SMs: 1 = until the kernel's last wave is dispatched (the CUDA block scheduler serves the pending "
            "CTAs of the running grid first; a high-priority stream jumps the queue: nccl#1431, pytorch#143890), "
            "0 = at once (stream priority then gains nothing). Nothing measured an NCCL kernel's wait behind a GEMM",
        ),
        Ranged(
            "sigma_compute",
            0.02,
            0.01,
            0.04,
            "fraction",
            "relative standard deviation of one compute kernel's duration. No source",
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
