"""``lagom calibrate contention``: from ``scripts/gpu/contention_probe.py``'s CSV, f = min(1, peak / demand), share =
demand_comm f / peak; memory-bound slowdown (1 + kappa_mem share) / f, GEMM wave(ctas)(1 + kappa_compute share);
medians, share < MIN_SHARE skipped. ``lagom calibrate bandwidth``: from nccl-tests sweeps, per run t = latency + wire /
bw (nccl-tests doc/PERFORMANCE.md), across runs Levenberg-Marquardt on log bw of ``comm_cost``'s softmin; a parameter
whose standard error at NOISE_LOG exceeds MAX_STD is not identified and written nowhere."""

from __future__ import annotations

import csv
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.files import write_text_atomic
from lagom_megatron.engine.knobs import PROTOCOLS
from lagom_megatron.nccl.perf_table import PerfRun
from lagom_megatron.sim.device import SAT_P, THREAD_EXPONENT, ComputeKernel, softmin, wave_factor

COLUMNS = (
    "gpu",
    "sms",
    "peak_hbm_gbs",
    "kernel",
    "kind",
    "tiles",
    "persistent",
    "mode",
    "ctas",
    "threads",
    "chunk_bytes",
    "total_bytes",
    "t_alone_us",
    "t_overlap_us",
    "kernel_hbm_bytes",
    "comm_hbm_gbs",
)
"""Units in the names: us, bytes, GB/s."""
MIN_SHARE = 0.02


@dataclass(frozen=True)
class Fitted:
    """Fitted constants of one GPU and rows per constant (None: no usable row)."""

    gpu: str
    kappa_mem: float | None
    kappa_compute: float | None
    sm_term_mae_pct: float | None
    rows: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "kappa_mem": self.kappa_mem,
            "kappa_compute": self.kappa_compute,
            "sm_term_mae_pct": self.sm_term_mae_pct,
            "rows": dict(self.rows),
        }


TEXT_COLUMNS = ("gpu", "kernel", "kind", "mode")
POSITIVE_COLUMNS = ("sms", "peak_hbm_gbs")


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The probe CSV's rows parsed; ValueError (named ``file:line``) for a bad column or cell, or no rows."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; a probe CSV has {list(COLUMNS)}")
        out = []
        for n, row in enumerate(reader, start=2):
            out.append({k: row[k] if k in TEXT_COLUMNS else _number(row[k], f"{path}:{n}", k) for k in COLUMNS})
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


def _number(text: str | None, where: str, column: str) -> float:
    text = (text or "").strip()
    allowed = "a finite number > 0" if column in POSITIVE_COLUMNS else "a finite number >= 0"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: {column} must be {allowed}; got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and column in POSITIVE_COLUMNS):
        raise ValueError(f"{where}: {column} must be {allowed}; got {text}")
    return value


def fit(rows: list[dict[str, Any]]) -> Fitted:
    """Fits ``kappa_mem`` and ``kappa_compute`` and checks the SM term; ValueError for rows of several GPUs."""
    gpus = {r["gpu"] for r in rows}
    if len(gpus) != 1:
        raise ValueError(f"a probe CSV holds one GPU; got {sorted(gpus)}")
    mem, comp, sm_err = [], [], []
    for r in rows:
        if r["t_alone_us"] <= 0 or r["t_overlap_us"] <= 0:
            continue
        slow = r["t_overlap_us"] / r["t_alone_us"]
        sms, ctas = int(r["sms"]), int(r["ctas"])
        k = ComputeKernel(r["kernel"], r["kind"], 0.0, 0.0, tiles=int(r["tiles"]), persistent=bool(r["persistent"]))
        wave = wave_factor(sms, sms - ctas, k)
        if r["mode"] == "l2":
            sm_err.append(abs(slow - wave) / wave)
            continue
        peak = r["peak_hbm_gbs"]
        d_c = r["kernel_hbm_bytes"] / (r["t_alone_us"] * 1e3)
        d_comm = r["comm_hbm_gbs"]
        f = min(1.0, peak / max(d_c + d_comm, 1e-9))
        share = d_comm * f / peak
        if share < MIN_SHARE:
            continue
        if r["kind"] == "gemm":
            comp.append((slow / wave - 1.0) / share)
        else:
            mem.append((slow * f - 1.0) / share)
    med = lambda xs: max(0.0, statistics.median(xs)) if xs else None  # noqa: E731
    return Fitted(
        gpu=gpus.pop(),
        kappa_mem=med(mem),
        kappa_compute=med(comp),
        sm_term_mae_pct=100.0 * statistics.fmean(sm_err) if sm_err else None,
        rows={"kappa_mem": len(mem), "kappa_compute": len(comp), "sm_term": len(sm_err)},
    )


