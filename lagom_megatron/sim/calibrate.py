"""Fitting a GPU's contention constants from ``scripts/gpu/contention_probe.py``'s CSV
(``lagom calibrate contention CSV``).

The probe times compute kernels alone and beside a copy / reduce kernel holding ``ctas``
persistent CTAs (``mode`` copy or reduce: HBM traffic; ``l2``: the same CTAs looping over an
L2-resident buffer, so SMs are held with almost no HBM traffic). Per row it records the
compute kernel's time alone and overlapped (us), its HBM bytes, the channel kernel's HBM traffic
rate alone (GB/s) and the device's peak copy bandwidth (GB/s). With the simulator's sharing rule
(``sim.device``, ``sim.timeline``) each overlapped row gives one value of a constant:

* ``kappa_mem`` from memory-bound kernels (``kind`` elementwise / attention) beside copy/reduce:
  slowdown = (1 / f) * (1 + kappa_mem * share), f = min(1, peak / (demand_compute + demand_comm)),
  share = demand_comm * f / peak;
* ``kappa_compute`` from GEMMs beside copy/reduce: slowdown = wave(ctas) * (1 + kappa * share);
* the SM term is checked, not fitted: ``l2`` rows against ``device.wave_factor`` (mean absolute
  error in percent).

Each constant is the median of its rows (rows with ``share`` < 0.02 say nothing and are skipped).
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
"""The probe CSV's columns (units in the names: us, bytes, GB/s)."""
MIN_SHARE = 0.02


@dataclass(frozen=True)
class Fitted:
    """Fitted constants of one GPU and how many rows gave each (None: no usable row)."""

    gpu: str
    kappa_mem: float | None
    kappa_compute: float | None
    sm_term_mae_pct: float | None
    rows: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        """The constants as a plain mapping (the YAML's body)."""
        return {"gpu": self.gpu, "kappa_mem": self.kappa_mem, "kappa_compute": self.kappa_compute,
                "sm_term_mae_pct": self.sm_term_mae_pct, "rows": dict(self.rows)}


TEXT_COLUMNS = ("gpu", "kernel", "kind", "mode")
"""The columns that hold names; every other column holds a finite number >= 0."""
POSITIVE_COLUMNS = ("sms", "peak_hbm_gbs")
"""Numeric columns that must be > 0 (the fit divides by them)."""


def read_rows(path: "str | os.PathLike") -> list[dict[str, Any]]:
    """The probe CSV's rows with numbers parsed (``COLUMNS``; times in us, bytes, GB/s).

    Raises:
        ValueError: a missing column (names it and the expected set); a cell that is not a number,
            or a negative, infinite or NaN one (``file:line``, the column and the value as written;
            ``sms`` and ``peak_hbm_gbs`` must be > 0); or no rows.
        OSError: the file cannot be read.
    """
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
    """``text`` as a finite number >= 0 (> 0 for ``POSITIVE_COLUMNS``); ValueError names ``where``,
    the column and the value as written."""
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
    """Fits ``kappa_mem`` and ``kappa_compute`` and checks the SM term (module docstring).

    Raises:
        ValueError: rows of more than one GPU.
    """
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
    """Writes the constants as YAML atomically (``engine.files.write_text_atomic``: a temporary file,
    flushed to disk, renamed over ``out``).

    Raises:
        OSError: ``out`` exists but cannot be read (never overwritten then), or cannot be written.
    """
    if out.exists() and not os.access(out, os.R_OK):
        raise OSError(f"{out} exists and cannot be read; not overwriting it")
    doc = {**fitted.to_dict(), "source_csv": source, "fitted_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "use": "copy kappa_mem / kappa_compute into the GPU's cluster file (configs/clusters/*.yaml)"}
    write_text_atomic(out, yaml.safe_dump(doc, sort_keys=False))
