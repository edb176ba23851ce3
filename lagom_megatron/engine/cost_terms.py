"""Constants and elementwise terms of the cost model (``cost_model``); sources per constant."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lagom_megatron.engine.knobs import ALGORITHMS, DEFAULT_CHUNK, PROTOCOLS
from lagom_megatron.engine.profile import OPS

ALG_NONE = len(ALGORITHMS)  # point-to-point on NCCL, or gloo: no algorithm choice
PROTO_NONE = len(PROTOCOLS)
_RING, _TREE, _NVLS, _NVLSTREE, _CNDIRECT, _CNCHAIN, _PAT = range(7)
_LL, _LL128, _SIMPLE = range(3)
_OP = {op: i for i, op in enumerate(OPS)}
_AR, _AG, _RS, _A2A, _SEND, _RECV, _BCAST = (
    _OP[o] for o in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")
)

# Per-protocol constants, indexed LL, LL128, Simple, none.
_PROTO_LAT = np.array([0.3, 0.5, 1.0, 1.0])
"""Latency of one step relative to Simple (LL and LL128 avoid the flag round trip)."""
_PROTO_CH_EFF = np.array([0.6, 0.95, 1.0, 1.0])
_PROTO_LINK_EFF = np.array([0.5, 0.9375, 1.0, 1.0])
"""Share of the link the protocol's payload can use: LL 8 of 16 bytes, LL128 120 of 128."""
_PROTO_HBM = np.array([5.0, 2.7, 2.5, 2.0])
"""HBM bytes per wire byte (NCCL maintainers: NVLink bytes x2-3 in HBM; LL doubles for flags)."""
_PROTO_CHUNK_HALF = np.array([4096.0, 65536.0, 65536.0, 65536.0])
"""Chunk size at which a channel reaches half of its large-chunk throughput, bytes."""
_PROTO_DEFAULT_CHUNK = np.array([DEFAULT_CHUNK["LL"], DEFAULT_CHUNK["LL128"], DEFAULT_CHUNK["Simple"], 0.0])
RING_SIMPLE_CHUNK_STEPS = 4
"""Buffer steps per chunk of Ring / Simple all-reduce, all-gather, reduce-scatter: ``NCCL_STEPS / 2``
(NCCL 2.30.7 src/include/collectives.h:19-26), so a 2 MiB chunk (src/enqueue.cc:2222-2225); else 1 (enqueue.cc:2223)."""
# Per-algorithm constants, indexed as knobs.ALGORITHMS plus none.
_ALG_LINK_EFF = np.array([1.0, 0.85, 1.0, 0.95, 1.0, 0.95, 0.9, 1.0])
_ALG_CH_MULT = np.array([1.0, 1.0, 1.7, 1.7, 1.0, 1.0, 1.0, 1.0])
"""Per-channel throughput multiplier: an NVLS channel is link x nvlsEfficiency 0.85, x2 for all-reduce (NCCL
v2.30.7 src/graph/tuning.cc:139-144, 311-318): 1.7x Ring; all-gather / reduce-scatter: ``NVLS_GATHER_MULT``."""
NVLS_ALLREDUCE_LINK = 1.3
"""NVLS all-reduce's ceiling over Ring's: ~480 vs ~370 GB/s on 8 x H100 (nccl-tests#212)."""
NVLS_GATHER_MULT = 0.85
"""NVLS all-gather / reduce-scatter channel over a Ring channel, before (ranks-1)/ranks (tuning.cc:311-317)."""
_ALG_HBM = np.array([1.0, 1.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0])
"""HBM traffic per wire byte relative to ``_PROTO_HBM``: NVLS reduces in the switch (~1.2 vs 2.5-3, nccl#1428)."""

PER_CHANNEL_PRIOR_GBS: dict[int, float] = {90: 15.0, 80: 10.0}
"""One CTA's Simple GB/s at 512 threads by SM arch, as NCCL v2.30.7's ring graph asks of it: its fastest intra-node
speed (60 sm90, 40 else; src/graph/search.cc:1051, 1057) halved by ncclTopoDupChannels (search.cc:1039, 1045), run
by two CTAs per channel (src/graph/connect.cc:460); two CTAs per NVLink saturate it (nccl#1703)."""
SOFTMIN_P = 8.0
"""Sharpness p of the saturation bw = (x^-p + y^-p)^(-1/p): channel sweeps reach the link within a few %."""
DEFAULT_THREADS = 512
NCCL_BASE_LATENCY_US = 3.0
PRIOR_A = 1.0
PRIOR_B = 1.0
CHUNK_L2_FLOOR = 0.6
"""Share of the HBM traffic a very small chunk still causes (the rest stays in L2)."""
GLOO_CALL_US = 100.0
"""Fixed cost of one gloo call or piece, us: torch dispatch, enqueue, worker wake-up."""


