"""Fitting the cost model (``cost_model.CostModel``) to a profile. Our design. Per shape group (op, bytes, communicator,
size, nodes; gloo: site), ridge least squares pulled to the ClusterSpec priors for alpha, beta, gamma (T_comm) and a, b
(slowdown, per call level), then reweighted towards the least absolute relative error (MAPE)."""

from __future__ import annotations

import math

import numpy as np

from lagom_megatron.engine import cost_terms
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import PRIOR_A, PRIOR_B, CostModel, sm_term
from lagom_megatron.engine.profile import Profile

RIDGE_COMM = 0.005
"""Pull of alpha, beta towards 1 relative to one sample's squared relative error."""
RIDGE_SLOWDOWN = 0.02
"""Pull of the slowdown coefficients a, b towards their priors (relative to the features' size)."""
GAMMA_GRID = tuple(float(x) for x in np.round(np.geomspace(0.25, 8.0, 31), 4))
"""Per-channel bandwidth scales tried (x ClusterSpec prior): 31 scales 12% apart place the saturation knee to ~6%."""
RIDGE_GAMMA = 0.01
"""Pull of gamma towards 1, per unit of squared log."""
IRLS_STEPS = 4
NOISE_REL = 0.02


def fit_cost_model(profile: Profile, cluster: ClusterSpec) -> CostModel:
    """Fits alpha, beta (T_comm), a, b (slowdown) per shape group; ValueError on no sites or a site without samples."""
    if not profile.sites:
        raise ValueError("profile has no collective sites to fit")
    # a region time <= 0 is a failed measurement (and a zero MAPE denominator)
    usable = [
        s
        for s in profile.samples
        if math.isfinite(s.t_comm_us) and math.isfinite(s.t_region_us) and s.t_comm_us > 0 and s.t_region_us > 0
    ]
    samples = [s for s in usable if s.iteration > 0] or usable
    if len({s.site_id for s in samples}) < len(profile.sites):
        samples = usable
    by_site: dict[str, list] = {s.site_id: [] for s in profile.sites}
    for smp in samples:
        by_site[smp.site_id].append(smp)
    missing = [k for k, v in by_site.items() if not v]
    if missing:
        raise ValueError(
            f"profile has no usable sample (finite t_comm_us > 0 and t_region_us > 0) for site(s) {missing[:5]}"
        )
    backend = "gloo" if profile.backend == "gloo" else cluster.backend
    # never measured alone: the shortest region, an upper bound (the slowdown then stays prior)
    t_comp = []
    for site in profile.sites:
        comp = [s.t_comp_us for s in by_site[site.site_id] if math.isfinite(s.t_comp_us)]
        comp = comp or [
            s.t_comp_us for s in profile.samples if s.site_id == site.site_id and math.isfinite(s.t_comp_us)
        ]
        t_comp.append(float(np.median(comp)) if comp else min(s.t_region_us for s in by_site[site.site_id]))
    model = CostModel.from_priors(profile.sites, t_comp, cluster, backend=backend)
    per_call = [_call_compute(by_site[site.site_id]) for site in profile.sites]
    model.set_call_levels(per_call)
    rows = [(i, smp) for i, site in enumerate(profile.sites) for smp in by_site[site.site_id]]
    i_J = np.array([i for i, _ in rows])
    codes = np.array([model.encode(i, smp.config) for i, smp in rows], dtype=float)
    alg_J, proto_J = codes[:, 0].astype(np.int64), codes[:, 1].astype(np.int64)
    nc_J, nt_J, chunk_J = codes[:, 2], codes[:, 3], codes[:, 4]
    y_region = np.array([smp.t_region_us for _, smp in rows])
    y_comp = model.t_comp_us_S[i_J]
    S, calls = len(profile.sites), model.calls_S[i_J]
    gi, G = _shape_groups(model)
    # torch's T_comm holds the wait for a running kernel's blocks at normal priority; the fit is of the run alone
    waits = cost_terms.dispatch_waits(profile.sites, by_site, gi, noise_rel=NOISE_REL)
    model.wait_S = waits if waits.any() else None
    hp_J = np.array([1.0 if smp.config.high_priority_stream else 0.0 for _, smp in rows])
    wait_J = waits[i_J] * (1.0 - hp_J)
    # the run: torch's duration (one clock for defaults and probes alike) less the wait
    torch_J = np.array([max(smp.t_comm_us, 1e-6) for _, smp in rows])
    y_comm = np.maximum(torch_J - wait_J, 0.5 * torch_J)
    y_meas = torch_J
    # per gamma, ridge fit of alpha, beta towards k: on gloo k may be the measured-to-prior scale (shape, not speed)
    F_J = gi[i_J]
    best_err = np.full(G, np.inf)
    alpha, beta, gamma, scale_S = np.ones(G), np.ones(G), np.ones(G), np.ones(G)
    for g in GAMMA_GRID:
        model.gamma_S = np.full(S, g)
        lat, xfer, _, _, _ = model.prior_parts(i_J, alg_J, proto_J, nc_J, nt_J, chunk_J)
        f1, f2 = calls * lat / y_comm, calls * xfer / y_comm
        k_med = _weighted_median_by_site(F_J, G, 1.0 / np.maximum(f1 + f2, 1e-12), np.maximum(f1 + f2, 1e-12))
        for k in (np.ones(G), k_med) if model.gloo else (np.ones(G),):
            a_g, b_g = _ridge2(F_J, G, k[F_J] * f1, k[F_J] * f2, np.ones_like(f1), RIDGE_COMM, 1.0, 1.0, lo=0.05)
            a_g, b_g = a_g * k, b_g * k
            err = np.bincount(F_J, (a_g[F_J] * f1 + b_g[F_J] * f2 - 1.0) ** 2, G) + RIDGE_GAMMA * np.log(g) ** 2
            take = err < best_err - 1e-12
            best_err[take], alpha[take], beta[take], gamma[take], scale_S[take] = (
                err[take],
                a_g[take],
                b_g[take],
                g,
                k[take],
            )
    model.gamma_S = gamma[gi]
    lat, xfer, ctas, wire, hbm_mult = model.prior_parts(i_J, alg_J, proto_J, nc_J, nt_J, chunk_J)
    # IRLS towards least absolute relative error (MAPE): wild samples (a straggling rank) do not drag the fit
    f1, f2 = calls * lat / y_comm, calls * xfer / y_comm
    kJ = scale_S[F_J]
    for _ in range(IRLS_STEPS):
        w = 1.0 / np.sqrt(np.maximum(np.abs(alpha[F_J] * f1 + beta[F_J] * f2 - 1.0), 0.02))
        alpha, beta = _ridge2(F_J, G, w * kJ * f1, w * kJ * f2, w, RIDGE_COMM, 1.0, 1.0, lo=0.05)
        alpha, beta = alpha * scale_S, beta * scale_S
    model.alpha_S, model.beta_S = alpha[gi], beta[gi]
    # s is observed only where the compute branch is active (region longer than comm)
    F_R, ctas_R, s_comm, s_comp, s_region, hbm_rate, L_R, I_R, s_wait = _slowdown_rows(
        rows, per_call, model.call_level, F_J, ctas, y_comm, y_comp, y_region, hbm_mult * wire, calls, wait_J
    )
    r = (s_region - s_comp) / s_comm
    observed = (s_region > 1.01 * (s_comm + s_wait)) & (r > 0)
    if model.slow_SL is not None:  # a summed sample of a site with calls unlike each other pins no s
        observed &= ~((L_R < 0) & ((model.comp_weights_SL > 0).sum(axis=1)[I_R] > 1))
    r = np.clip(r, 0.0, 0.9)
    s_obs = r / (1.0 - r)
    g1 = sm_term(ctas_R, model.cluster.sms_per_gpu, model.gloo)
    g2 = hbm_rate * 1e-3 / model.cluster.hbm_gbps
    w = observed.astype(float)
    # weight = precision: a NOISE_REL timing error moves r by NOISE_REL region / T_comm, s by that / (1 - r)^2
    scale = NOISE_REL * (s_region / s_comm) / (1.0 - r) ** 2 + 0.05 * s_obs + 1e-3
    a_G, b_G = _ridge2(
        F_R,
        G,
        w * g1 / scale,
        w * g2 / scale,
        w * s_obs / scale,
        RIDGE_SLOWDOWN,
        PRIOR_A,
        PRIOR_B,
        lo=0.0,
        ref=(np.bincount(F_R, g1 / scale, G), np.bincount(F_R, g2 / scale, G)),
    )
    k_R = np.ones(len(F_R))
    if model.slow_SL is not None:
        k_R = _level_factors(model, gi, F_R, L_R, I_R, s_obs, a_G[F_R] * g1 + b_G[F_R] * g2, observed)
        a_G, b_G = _refine_slowdown(F_R, G, a_G, b_G, g1 * k_R, g2 * k_R, s_comm, s_comp, s_region, observed, s_wait)
        k_R = _level_factors(model, gi, F_R, L_R, I_R, s_obs, a_G[F_R] * g1 + b_G[F_R] * g2, observed)
    else:
        a_G, b_G = _refine_slowdown(F_R, G, a_G, b_G, g1, g2, s_comm, s_comp, s_region, observed, s_wait)
    model.a_S, model.b_S = a_G[gi], b_G[gi]
    if not model.gloo:
        s_fit = (a_G[F_R] * g1 + b_G[F_R] * g2) * k_R
        # only samples that pin s: a NOISE_REL timing error then moves s by at most ~10%
        precise = observed & (s_comm >= CORR_MIN_COMM_SHARE * s_region)
        model.corr_SC = _channel_correction(F_R, G, gi, ctas_R, s_obs, s_fit, precise, model.max_channels)
    if not model.gloo:
        model.mark_queues()
    # the queue term lies in other sites' regions, never in a site's own measurement: the fit error leaves it out
    queued, model.queued_S = model.queued_S, None
    t_comm_hat, _, t_region_hat = model.evaluate(i_J, alg_J, proto_J, nc_J, nt_J, chunk_J, hp=hp_J)
    if not model.gloo:  # other groups' collectives in each window (``cross``): what the own model leaves
        offsets = cost_terms.window_offsets(S, i_J, y_region - t_region_hat, y_region)
        model.offset_S = offsets if offsets.any() else None
        t_region_hat = model.evaluate(i_J, alg_J, proto_J, nc_J, nt_J, chunk_J, hp=hp_J)[2]
    model.queued_S = queued
    model.mape = float(100.0 * np.mean(np.abs(t_region_hat - y_region) / np.maximum(y_region, 1e-9)))
    model.mape_comm = float(100.0 * np.mean(np.abs(t_comm_hat - y_meas) / y_meas))
    model.wape = float(100.0 * np.sum(np.abs(t_region_hat - y_region)) / max(float(np.sum(y_region)), 1e-9))
    model.mape_floor = mape_floor(_indistinct_keys(model, i_J, nc_J, chunk_J, codes), y_region)
    model.n_points = len(rows)
    return model


