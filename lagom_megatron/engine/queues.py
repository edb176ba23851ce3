"""Collectives that queue on one stream: the communicators whose sites wait behind each other
(``mark_queues``, the queue term of ``CostModel.evaluate``) and what each site's collectives wait,
ready on their stream, for a running kernel's blocks (``dispatch_waits``, the ``wait_S`` term).

Our design; both follow the simulator's and the GPU's behaviour as docs/simulator.md describes it
("Dispatch"): a stream runs its collectives in launch order, and a kernel that becomes ready while
a compute kernel still has blocks to dispatch gets SMs after them unless its stream has the
higher priority (CUDA programming guide, stream priorities; nccl#1431, pytorch#143890).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def mark_queues(model: Any, *, empty_share: float = 0.01, queue_share: float = 0.25) -> None:
    """Flags the sites of every communicator where collectives queue behind each other.

    A site whose overlapped compute alone is below ``empty_share`` of its default T_comm has an
    empty window: its launch is followed at once by a wait on another collective of the same
    communicator (FSDP's backward: a gradient reduce-scatter launched before the wait on the
    next parameter gather), so it runs behind that one and the region model, which treats
    regions as independent, cannot see what a slower collective costs the ones queued behind
    it. A communicator where at least ``queue_share`` of the sites have empty windows is a
    queue (one empty window, e.g. DDP's last bucket before the final wait, is not). On such a
    communicator a site's extra T_comm over NCCL's default delays the ones behind it where it
    exceeds the site's share (by default T_comm) of the queue's slack: the compute of the
    queue's windows minus its collectives' default time. Within the slack the queue hides
    behind compute; beyond it, it is the critical path. A queue whose collectives outlast that
    compute (negative slack: the queue is the critical path at NCCL's defaults) also credits a
    site's shorter T_comm, down to the site's share of the excess: what the queue can shrink
    before its windows' compute is the longer again. ``queued_region`` turns this into the
    site's region.
    """
    S = len(model.sites)
    model.queued_S = None
    alg, proto, nc, nt, chunk = model.default_codes_cached()
    idx = np.arange(S)
    t_def, _, model.region_default_S = model.evaluate(idx, alg, proto, nc, nt, chunk, hp=0.0)
    if model.offset_S is not None:
        model.region_default_S = model.region_default_S - model.offset_S
    empty = model.t_comp_us_S < empty_share * t_def
    groups = np.array([s.group for s in model.sites], dtype=object)
    comms = {g for g in set(groups.tolist())
             if np.count_nonzero(groups == g) > 1 and np.mean(empty[groups == g]) >= queue_share}
    flag = np.array([g in comms for g in groups], dtype=float)
    model.t_comm_default_S = t_def
    model.queue_empty_S = empty.astype(float)
    model.queue_free_S = np.zeros(S)
    model.queue_excess_S = np.zeros(S)
    for g in comms:
        m = groups == g
        share = t_def[m] / max(float(t_def[m].sum()), 1e-9)
        slack = float(model.t_comp_us_S[m].sum() - t_def[m].sum())
        model.queue_free_S[m] = max(0.0, slack) * share
        model.queue_excess_S[m] = max(0.0, -slack) * share
    model.queued_S = flag if flag.any() else None


WAIT_SIGMAS = 2.0
"""A shape group's dispatch wait counts only where its median exceeds this many standard errors."""


def dispatch_waits(sites: list, by_site: dict[str, list], groups_S: np.ndarray, *, noise_rel: float) -> np.ndarray:
    """Per site, the us per iteration its collectives wait for SMs at their stream's normal priority.

    Measured as what the warm-up's high-priority probe (``CommConfig(high_priority_stream=True)``
    alone, NCCL's own config otherwise) takes off the default iteration's T_comm: per site the
    difference of the two medians, pooled per shape group (``groups_S``: sites of one collective
    shape share it) as the median of its sites' differences. A group keeps a wait only where that
    median is above ``WAIT_SIGMAS`` standard errors (the larger of the differences' spread and
    ``noise_rel`` of T_comm, over the square root of the sites); otherwise 0, as for every site
    without both samples (no probe: the model then has no wait term).

    Args:
        sites: the profile's ``CollectiveSite`` list; ``by_site``: site id -> its usable samples.
        groups_S: shape (S,), each site's shape group; ``noise_rel``: relative T_comm noise.

    Returns:
        Shape (S,), us per iteration, >= 0.
    """
    diff = np.full(len(sites), np.nan)
    base = np.full(len(sites), np.nan)
    for i, site in enumerate(sites):
        plain = [s.t_comm_us for s in by_site[site.site_id] if s.config.is_default()]
        fast = [s.t_comm_us for s in by_site[site.site_id]
                if s.config.high_priority_stream and _only_priority(s.config)]
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
    """``config`` sets the stream priority and nothing else (the probe's form)."""
    from dataclasses import replace

    return replace(config, high_priority_stream=None).is_default()


def queued_region(model: Any, i: Any, region: Any, t_comm: Any) -> np.ndarray:
    """The region of queued sites ``i`` (``mark_queues``) under a config: ``region`` plus the queue's
    change, the extra T_comm beyond the site's slack share (what the collectives behind it start
    later) or, on a queue that outlasts its windows' compute, a saving down to the site's share of
    the excess (what they start sooner), less the part of it the window's own change already
    holds: where the compute waited for the collective, its extra (or saving) is in the window's
    region, and the queue behind moves with that compute, so one delay is counted once. An empty
    window's own region (its T_comm, which no compute waited for) is replaced by the default one.
    Elementwise; sites not in a queue keep ``region``."""
    extra = t_comm - model.t_comm_default_S[i]
    q, empty = model.queued_S[i], model.queue_empty_S[i]
    queue = np.maximum(extra - model.queue_free_S[i], -model.queue_excess_S[i])
    own = (region - model.region_default_S[i]) * (1.0 - empty)
    held = np.where(extra >= 0.0, np.clip(own, 0.0, np.maximum(extra, 0.0)), np.clip(own, np.minimum(extra, 0.0), 0.0))
    rest = np.where(extra >= 0.0, np.maximum(0.0, queue - held), np.minimum(0.0, queue - held))
    return np.where(q > 0.0, region - extra * empty + rest, region)