MAX_CALL_LEVELS = 8
"""Most per-call regions per site (FSDP: forward and backward windows, repeated per micro-batch)."""
LEVEL_REL_TOL = 0.10
"""Calls within this fraction (+ ``LEVEL_ABS_US``, a few launches) of a level's shortest call join it."""
LEVEL_ABS_US = 10.0


def call_levels(
    per_call_us: Sequence[Sequence[float]], t_comp_us_S: np.ndarray, calls_S: np.ndarray, names: Sequence[str]
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Per site, its calls' compute as at most ``MAX_CALL_LEVELS`` levels: (levels (S, L) us, weights (S, L) calls,
    per site each call's level); one level: ``t_comp / calls``. ValueError on a negative or non-finite time."""
    S = len(per_call_us)
    levels, weights = np.zeros((S, MAX_CALL_LEVELS)), np.zeros((S, MAX_CALL_LEVELS))
    level_of_call = []
    for i, comp in enumerate(per_call_us):
        raw = np.asarray(comp, dtype=float)
        if raw.size and (not np.all(np.isfinite(raw)) or raw.min() < 0):
            raise ValueError(f"site {names[i]!r}: per-call compute must be finite and >= 0 us; got {list(comp)}")
        runs: list[list[int]] = []
        for k in np.argsort(raw, kind="stable").tolist():
            if runs and raw[k] <= raw[runs[-1][0]] * (1.0 + LEVEL_REL_TOL) + LEVEL_ABS_US:
                runs[-1].append(k)
            else:
                runs.append([k])
        while len(runs) > MAX_CALL_LEVELS:
            means = [float(raw[r].mean()) for r in runs]
            j = min(range(len(runs) - 1), key=lambda q: (means[q + 1] - means[q]) / max(means[q + 1], 1.0))
            runs[j : j + 2] = [runs[j] + runs[j + 1]]
        level_of = np.zeros(raw.size, dtype=np.int64)
        if len(runs) <= 1:
            levels[i, 0], weights[i, 0] = t_comp_us_S[i] / calls_S[i], calls_S[i]
        for lv, run in enumerate(runs if len(runs) > 1 else ()):
            levels[i, lv] = float(raw[run].mean())
            weights[i, lv] = calls_S[i] * len(run) / raw.size
            level_of[run] = lv
        level_of_call.append(level_of)
    used = max(1, int((weights > 0).sum(axis=1).max())) if S else 1
    return levels[:, :used], weights[:, :used], level_of_call


def region_time_us(t_comm_us: Any, t_comp_us: Any, s: Any, wait_us: Any = 0.0) -> Any:
    """``max(wait + t_comm, t_comp + t_comm s / (1 + s))``, us, elementwise: the dispatch wait slows no compute."""
    return np.maximum(wait_us + t_comm_us, t_comp_us + t_comm_us * (s / (1.0 + s)))


def sm_term(ctas, sms, gloo: bool = False):
    """``c / (SMs - c)`` (c < SMs): compute slowdown on the SMs left; gloo: ``c / cores`` (threads time-share)."""
    if gloo:
        return ctas / sms
    c = np.minimum(ctas, sms - 1.0)
    return c / (sms - c)


def _softmin(x, y):
    """(x^-8 + y^-8)^(-1/8) (SOFTMIN_P = 8), written with squares and square roots: faster than powers."""
    x2, y2 = 1.0 / (x * x), 1.0 / (y * y)
    x4, y4 = x2 * x2, y2 * y2
    return 1.0 / np.sqrt(np.sqrt(np.sqrt(x4 * x4 + y4 * y4)))


def wire_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes each rank sends per Ring call (nccl-tests bus bandwidth): AR 2(n-1)/n, AG/RS/A2A (n-1)/n, else 1."""
    n = max(group_size, 1)
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    return float(nbytes)


def mark_queues(model: Any, *, empty_share: float = 0.01, queue_share: float = 0.25) -> None:
    """Flags communicators where >= ``queue_share`` of the sites have empty windows (compute < ``empty_share`` x default
    T_comm): there T_comm beyond a site's share of the slack (compute - default T_comm) delays the rest. An empty
    window's site has no share: its collective (FSDP's backward reduce-scatter, launched right before the wait on the
    next gather) has no compute of its own, and the communicator's slack lies in other windows, often another pass
    (the forward's gathers), so its extra time is charged whole."""
    S = len(model.sites)
    model.queued_S = None
    alg, proto, nc, nt, chunk = model.default_codes_cached()
    idx = np.arange(S)
    t_def, _, model.region_default_S = model.evaluate(idx, alg, proto, nc, nt, chunk, hp=0.0)
    if model.offset_S is not None:
        model.region_default_S = model.region_default_S - model.offset_S
    empty = model.t_comp_us_S < empty_share * t_def
    groups = np.array([s.group for s in model.sites], dtype=object)
    comms = {
        g
        for g in set(groups.tolist())
        if np.count_nonzero(groups == g) > 1 and np.mean(empty[groups == g]) >= queue_share
    }
    flag = np.array([g in comms for g in groups], dtype=float)
    model.t_comm_default_S = t_def
    model.queue_empty_S = empty.astype(float)
    model.queue_free_S = np.zeros(S)
    model.queue_excess_S = np.zeros(S)
    for g in comms:
        m = groups == g
        share = t_def[m] / max(float(t_def[m].sum()), 1e-9)
        slack = float(model.t_comp_us_S[m].sum() - t_def[m].sum())
        model.queue_free_S[m] = max(0.0, slack) * share * (1.0 - empty[m])
        model.queue_excess_S[m] = max(0.0, -slack) * share
    model.queued_S = flag if flag.any() else None


WAIT_SIGMAS = 2.0


def dispatch_waits(sites: list, by_site: dict[str, list], groups_S: np.ndarray, *, noise_rel: float) -> np.ndarray:
    """Per site (S,), us per iteration waiting for SMs at normal priority: default - high-priority T_comm medians."""
    diff = np.full(len(sites), np.nan)
    base = np.full(len(sites), np.nan)
    for i, site in enumerate(sites):
        plain = [s.t_comm_us for s in by_site[site.site_id] if s.config.is_default()]
        fast = [
            s.t_comm_us for s in by_site[site.site_id] if s.config.high_priority_stream and _only_priority(s.config)
        ]
        if plain and fast:
            base[i] = float(np.median(plain))
            diff[i] = base[i] - float(np.median(fast))
    out = np.zeros(len(sites))
    for g in np.unique(groups_S):
        m = (groups_S == g) & np.isfinite(diff)
        n = int(m.sum())
        if n == 0:
            continue
        d = diff[m]
        med = float(np.median(d))
        spread = 1.4826 * float(np.median(np.abs(d - med))) if n > 2 else 0.0
        se = max(spread, noise_rel * float(np.median(base[m])) * math.sqrt(2.0)) / math.sqrt(n)
        if med > WAIT_SIGMAS * se:
            out[groups_S == g] = med
    return out


def _only_priority(config: Any) -> bool:
    from dataclasses import replace

    return replace(config, high_priority_stream=None).is_default()


def queued_region(model: Any, i: Any, region: Any, t_comm: Any) -> np.ndarray:
    """Region of queued sites ``i``: ``region`` plus the queue's delay (or saving) beyond the site's slack share."""
    extra = t_comm - model.t_comm_default_S[i]
    q, empty = model.queued_S[i], model.queue_empty_S[i]
    queue = np.maximum(extra - model.queue_free_S[i], -model.queue_excess_S[i])
    own = (region - model.region_default_S[i]) * (1.0 - empty)
    held = np.where(extra >= 0.0, np.clip(own, 0.0, np.maximum(extra, 0.0)), np.clip(own, np.minimum(extra, 0.0), 0.0))
    rest = np.where(extra >= 0.0, np.maximum(0.0, queue - held), np.minimum(0.0, queue - held))
    return np.where(q > 0.0, region - extra * empty + rest, region)


OFFSET_SIGMAS = 2.0


def window_offsets(n_sites: int, i_J: np.ndarray, residual_J: np.ndarray, y_J: np.ndarray) -> np.ndarray:
    """Per site (S,), the 1 / y^2-weighted mean residual (us) where >= 3 samples and > ``OFFSET_SIGMAS`` se; else 0."""
    out = np.zeros(n_sites)
    w = 1.0 / np.maximum(np.asarray(y_J, dtype=float), 1e-9) ** 2
    for i in range(n_sites):
        m = i_J == i
        n = int(m.sum())
        if n < 3:
            continue
        r = residual_J[m]
        mean = float(np.average(r, weights=w[m]))
        if abs(mean) > OFFSET_SIGMAS * float(np.std(r, ddof=1)) / np.sqrt(n):
            out[i] = mean
    return out
