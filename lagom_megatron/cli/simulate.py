"""``lagom simulate``: the whole ``--lagom`` lifecycle on one simulated representative rank (docs/simulator.md)."""

from __future__ import annotations

import argparse

from lagom_megatron.cli.options import (
    FORCE_HELP,
    int_range,
    is_plan_text,
    is_profile_text,
    refuse_large_exhaustive,
    refuse_overwriting_an_input,
    refuse_replacing,
    writable_file,
)
from lagom_megatron.engine.tuner import MAX_VERIFY_ITERS, MAX_VERIFY_MAX_ITERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help="a GPU preset name under configs/presets/ or a path")
    parser.add_argument("--cluster", default=None, help="override the preset's cluster (name or path)")
    from lagom_megatron.engine.search import METHODS

    parser.add_argument("--method", default="priority", choices=list(METHODS))
    parser.add_argument("--seed", type=int_range(0, 2**32 - 1), default=0, help="noise seed (same seed, same timings)")
    parser.add_argument(
        "--verify-iters",
        type=int_range(1, MAX_VERIFY_ITERS),
        default=None,
        help=f"timed iterations per arm in verification, 1..{MAX_VERIFY_ITERS} "
        "(default: the preset's lagom_verify_iters; given alone, also the cap)",
    )
    parser.add_argument(
        "--verify-max-iters",
        type=int_range(1, MAX_VERIFY_MAX_ITERS),
        default=None,
        help=f"the most timed iterations per arm while the verdict is undecided, 1..{MAX_VERIFY_MAX_ITERS} "
        "(default: the preset's lagom_verify_max_iters, or --verify-iters when given)",
    )
    parser.add_argument(
        "--profile-out", default=None, type=writable_file, help="write the profile the search saw (JSON)"
    )
    parser.add_argument("--plan-out", default=None, type=writable_file, help="write the searched plan (JSON)")
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)
    parser.add_argument(
        "--show",
        type=int_range(0, 10000),
        default=5,
        metavar="N",
        help="print the N sites with the largest predicted saving (0: none)",
    )
    parser.add_argument("--json", action="store_true", help="print the tuner's summary as JSON")


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import time

    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.sim.backend import SimulatedCluster, run_lifecycle, verify_counts

    t0 = time.perf_counter()
    refuse_overwriting_an_input(args.plan_out, "--plan-out", {"--profile-out": args.profile_out})
    refuse_replacing(args.profile_out, "--profile-out", "a lagom profile", is_profile_text, force=args.force)
    refuse_replacing(args.plan_out, "--plan-out", "a lagom plan", is_plan_text, force=args.force)
    logging.getLogger("lagom.tuner").setLevel(logging.ERROR)  # the phases are printed below
    preset = load_preset(args.preset)
    sim = SimulatedCluster(preset, args.cluster, seed=args.seed)
    try:
        verify_iters, verify_max_iters = verify_counts(preset, args.verify_iters, args.verify_max_iters)
    except ValueError as e:
        raise ValueError(f"--verify-max-iters: {e}") from None  # bad usage: exit 2 (docs/cli.md)
    if args.method == "exhaustive":
        from lagom_megatron.nccl.rules import NcclRules

        refuse_large_exhaustive(sim.sites, NcclRules(sim.cluster, backend="sim").for_sites(sim.sites))
    result = run_lifecycle(sim, method=args.method, verify_iters=verify_iters, verify_max_iters=verify_max_iters)
    tuner = result.tuner
    summary = tuner.summary()
    if args.profile_out and tuner.profile is not None:
        tuner.profile.save(args.profile_out)
    if args.plan_out and tuner.plan is not None:
        # with its verdict, as a training run saves it: a rejected plan is not applied blind later
        tuner.plan.verdict(tuner.phase.value, tuner.reason).save(args.plan_out)
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
        return 0
    w = sim.workload
    print(
        f"lagom simulate: {preset.name} on {sim.cluster.name} (SIMULATED; one representative rank of "
        f"{preset.world_size}: TP{w.tp} PP{w.pp}x{w.chunks} CP{w.cp} DP{w.dp} EP{w.ep}, {w.microbatches} micro-batches)"
    )
    print(f"  {len(sim.sites)} collective sites; method {args.method}; seed {args.seed}")
    for it, phase, msg in tuner.events:
        print(f"  [{phase:>9}] iteration {it:>2}: {msg}")
    pred = summary["search"].get("predicted_iteration_us")
    pred_def = summary["search"].get("predicted_default_iteration_us", summary["search"].get("default_iteration_us"))
    print("  iteration times (simulated):")
    if summary.get("default_iteration_us"):
        print(f"    profiled under NCCL defaults : {summary['default_iteration_us'] / 1e3:10.1f} ms")
    if isinstance(pred_def, (int, float)):
        print(f"    model, NCCL defaults         : {pred_def / 1e3:10.1f} ms")
    if isinstance(pred, (int, float)):
        print(f"    predicted, plan              : {pred / 1e3:10.1f} ms")
    if "measured_plan_us" in summary:
        print(f"    measured, plan (median)      : {summary['measured_plan_us'] / 1e3:10.1f} ms")
        print(
            f"    measured, defaults (median)  : {summary['measured_default_us'] / 1e3:10.1f} ms  (x{summary['speedup']:.3f})"
        )
    if tuner.phase.value == "applied":
        print(f"    later iterations, plan (median): {result.final_median_us / 1e3:7.1f} ms")
    else:  # the defaults were kept: a later sample of them is noise, not a gain
        print("    after tuning                 : the defaults (fell_back); no gain")
    if tuner.plan is not None and tuner.plan.registered_groups:
        _next_launch(sim, tuner.plan, args.method, verify_iters, verify_max_iters)
    if args.show > 0 and tuner.plan is not None:
        _print_top_sites(tuner.plan, args.show)
    if summary.get("model_mape_pct") is not None:
        print(f"  cost model MAPE on its profiled points: {summary['model_mape_pct']:.1f}%")
    print(f"  result: {tuner.phase.value}: {tuner.reason}")
    print(f"  wall time {time.perf_counter() - t0:.1f} s")
    return 0