def write_yaml(fitted: Fitted, out: Path, *, source: str) -> None:
    """Writes the constants as YAML atomically; OSError (never overwriting) if ``out`` exists unreadable."""
    if out.exists() and not os.access(out, os.R_OK):
        raise OSError(f"{out} exists and cannot be read; not overwriting it")
    doc = {
        **fitted.to_dict(),
        "source_csv": source,
        "fitted_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "use": "copy kappa_mem / kappa_compute into the GPU's cluster file (configs/clusters/*.yaml)",
    }
    write_text_atomic(out, yaml.safe_dump(doc, sort_keys=False))


THREAD_KINDS = ("LL", "Simple")
P_BOUNDS, E_BOUNDS = (1.0, 64.0), (0.0, 2.0)
NOISE_LOG = 0.01
"""Assumed scatter of one run's log bandwidth (1%)."""
MAX_STD = {"log": 0.05, "p": 0.2, "e": 0.05}


@dataclass(frozen=True)
class RunBandwidth:
    """One run's bus bandwidth (GB/s) and latency (us)."""

    run: PerfRun
    bw_gbs: float
    latency_us: float | None
    """None when the run has one size."""

    @property
    def kind(self) -> str:
        return "P2P" if self.run.algorithm == "P2P" else self.run.protocol

    @property
    def scope(self) -> str:
        """``intra`` (one node) or ``inter``."""
        return "intra" if self.run.nodes == 1 else "inter"


@dataclass(frozen=True)
class Curve:
    """The fitted shape of one scope x kind; None: not identified."""

    scope: str
    kind: str
    per_channel_gbs: float | None
    link_eff: float | None
    """Ceiling / ``link_name``'s bandwidth."""
    link_name: str
    ceiling_gbs: float | None
    runs: int
    mape_pct: float
    op_mape_pct: dict[str, float]


@dataclass(frozen=True)
class BandwidthFit:
    curves: tuple[Curve, ...]
    saturation_p: float | None
    thread_exponent: float | None
    runs: tuple[RunBandwidth, ...]
    notes: tuple[str, ...] = field(default=())


def run_bandwidth(run: PerfRun) -> RunBandwidth | None:
    """Fits ``t = latency + wire / bw`` to one run; None without a row with a size and a time."""
    w = np.array([r.size * run.bus_factor for r in run.rows], dtype=float)
    t = np.array([r.time_us for r in run.rows], dtype=float)
    if not len(w) or run.bus_factor <= 0:
        return None
    if len(set(w.tolist())) == 1:
        return RunBandwidth(run, float(np.mean(w / t)) * 1e-3, None)
    (a, x), *_ = np.linalg.lstsq(np.stack([1.0 / t, w / t], axis=1), np.ones_like(t), rcond=None)
    if a < 0:  # no measurable latency: the line through the origin
        a, x = 0.0, float(np.sum(w / t) / np.sum((w / t) ** 2))
    if x <= 0:
        return None
    return RunBandwidth(run, 1e-3 / x, float(a))