def _call_compute(samples: list) -> list[float]:
    timed = [smp.calls for smp in samples if smp.calls and all(math.isfinite(c[1]) for c in smp.calls)]
    if not timed:
        return []
    lengths = [len(c) for c in timed]
    m = max(set(lengths), key=lambda n: (lengths.count(n), n))
    return [float(np.median([c[k][1] for c in timed if len(c) == m])) for k in range(m)]


def _slowdown_rows(rows, per_call, call_level, F_J, ctas_J, y_comm, y_comp, y_region, hbm_per_call_J, calls_J, wait_J):
    """The slowdown fit's rows (one per call where calls match ``per_call``, else per sample), shape (R,): group,
    CTAs, T_comm, T_comp, T_region (us), HBM bytes per us, call level (-1: summed), site, dispatch wait (us)."""
    out: list[tuple] = []
    for j, (i, smp) in enumerate(rows):
        levels = per_call[i]
        if smp.calls and len(smp.calls) == len(levels) and all(c[0] > 0 and c[2] > 0 for c in smp.calls):
            w = wait_J[j] / calls_J[j]
            for k, ((c_comm, _, c_region), c_comp) in enumerate(zip(smp.calls, levels)):
                c_comm = max(c_comm - w, 0.5 * c_comm, 1e-6)  # the run, as y_comm; never zero
                rate = hbm_per_call_J[j] / c_comm
                out.append((F_J[j], ctas_J[j], c_comm, c_comp, c_region, rate, int(call_level[i][k]), i, w))
        else:
            rate = hbm_per_call_J[j] * calls_J[j] / y_comm[j]
            out.append((F_J[j], ctas_J[j], y_comm[j], y_comp[j], y_region[j], rate, -1, i, wait_J[j]))
    F, ct, comm, comp, reg, rate, lvl, site, wait = zip(*out) if out else ((),) * 9
    F_R, L_R, I_R = (np.asarray(x, dtype=np.int64) for x in (F, lvl, site))
    return (
        F_R,
        *(np.asarray(x, dtype=float) for x in (ct, comm, comp, reg, rate)),
        L_R,
        I_R,
        np.asarray(wait, dtype=float),
    )


