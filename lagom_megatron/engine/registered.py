"""Registered buffers as a knob: NCCL's own models of the low-SM paths that registering a process group's buffers
unlocks (symmetric kernels, copy-engine all-gathers), and the per-group choice the search makes with them.

The warm-up cannot probe these paths: Megatron registers its buffers (``--use-nccl-ub``) when it builds them, before
lagom profiles anything. So their collective time is NCCL's own estimate, the one NCCL itself picks kernels by, and
the compute slowdown is the fitted model's at the CTAs NCCL would launch (none on copy engines). A plan that
registers a group applies from the next launch (``Plan.registered_groups``); this launch runs those sites on NCCL's
defaults (``Plan.for_launch``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from lagom_megatron.engine.knobs import CommConfig

GBPS = 2**30 / 1e6
"""Bytes per us in one of ``sym_kernels.cc``'s GB/s (``constexpr double GBps = (1 << 30) / 1.e6``, v2.30.7 :408)."""
SYMK_MAX_BLOCKS = 64
"""``ncclSymkMaxBlocks`` (v2.30.7 ``src/include/sym_kernels.h:25``)."""
SYMK_SM_PENALTY = 0.025
"""The kernel picker's 2.5% more time per SM (``smPenalty``, v2.30.7 ``src/sym_kernels.cc:621``)."""
SYMK_LL_BUS_FACTOR = 9.0
"""LL kernels move 2x the bytes plus processing (``LL_BusFactor``, v2.30.7 ``src/sym_kernels.cc:337``)."""
SYMK_LL_MAX_BUS_BYTES = 2 << 30
"""LL kernels count elements in 32 bits: none at 2 GiB of bus bytes or more (v2.30.7 ``src/sym_kernels.cc:576``)."""

CE_AG_FLOOR_US = {90: {False: (17.50, 1.957), True: (14.90, 0.726)}, 100: {False: (32.04, 0.130), True: (29.14, 0.137)}}
"""Copy-engine all-gather latency floor, base + per rank (us), outside CUDA graphs, by architecture and multicast
(``CE_AG_FLOOR``, NVIDIA/nccl ``src/tuning/ce_model.cc`` @8898068)."""
CE_NVLINK_GBS = {90: 392.0, 100: 779.0}
"""Copy-engine NVLink bandwidth, GB/s (``CE_NVLINK_BW``, ``ce_model.cc`` @8898068)."""


def _softmin(x: float, ceiling: float, softness: float) -> float:
    return ceiling - softness * math.log1p((math.exp(ceiling / softness) - 1.0) * math.exp(-x / softness))


def _softplus(x: float) -> float:
    return x if x >= 100.0 else math.log1p(math.exp(x))


@dataclass(frozen=True, slots=True)
class LowSmPath:
    """What NCCL runs one call on: kernel name, estimated us, CTAs (0: copy engines)."""

    kernel: str
    time_us: float
    ctas: int
    latency_us: float = 0.0
    """The part of ``time_us`` that moves no data (the kernel's base latency; the copy engines' floor)."""


def _symk_kernels(op: str, n: int, nbytes: int, *, multicast: bool, ll: bool) -> list[tuple[str, float, float, bool]]:
    """(name, bus bytes, bus multiplier, uses the NVLS block cap) per kernel NCCL may pick (v2.30.7
    ``src/sym_kernels.cc:345-403``, sm < 100: no TMA kernels; one node: no GIN kernels). ``nbytes``: the call's count
    in bytes as NCCL counts it (all-reduce: the whole buffer; all-gather / reduce-scatter: one rank's share)."""
    out: list[tuple[str, float, float, bool]] = []
    if op == "all_reduce":
        if ll:
            out.append(("AllReduce_AGxLL_R", n * nbytes * SYMK_LL_BUS_FACTOR, 1.0, False))
            if multicast:
                out.append(("AllReduce_AGxLLMC_R", n * nbytes * SYMK_LL_BUS_FACTOR, 1.1, False))
        out.append(("AllReduce_RSxLD_AGxST", 2.0 * nbytes * (n - 1) / n, 1.0, False))
        if multicast:
            out.append(("AllReduce_RSxLDMC_AGxSTMC", nbytes / n + nbytes, float(n), True))
    elif op in ("all_gather", "reduce_scatter"):
        ag = op == "all_gather"
        if ll:
            out.append(("AllGather_LL" if ag else "ReduceScatter_LL", n * nbytes * SYMK_LL_BUS_FACTOR, 1.0, False))
            if multicast and ag:
                out.append(("AllGather_LLMC", n * nbytes * SYMK_LL_BUS_FACTOR, 1.1, False))
        out.append(("AllGather_ST" if ag else "ReduceScatter_LD", (n - 1) * nbytes, 1.0, False))
        if multicast:
            out.append(("AllGather_STMC" if ag else "ReduceScatter_LDMC", (n - 1) * nbytes, 0.55 * n, True))
    return out