def _next_launch(sim, plan, method: str, verify_iters: int, verify_max_iters: int | None) -> None:
    """The launch that reuses ``plan`` with its groups' buffers registered (``--use-nccl-ub``), verified whole there."""
    from lagom_megatron.sim.backend import run_lifecycle

    groups = ", ".join(plan.registered_groups)
    with sim.registering(plan.registered_groups):
        nxt = run_lifecycle(sim, method=method, verify_iters=verify_iters, verify_max_iters=verify_max_iters, plan=plan)
    s = nxt.tuner.summary()
    print(f"  next launch, reusing the plan with the buffers of {groups} registered (--use-nccl-ub):")
    if "measured_plan_us" in s:
        print(
            f"    measured, plan / defaults    : {s['measured_plan_us'] / 1e3:10.1f} / "
            f"{s['measured_default_us'] / 1e3:.1f} ms (registered defaults: NCCL's symmetric kernels)"
        )
    print(f"    later iterations (median)    : {nxt.final_median_us / 1e3:10.1f} ms  ({nxt.tuner.phase.value})")


def _print_top_sites(plan, n: int) -> None:
    changed = [(sid, e) for sid, e in plan.entries.items() if not e.config.is_default()]
    saving = sorted(
        ((sid, e) for sid, e in changed if e.predicted_t_region_us < e.predicted_default_t_region_us),
        key=lambda kv: kv[1].predicted_t_region_us - kv[1].predicted_default_t_region_us,
    )
    no_saving = len(changed) - len(saving)
    if saving:
        print(f"  largest predicted savings ({plan.method}; region time per iteration, model):")
    for sid, e in saving[:n]:
        saved = e.predicted_default_t_region_us - e.predicted_t_region_us
        print(
            f"    {sid:40s} {str(e.config.to_dict()):58s} {e.predicted_default_t_region_us / 1e3:8.2f} -> "
            f"{e.predicted_t_region_us / 1e3:8.2f} ms ({saved / 1e3:+.2f})"
        )
    if no_saving:
        print(
            f"  {no_saving} other site{'s' if no_saving != 1 else ''} changed with no predicted saving of "
            f"{'their' if no_saving != 1 else 'its'} own (model)"
        )