LEVEL_FACTOR_RANGE = (0.2, 5.0)


def _level_factors(model: CostModel, gi, F_R, L_R, I_R, s_obs, s_fit, observed) -> np.ndarray:
    n_levels = (model.comp_weights_SL > 0).sum(axis=1)
    ok = observed & (s_fit > 1e-9) & (L_R >= 0)
    ratios: dict[tuple[int, int, int], list[float]] = {}
    for f, i, lv, r in zip(F_R[ok].tolist(), I_R[ok].tolist(), L_R[ok].tolist(), (s_obs[ok] / s_fit[ok]).tolist()):
        ratios.setdefault((f, int(n_levels[i]), lv), []).append(r)
    factor = {k: float(np.clip(np.median(v), *LEVEL_FACTOR_RANGE)) for k, v in ratios.items()}
    model.slow_SL[:] = 1.0
    for i in np.flatnonzero(n_levels > 1):
        for lv in range(int(n_levels[i])):
            model.slow_SL[i, lv] = factor.get((int(gi[i]), int(n_levels[i]), lv), 1.0)
    return np.where(L_R >= 0, model.slow_SL[I_R, np.maximum(L_R, 0)], 1.0)


REFINE_GRID = np.geomspace(0.5, 2.0, 13)


def _refine_slowdown(F_J, G, a_G, b_G, g1, g2, y_comm, y_comp, y_region, observed, y_wait):
    obs = observed & (y_comm > 0)
    if not obs.any():
        return a_G, b_G
    j = np.flatnonzero(obs)
    f = F_J[j]
    sa, sb = np.meshgrid(REFINE_GRID, REFINE_GRID, indexing="ij")
    sa, sb = sa.ravel()[:, None], sb.ravel()[:, None]  # (K, 1)
    s = sa * a_G[f][None, :] * g1[j][None, :] + sb * b_G[f][None, :] * g2[j][None, :]  # (K, J)
    region = np.maximum(y_comm[j] + y_wait[j], y_comp[j] + y_comm[j] * s / (1.0 + s))
    err = ((region - y_region[j]) / y_region[j]) ** 2  # (K, J)
    tot = np.stack([np.bincount(f, e, G) for e in err])  # (K, G)
    k = np.argmin(tot, axis=0)
    one = int(np.argmin(np.abs(sa.ravel() - 1.0) + np.abs(sb.ravel() - 1.0)))
    k = np.where(tot[k, np.arange(G)] < tot[one] * (1 - 1e-9), k, one)
    return a_G * sa.ravel()[k], b_G * sb.ravel()[k]


