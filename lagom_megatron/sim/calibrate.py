"""A GPU's contention constants from ``scripts/gpu/contention_probe.py``'s CSV (``lagom calibrate contention``).

f = min(1, peak / demand), share = demand_comm f / peak; memory-bound: slowdown = (1 + kappa_mem share) / f;
GEMM: wave(ctas)(1 + kappa_compute share); ``l2`` rows check ``wave_factor``. Medians; share < ``MIN_SHARE`` skipped.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from lagom_megatron.engine.files import write_text_atomic
from lagom_megatron.sim.device import ComputeKernel, wave_factor

COLUMNS = ("gpu", "sms", "peak_hbm_gbs", "kernel", "kind", "tiles", "persistent", "mode", "ctas", "threads",
           "chunk_bytes", "total_bytes", "t_alone_us", "t_overlap_us", "kernel_hbm_bytes", "comm_hbm_gbs")
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
        """The YAML's body."""
        return {"gpu": self.gpu, "kappa_mem": self.kappa_mem, "kappa_compute": self.kappa_compute,
                "sm_term_mae_pct": self.sm_term_mae_pct, "rows": dict(self.rows)}


TEXT_COLUMNS = ("gpu", "kernel", "kind", "mode")
POSITIVE_COLUMNS = ("sms", "peak_hbm_gbs")


def read_rows(path: "str | os.PathLike") -> list[dict[str, Any]]:
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
    return Fitted(gpu=gpus.pop(), kappa_mem=med(mem), kappa_compute=med(comp),
                  sm_term_mae_pct=100.0 * statistics.fmean(sm_err) if sm_err else None,
                  rows={"kappa_mem": len(mem), "kappa_compute": len(comp), "sm_term": len(sm_err)})


def write_yaml(fitted: Fitted, out: Path, *, source: str) -> None:
    """Writes the constants as YAML atomically; OSError (never overwriting) if ``out`` exists unreadable."""
    if out.exists() and not os.access(out, os.R_OK):
        raise OSError(f"{out} exists and cannot be read; not overwriting it")
    doc = {**fitted.to_dict(), "source_csv": source, "fitted_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "use": "copy kappa_mem / kappa_compute into the GPU's cluster file (configs/clusters/*.yaml)"}
    write_text_atomic(out, yaml.safe_dump(doc, sort_keys=False))
