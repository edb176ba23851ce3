"""``lagom bench simulated --sensitivity``: speed-ups at each end of every ranged constant (tornado table, seed 0)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lagom_megatron.sim.bench.table import ROWS, write_csv
from lagom_megatron.sim.constants import CONSTANTS, overridden

SENSITIVITY_ROWS: tuple[tuple[str, str, int], ...] = (
    ("llama2-7b-a40x16-fsdp", "a40-pcie-ib200", 2), ("gpt3-2.7b-a40x8-fsdp", "a40-nvlink-ib800", 1),
    ("llama2-7b-a40x16-tp8", "a40-pcie-ib200", 2), ("gpt3-2.7b-a40x8-fsdp", "h100-sxm-ib400", 1),
    ("llama3-8b-h100x8", "h100-sxm-ib400", 1), ("llama2-7b-a100x32-ib100", "a100-ib100", 1),
)
COLUMNS = ("constant", "end", "value", "preset", "cluster", "microbatches", "kept", "oracle", "best_static", "bound")


def one(preset_name: str, cluster: str, mb: int | None, verify_iters: int | None,
        verify_max_iters: int | None = None) -> dict[str, float]:
    """Speed-ups over NCCL defaults of one row (seed 0)."""
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.sim.backend import SimulatedCluster, run_lifecycle, verify_counts
    from lagom_megatron.sim.bench.row import NEMO_CAPS, UB_GROUPS, groups_of, median_us, shared, with_microbatches

    preset = load_preset(preset_name)
    vi, cap = verify_counts(preset, verify_iters, verify_max_iters)
    sim = SimulatedCluster(with_microbatches(preset, mb) if mb else preset, cluster, seed=0)
    base = shared(sim)
    groups = frozenset(groups_of(sim))
    default = median_us(sim, iters=5)
    static = [median_us(sim, iters=5, group_caps=base["caps"]),
              median_us(sim, iters=5, group_caps={g: c for g, c in NEMO_CAPS.items() if g in groups}),
              median_us(sim, iters=5, high_priority=groups)]
    if base["ub"]:
        static.append(median_us(sim, iters=5, registered=UB_GROUPS))
    r = run_lifecycle(sim, method="priority", verify_iters=vi, verify_max_iters=cap, after_iters=0)
    plan = r.tuner.plan
    kept = default
    if plan is not None and r.tuner.phase.value == "applied":
        kept = median_us(sim, iters=5, assignment={k: e.config for k, e in plan.entries.items()})
    return {"kept": default / kept, "oracle": default / median_us(sim, iters=5, assignment=base["oracle_plan"]),
            "best_static": default / min(static), "bound": base["free_comm_bound"]}


def run_sensitivity(out: Path, *, presets: list[str] | None, clusters: list[str] | None,
                    microbatches: list[int | None], constants: list[str] | None, verify_iters: int | None,
                    verify_max_iters: int | None) -> int:
    """Runs ``SENSITIVITY_ROWS`` (or ``presets`` x ``clusters`` x ``microbatches``), writes ``sensitivity.csv`` and
    prints the tornado table; returns 0.
    """
    t0 = time.perf_counter()
    if presets is None and clusters is None:
        rows = list(SENSITIVITY_ROWS)
    else:
        presets = presets or list(dict.fromkeys(r[0] for r in ROWS))
        mbs = [m for m in microbatches or [2] if m is not None] or [None]
        rows = [(p, c or next((r[1] for r in ROWS if r[0] == p), None), m) for p in presets for c in clusters or [None]
                for m in mbs]
        rows = [r for r in rows if r[1] is not None]
    names = constants or list(CONSTANTS)
    lines: list[dict[str, Any]] = []
    central = {r: one(*r, verify_iters, verify_max_iters) for r in rows}
    for r, v in central.items():
        lines.append({"constant": "-", "end": "value", "value": "", "preset": r[0], "cluster": r[1], "microbatches": r[2], **v})
    for name in names:
        c = CONSTANTS[name]
        for end in ("low", "high"):
            x = getattr(c, end)
            with overridden({name: x}):
                for r in rows:
                    lines.append({"constant": name, "end": end, "value": x, "preset": r[0], "cluster": r[1],
                                  "microbatches": r[2], **one(*r, verify_iters, verify_max_iters)})
        print(f"  {name}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    write_csv(lines, out / "sensitivity.csv", COLUMNS)
    print_tornado(lines, rows)
    print(f"\nwrote {out / 'sensitivity.csv'} in {time.perf_counter() - t0:.0f} s")
    return 0


def print_tornado(lines: list[dict[str, Any]], rows: list[tuple]) -> None:
    """Prints the tornado table per row."""
    print(f"\nSENSITIVITY (SIMULATED, seed 0, {len(rows)} rows): speed-up over NCCL defaults, low end -> high end")
    for r in rows:
        key = (r[0], r[1], r[2])
        mine = [ln for ln in lines if (ln["preset"], ln["cluster"], ln["microbatches"]) == key]
        c = next(ln for ln in mine if ln["end"] == "value")
        print(f"\n{r[0]} on {r[1]}, {r[2]} micro-batch(es): bound {c['bound']:.3f}, kept {c['kept']:.3f}, "
              f"oracle {c['oracle']:.3f}, best static {c['best_static']:.3f}")
        print(f"  {'constant':18s} {'low..high':>13s}  {'kept':>13s}  {'oracle':>13s}  {'best static':>13s}")
        per: dict[str, dict[str, dict[str, Any]]] = {}
        for ln in mine:
            if ln["end"] != "value":
                per.setdefault(ln["constant"], {})[ln["end"]] = ln
        for name in sorted(per, key=lambda n: -abs(per[n]["high"]["kept"] - per[n]["low"]["kept"])):
            lo, hi, cst = per[name]["low"], per[name]["high"], CONSTANTS[name]
            print(f"  {name:18s} {f'{cst.low:g}..{cst.high:g}':>13s}  " + "  ".join(
                f"{lo[k]:.3f}->{hi[k]:.3f}" for k in ("kept", "oracle", "best_static")))