def symmetric_kernel(
    op: str, *, n_ranks: int, nbytes: int, sm_arch: int, multicast: bool, grouped: bool = False
) -> LowSmPath | None:
    """The symmetric kernel NCCL's picker takes for one call on registered windows of one all-NVLink node, with the
    CTAs it launches and its estimated time (v2.30.7 ``src/sym_kernels.cc``: ``queryModel_lsa`` :334-432, ``model``
    :162-165, the picker :596-640). ``nbytes``: the call's whole buffer (all-reduce; all-gather output; reduce-scatter
    input); ``multicast``: NVLS multimem; ``grouped``: several tensors in one call (no LL kernels, :604). None for an
    op without symmetric kernels. Constants: sm < 100 row (:412-416); sm100's (:417-420) for Blackwell."""
    n = max(int(n_ranks), 2)
    count = nbytes if op == "all_reduce" else nbytes // n
    bus_total = count if op == "all_reduce" else n * count
    ll = not grouped and bus_total < SYMK_LL_MAX_BUS_BYTES
    kernels = _symk_kernels(op, n, count, multicast=multicast, ll=ll)
    best: LowSmPath | None = None
    blackwell = sm_arch >= 100
    for name, bus_bytes, mult, nvls_cap in kernels:
        is_ll = "LL" in name.split("_", 1)[1]
        is_ar = op == "all_reduce"
        if blackwell:
            base = (8.5 if op == "all_gather" else 11.0) if is_ll else (19.5 if is_ar else 13.0)
            sm_bw, peak = 55 * GBPS, (1000 if name == "AllReduce_RSxLDMC_AGxSTMC" else 600) * GBPS
        else:
            base = 4.5 if is_ll else 7.8
            sm_bw = (65 if is_ar else 44) * GBPS
            peak = (480 if name == "AllReduce_RSxLDMC_AGxSTMC" else 320) * GBPS
        max_blocks = -(-(32 if blackwell else 16) // n) if nvls_cap else SYMK_MAX_BLOCKS

        def t(blocks: int, *, bus_bytes=bus_bytes, mult=mult, base=base, sm_bw=sm_bw, peak=peak) -> float:
            return base + _softplus(bus_bytes / _softmin(blocks * sm_bw * mult, peak, sm_bw) - 1.0)

        blocks, time_us = max_blocks, t(max_blocks)
        for b in range(1, max_blocks):  # fewest blocks within 2.5% of the most (:424-431)
            if t(b) <= 1.025 * time_us:
                blocks, time_us = b, t(b)
                break
        if best is None or time_us * (1 + SYMK_SM_PENALTY * blocks) < best.time_us * (1 + SYMK_SM_PENALTY * best.ctas):
            best = LowSmPath(name, time_us, blocks, min(base, time_us))
    return best


def copy_engine_all_gather(*, n_ranks: int, nbytes: int, sm_arch: int, multicast: bool) -> LowSmPath:
    """NCCL's copy-engine all-gather estimate for one call, in place, outside CUDA graphs, unicast or multicast
    (whichever it rates faster): floor + one rank's share x (ranks - 1, or ranks multicast) / the CE NVLink rate
    (``ncclCeAgLatencyUs``, ``ce_model.cc`` @8898068). ``nbytes``: the gathered output."""
    n = max(int(n_ranks), 2)
    arch = 100 if sm_arch >= 100 else 90
    per_rank = nbytes / n
    best: LowSmPath | None = None
    for mc in (False, True) if multicast else (False,):
        base, per = CE_AG_FLOOR_US[arch][mc]
        floor = base + per * n
        t = floor + per_rank * (n if mc else n - 1) / CE_NVLINK_GBS[arch] / 1e3
        if best is None or t < best.time_us:
            best = LowSmPath("CE_AllGather_MC" if mc else "CE_AllGather", t, 0, floor)
    assert best is not None
    return best


def _option_region(model: Any, i: int, path: LowSmPath) -> tuple[float, float]:
    """(T_comm, T_region) of site ``i`` on ``path``: NCCL's own time per call (no alpha / beta: those were fitted on
    another path), the fitted slowdown at its CTAs and the HBM traffic of a Ring/Simple call (the bytes every path
    reads and writes); copy engines hold no SM, so never wait for one."""
    from lagom_megatron.engine.cost_terms import _ALG_HBM, _PROTO_HBM, _RING, _SIMPLE

    idx = np.array([i])
    wire = model.wire_SA[idx, _RING]
    hbm = np.full(1, _PROTO_HBM[_SIMPLE] * _ALG_HBM[_RING])
    t_comm, _, region = model.combine(
        idx,
        np.zeros(1),
        np.full(1, path.time_us),
        np.full(1, float(path.ctas)),
        wire,
        hbm,
        sm_free=path.ctas == 0,
        fitted=False,
    )
    return float(t_comm[0]), float(region[0])


def site_options(model: Any, i: int, reg: Any) -> list[tuple[CommConfig, LowSmPath]]:
    """What site ``i`` may run on registered buffers: NCCL's symmetric kernel (the group's own communicator, NCCL's
    choice) and, for an all-gather, copy engines (a pool entry with CTA policy ZERO)."""
    c, s = model.cluster, model.sites[i]
    multicast = c.nvswitch and c.sm_arch >= 90 and s.group_size > 2
    out: list[tuple[CommConfig, LowSmPath]] = []
    if reg.symmetric_kernels:
        p = symmetric_kernel(
            s.op,
            n_ranks=s.group_size,
            nbytes=s.nbytes,
            sm_arch=c.sm_arch,
            multicast=multicast,
            grouped=len(s.parts) > 1,
        )
        if p is not None:
            out.append((CommConfig(), p))
    if reg.copy_engine and s.op == "all_gather":  # ce_model.cc prices all-gathers only
        p = copy_engine_all_gather(n_ranks=s.group_size, nbytes=s.nbytes, sm_arch=c.sm_arch, multicast=multicast)
        out.append((CommConfig(cta_policy="ZERO"), p))
    return out


def choose(problem: Any, plan: Any) -> Any:
    """``plan`` with the groups whose registration the model says pays registered (``Plan.registered_groups``), their
    registrable sites on the best of NCCL's symmetric kernel or copy engines; one evaluation per site and option."""
    model, rules = problem.model, problem.rules
    by_group: dict[str, list[tuple[int, list]]] = {}
    for i, s in enumerate(model.sites):
        if s.registered:  # already registered at this launch: the search saw it as it runs
            continue
        reg = rules.registration(s)
        opts = site_options(model, i, reg) if reg is not None else []
        if opts:
            by_group.setdefault(s.group, []).append((i, opts))
    entries, chosen, gains = dict(plan.entries), [], {}
    evals = sum(len(opts) for sites in by_group.values() for _, opts in sites)
    for group, sites in by_group.items():
        before = after = 0.0
        picks = []
        for i, opts in sites:
            e = plan.entries[model.sites[i].site_id]
            scored = [(*_option_region(model, i, p), cfg, p) for cfg, p in opts]
            if not any(cfg.is_default() for cfg, _ in opts):  # no symmetric kernel takes the call: e stays possible
                scored.append((e.predicted_t_comm_us, e.predicted_t_region_us, e.config, None))
            t_comm, region, cfg, p = min(scored, key=lambda x: x[1])
            before += e.predicted_t_region_us
            after += region
            picks.append((i, cfg, p, t_comm, region))
        if after >= before:  # no tolerance: NCCL's own estimates, and no launch can time both side by side
            continue
        chosen.append(group)
        gains[group] = round(before - after, 3)
        for i, cfg, p, t_comm, region in picks:
            sid = model.sites[i].site_id
            if p is None:
                continue
            how = "copy engines (CTA policy ZERO), no SM" if p.ctas == 0 else f"symmetric kernel on {p.ctas} CTAs"
            note = f"registered buffers from the next launch: NCCL's {how} ({p.kernel}, {p.time_us:.0f} us per call)"
            entries[sid] = replace(
                entries[sid],
                config=cfg,
                predicted_t_comm_us=round(t_comm, 3),
                predicted_t_region_us=round(region, 3),
                note="; ".join(x for x in (entries[sid].note, note) if x),
            )
    if evals:
        plan = plan.with_stats(model_evaluations=plan.stats.get("model_evaluations", 0) + evals)
    if not chosen:
        return plan
    predicted = plan.stats["predicted_iteration_us"] - sum(gains.values())
    stats = {
        **plan.stats,
        "registration_gain_us": gains,
        "predicted_iteration_us": round(predicted, 3),
        "predicted_speedup": round(plan.stats["default_iteration_us"] / predicted, 4) if predicted > 0 else None,
    }
    return replace(plan, entries=entries, registered_groups=tuple(sorted(chosen)), stats=stats)