CORR_RANGE = (0.5, 2.0)
CORR_MIN_COMM_SHARE = 0.2


def _channel_correction(F_J, G, gi, ctas_J, s_obs, s_fit, observed, max_channels: int) -> np.ndarray | None:
    """Per site and channel count, measured / fitted s interpolated between observed counts; None if < 2 counts."""
    obs = observed & (s_fit > 1e-6) & (s_obs > 0)
    if not obs.any():
        return None
    corr = np.ones((G, max_channels + 1))
    any_group = False
    c_all = np.arange(max_channels + 1, dtype=float)
    for g in range(G):
        j = np.flatnonzero(obs & (F_J == g))
        if j.size == 0:
            continue
        cs = np.rint(ctas_J[j])
        ratio = np.clip(s_obs[j] / s_fit[j], *CORR_RANGE)
        keys = np.unique(cs)
        if keys.size < 2:
            continue
        med = np.array([np.median(ratio[cs == k]) for k in keys])
        corr[g] = np.interp(c_all, keys, med)
        any_group = True
    return corr[gi] if any_group else None


def _shape_groups(model: CostModel) -> tuple[np.ndarray, int]:
    if model.gloo:
        return np.arange(len(model.sites)), len(model.sites)
    keys = [(s.op, s.nbytes, s.group, s.group_size, s.n_nodes) for s in model.sites]
    index: dict[tuple, int] = {}
    gi = np.array([index.setdefault(k, len(index)) for k in keys], dtype=np.int64)
    return gi, len(index)