def _link(r: RunBandwidth, c: ClusterSpec) -> tuple[float, str]:
    if r.scope == "intra":
        return c.nvlink_gbps_per_gpu, "nvlink_gbps_per_gpu"
    if r.kind == "P2P":
        return c.net_gbps_per_gpu, "net_gbps_per_gpu"
    per_node = (r.run.ranks // r.run.nodes) if r.run.ranks else c.gpus_per_node
    return c.net_gbps_per_gpu * max(1, per_node), f"net_gbps_per_gpu x {max(1, per_node)} ranks per node"


def _jacobian(resid, x, r):
    h = 1e-6 * np.maximum(1.0, np.abs(x))
    return np.stack([(resid(x + h[j] * np.eye(len(x))[j]) - r) / h[j] for j in range(len(x))], axis=1)


def _lm(resid, x0, lo, hi, iters: int = 300):
    x = np.clip(np.asarray(x0, dtype=float), lo, hi)
    r = resid(x)
    cost, lam = float(r @ r), 1e-3
    for _ in range(iters):
        jac = _jacobian(resid, x, r)
        a, g = jac.T @ jac, jac.T @ r
        while lam < 1e12:
            step = np.linalg.solve(a + lam * (np.diag(np.diag(a)) + 1e-12 * np.eye(len(x))), -g)
            xn = np.clip(x + step, lo, hi)
            rn = resid(xn)
            if float(rn @ rn) < cost:
                break
            lam *= 4.0
        else:
            break
        done = cost - float(rn @ rn) < 1e-14 * (1.0 + cost)
        x, r, cost, lam = xn, rn, float(rn @ rn), max(lam / 3.0, 1e-12)
        if done:
            break
    return x, cost


def fit_bandwidth(runs: Sequence[PerfRun], cluster: ClusterSpec) -> BandwidthFit:
    """Fits every run, then the shape across them; ValueError when no run has a usable row."""
    notes = [
        f"{r.path}: asked {r.asked_channels} channels, NCCL ran {r.channels}"
        for r in runs
        if r.channels != r.asked_channels and r.algorithm != "P2P"
    ]
    seen = sorted({f"{r.gpu or 'GPU not named'} x {r.ranks or '?'} ranks on {r.nodes} node(s)" for r in runs})
    notes.append(f"runs measured on {'; '.join(seen)}; the cluster file says {cluster.gpus_per_node} x {cluster.gpu}")
    versions = sorted({r.nccl_version for r in runs if r.nccl_version})
    if versions and versions != [cluster.nccl_version]:
        notes.append(f"runs used NCCL {', '.join(versions)}; the cluster file says {cluster.nccl_version}")
    fitted = []
    for run in runs:
        rb = run_bandwidth(run)
        (fitted.append(rb) if rb else notes.append(f"{run.path}: no row with a size and a time > 0; not used"))
    if not fitted:
        raise ValueError(
            f"no usable row in {len(runs)} file(s) ({', '.join(r.path for r in runs[:3])}"
            f"{', ...' if len(runs) > 3 else ''}): every row has size 0 or time 0"
        )
    keys = sorted({(r.scope, r.kind) for r in fitted}, key=lambda k: (k[0] != "intra", k[1]))
    g = np.array([keys.index((r.scope, r.kind)) for r in fitted])
    n = np.array([float(r.run.channels) for r in fitted])
    thr = np.array([r.run.threads / 512.0 if r.kind in THREAD_KINDS else 1.0 for r in fitted])
    links = [_link(r, cluster) for r in fitted]
    link = np.array([v for v, _ in links])
    bw = np.array([r.bw_gbs for r in fitted])
    ng = len(keys)
    free_e = any(
        len({r.run.threads for r in fitted if (r.scope, r.kind) == k}) > 1 for k in keys if k[1] in THREAD_KINDS
    )

    def unpack(x, p_fixed):
        c, eff = np.exp(x[:ng]), np.exp(x[ng : 2 * ng])
        p = math.exp(x[2 * ng]) if p_fixed is None else p_fixed
        e = x[2 * ng + 1] if free_e else THREAD_EXPONENT
        return c, eff, p, e

    def model(x, p_fixed=None):
        c, eff, p, e = unpack(x, p_fixed)
        return n * c[g] * thr**e, eff[g] * link, p

    def resid(x, p_fixed=None):
        rate, cap, p = model(x, p_fixed)
        return np.log(softmin(rate, cap, p)) - np.log(bw)

    lo = np.r_[np.full(ng, math.log(1e-2)), np.full(ng, math.log(1e-3)), math.log(P_BOUNDS[0]), E_BOUNDS[0]]
    hi = np.r_[np.full(ng, math.log(1e3)), np.full(ng, math.log(10.0)), math.log(P_BOUNDS[1]), E_BOUNDS[1]]
    c0 = [np.median([b / m for b, m, gi in zip(bw, n, g) if gi == k and m == n[g == k].min()]) for k in range(ng)]
    eff0 = [1.1 * np.max(bw[g == k] / link[g == k]) for k in range(ng)]
    starts = [np.r_[np.log(c0), np.log(eff0), math.log(p0), THREAD_EXPONENT] for p0 in (2.0, SAT_P)]
    x, _ = min((_lm(lambda v: resid(v), s, lo, hi) for s in starts), key=lambda xc: xc[1])
    std = _std_errors(resid, x)
    p_known = bool(std[2 * ng] <= MAX_STD["p"])
    if not p_known:
        notes.append(
            "saturation p not identified: too few runs near the knee (channels x per-channel bandwidth "
            f"close to the ceiling); the fit used the simulator's {SAT_P:g}"
        )
        x, _ = _lm(lambda v: resid(v, SAT_P), x, lo, hi)
        std = _std_errors(lambda v: resid(v, SAT_P), x)
    c, eff, p, e = unpack(x, None if p_known else SAT_P)
    rate, cap, _ = model(x, None if p_known else SAT_P)
    err = np.abs(softmin(rate, cap, p) - bw) / bw * 100.0
    curves = []
    for k, (scope, kind) in enumerate(keys):
        mine = g == k
        ops = defaultdict(list)
        for r, er in zip((r for r, m in zip(fitted, mine) if m), err[mine]):
            ops[r.run.op].append(er)
        has_rate, has_cap = bool(std[k] <= MAX_STD["log"]), bool(std[ng + k] <= MAX_STD["log"])
        if not (has_rate or has_cap):
            notes.append(
                f"{scope} {kind}: the runs cannot tell per-channel bandwidth from the ceiling: sweep more "
                "channel counts"
            )
        elif not has_cap:
            notes.append(
                f"{scope} {kind}: ceiling not identified: no run was limited by it (add runs with more channels)"
            )
        elif not has_rate:
            notes.append(
                f"{scope} {kind}: per-channel bandwidth not identified: every run was at the ceiling "
                "(add runs with fewer channels)"
            )
        name = next(nm for (_, nm), m in zip(links, mine) if m)
        curves.append(
            Curve(
                scope=scope,
                kind=kind,
                per_channel_gbs=float(c[k]) if has_rate else None,
                link_eff=float(eff[k]) if has_cap else None,
                link_name=name,
                ceiling_gbs=float(eff[k] * link[mine][0]) if has_cap and scope == "intra" else None,
                runs=int(mine.sum()),
                mape_pct=float(err[mine].mean()),
                op_mape_pct={op: float(np.mean(v)) for op, v in sorted(ops.items())},
            )
        )
    e_known = free_e and bool(std[2 * ng + 1] <= MAX_STD["e"])
    if not e_known:
        why = "Simple / LL runs have one thread count" if not free_e else "the thread counts do not separate it"
        notes.append(f"thread exponent not identified: {why}; the fit used {THREAD_EXPONENT:g}")
    return BandwidthFit(
        curves=tuple(curves),
        saturation_p=p if p_known else None,
        thread_exponent=float(e) if e_known else None,
        runs=tuple(fitted),
        notes=tuple(notes),
    )


def _std_errors(resid, x) -> np.ndarray:
    jac = _jacobian(resid, x, resid(x))
    cov = np.linalg.inv(jac.T @ jac + 1e-10 * np.eye(len(x)))
    return NOISE_LOG * np.sqrt(np.maximum(np.diag(cov), 0.0))


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def fit_to_cluster_fields(fit: BandwidthFit) -> dict[str, Any]:
    """The cluster-file keys a fit identified (per protocol; P2P curves map to none)."""
    ring = [c for c in fit.curves if c.kind in PROTOCOLS]
    per_channel: dict[str, float] = {}
    for c in sorted(ring, key=lambda c: c.scope != "intra"):
        if c.per_channel_gbs is not None:
            per_channel.setdefault(c.kind, _sig(c.per_channel_gbs))
    out: dict[str, Any] = {}
    if per_channel:
        out["per_channel_gbps"] = per_channel
    for key, scope in (("link_eff", "intra"), ("net_eff", "inter")):
        effs = {c.kind: _sig(c.link_eff) for c in ring if c.scope == scope and c.link_eff is not None}
        if effs:
            out[key] = effs
    if fit.saturation_p is not None:
        out["bw_saturation_p"] = _sig(fit.saturation_p)
    if fit.thread_exponent is not None:
        out["channel_thread_exponent"] = _sig(fit.thread_exponent)
    return out


def calibrated_cluster(base: dict[str, Any], fit: BandwidthFit, *, name: str, source: str) -> dict[str, Any]:
    """``base`` with the fitted keys merged and ``name`` set; ValueError if not a valid cluster."""
    doc = dict(base)
    for key, value in fit_to_cluster_fields(fit).items():
        doc[key] = {**(doc.get(key) or {}), **value} if isinstance(value, dict) else value
    doc["name"] = name
    ClusterSpec.from_dict(doc, source=source)
    return doc


def summary_lines(fit: BandwidthFit) -> list[str]:
    fmt = lambda v, spec: "not identified" if v is None else format(v, spec)  # noqa: E731
    lines = []
    for c in fit.curves:
        ceiling = f" = {c.ceiling_gbs:.3g} GB/s" if c.ceiling_gbs is not None else ""
        per_op = ", ".join(f"{op} {v:.1f}%" for op, v in c.op_mape_pct.items())
        lines.append(
            f"{c.scope} {c.kind}: {fmt(c.per_channel_gbs, '.3g')} GB/s per channel; ceiling "
            f"{fmt(c.link_eff, '.3f')} x {c.link_name}{ceiling}; {c.runs} runs, error {c.mape_pct:.1f}% ({per_op})"
        )
    lines.append(f"saturation p {fmt(fit.saturation_p, '.3g')}, thread exponent {fmt(fit.thread_exponent, '.3g')}")
    return lines + [f"note: {n}" for n in fit.notes]
