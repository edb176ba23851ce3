"""Collectives that queue on one stream: ``mark_queues`` (the queue term of ``CostModel.evaluate``) and
``dispatch_waits`` (``wait_S``). Our design, after docs/simulator.md "Dispatch": a kernel ready while another has
blocks left waits for them unless its stream has higher priority (nccl#1431, pytorch#143890)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def mark_queues(model: Any, *, empty_share: float = 0.01, queue_share: float = 0.25) -> None:
    """Flags the sites of every communicator where collectives queue behind each other: where >= ``queue_share``
    of its sites have empty windows (compute < ``empty_share`` of default T_comm), T_comm beyond a site's share of
    the slack (compute less default T_comm) delays the rest; a negative slack credits savings (``queued_region``)."""
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
    """Per site, us per iteration (>= 0) its collectives wait for SMs at normal priority, shape (S,): default
    less high-priority-probe T_comm medians per shape group, where above ``WAIT_SIGMAS`` standard errors; else 0."""
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
    from dataclasses import replace

    return replace(config, high_priority_stream=None).is_default()


def queued_region(model: Any, i: Any, region: Any, t_comm: Any) -> np.ndarray:
    """Region of queued sites ``i``: ``region`` plus the queue's delay (or saving) beyond the site's slack share,
    less what the window's own region already holds; an empty window's own region is the default one."""
    extra = t_comm - model.t_comm_default_S[i]
    q, empty = model.queued_S[i], model.queue_empty_S[i]
    queue = np.maximum(extra - model.queue_free_S[i], -model.queue_excess_S[i])
    own = (region - model.region_default_S[i]) * (1.0 - empty)
    held = np.where(extra >= 0.0, np.clip(own, 0.0, np.maximum(extra, 0.0)), np.clip(own, np.minimum(extra, 0.0), 0.0))
    rest = np.where(extra >= 0.0, np.maximum(0.0, queue - held), np.minimum(0.0, queue - held))
    return np.where(q > 0.0, region - extra * empty + rest, region)