def _indistinct_keys(model: CostModel, i_J, nc_J, chunk_J, codes_JK) -> list[tuple]:
    """One key per sample; equal keys: same site and configs the model form cannot tell apart (gloo: pieces, n_eff)."""
    if model.gloo:
        nb = model.nbytes_S[i_J]
        pieces = np.maximum(1.0, np.where(chunk_J > 0, np.ceil(nb / np.maximum(chunk_J, 1.0)), 1.0))
        n_eff = np.minimum(nc_J, pieces)
        return list(zip(i_J.tolist(), pieces.tolist(), n_eff.tolist()))
    return [(int(i),) + tuple(float(x) for x in row) for i, row in zip(i_J, codes_JK)]


def _weighted_median_by_site(i_J: np.ndarray, S: int, v: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = np.ones(S)
    order = np.lexsort((v, i_J))
    i_o, v_o, w_o = i_J[order], v[order], w[order]
    csum = np.cumsum(w_o)
    start = np.searchsorted(i_o, np.arange(S), side="left")
    end = np.searchsorted(i_o, np.arange(S), side="right")
    for s in np.flatnonzero(end > start):
        base = csum[start[s] - 1] if start[s] > 0 else 0.0
        half = base + 0.5 * (csum[end[s] - 1] - base)
        out[s] = v_o[min(int(np.searchsorted(csum[start[s] : end[s]], half)) + start[s], end[s] - 1)]
    return out


def mape_floor(keys: list, y: np.ndarray) -> float:
    """MAPE (%) of the best single value per group of samples (its 1 / y-weighted median)."""
    y = np.maximum(np.asarray(y, dtype=float), 1e-9)
    groups: dict = {}
    for j, k in enumerate(keys):
        groups.setdefault(k, []).append(j)
    err = np.zeros(len(y))
    for idx in groups.values():
        v = y[idx]
        order = np.argsort(v)
        w = 1.0 / v[order]
        c = v[order][np.searchsorted(np.cumsum(w), 0.5 * w.sum())]
        err[idx] = np.abs(v - c) / v
    return float(100.0 * err.mean()) if len(y) else float("nan")


def _ridge2(i_J, S, f1, f2, y, lam, p1, p2, *, lo, ref=None):
    """Per-site ridge least squares, min sum (c1 f1 + c2 f2 - y)^2 + lam (w1 (c1-p1)^2 + w2 (c2-p2)^2), batched;
    ``ref`` scales the ridge by the features' size; a coefficient below ``lo`` is fixed there, the other re-solved."""
    A11 = np.bincount(i_J, f1 * f1, S)
    A12 = np.bincount(i_J, f1 * f2, S)
    A22 = np.bincount(i_J, f2 * f2, S)
    r1 = np.bincount(i_J, f1 * y, S)
    r2 = np.bincount(i_J, f2 * y, S)
    if ref is None:
        w1 = w2 = np.ones(S)
    else:
        w1, w2 = (np.maximum(x * x, 1e-12) for x in ref)
    A11, A22 = A11 + lam * w1, A22 + lam * w2
    r1, r2 = r1 + lam * w1 * p1, r2 + lam * w2 * p2
    det = A11 * A22 - A12 * A12
    c1 = (r1 * A22 - r2 * A12) / det
    c2 = (A11 * r2 - A12 * r1) / det
    low1, low2 = c1 < lo, c2 < lo
    c2 = np.where(low1 & ~low2, (r2 - A12 * lo) / A22, c2)
    c1 = np.where(low2 & ~low1, (r1 - A12 * lo) / A11, c1)
    return np.maximum(c1, lo), np.maximum(c2, lo)
