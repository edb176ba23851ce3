"""Overhead of lagom's warm-up profiler and of per-call routing, side by side in one CPU demo run.

    python scripts/bench_profiler.py [--preset cpu-tp2-dp2] [--cycles 6]
    (relaunches itself under torchrun --standalone --nproc-per-node <preset world size>)

One training run, iterations cycling through five modes (same model, same data stream):

    off       no lagom hooks installed (the baseline)
    profiled  hooks installed, every collective timed, defaults (a warm-up profiling iteration)
    profiled+ the same with timing shims around lagom's wrappers (direct hook time)
    routed+   hooks installed, every site routed to a communicator-pool entry (n_channels 3, a gloo
              group of 3 worker threads over the same ranks), profiler off and no site records
              kept, as the controller runs an applied plan (a router of its own whose assignment is
              set once, so its routes stay resolved as an applied plan's do); with timing shims
    off+      no lagom hooks, timing shims only: the shims' own cost per call (subtracted)

Timing shims: each patched entry point is wrapped twice, outside lagom's wrapper (O) and around
the original it calls (T); O - T is the time lagom adds to that call plus the shims' own cost,
which the off+ iterations measure (O directly around T) and the report subtracts in two ways:
the median over all calls, and call by call (call i of a routed+ iteration less the median of
call i of the off+ iterations: the same Megatron call, same order, without lagom). The second
compares each routed call with itself, whatever its cache state (a call issued after backward
compute runs on cold caches, the hot forward calls dominate the all-call median). The patched
wrapper and router are also timed in isolation, as after apply (a loop of calls with a no-op
collective, warm caches).

Printed figures:
  * profiler overhead: (hook time + end-of-iteration timing and all-gather) / off iteration time,
    and the plain difference of median iteration times profiled vs. off with its noise (goal < 5%);
  * routing overhead per collective call after apply, all figures in microseconds (goal < 20 us):
    in the run (all routed calls, then call by call) and by patched entry point, and in the
    isolated loop, side by side.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import subprocess
import sys
import time

MODES = ("off", "profiled", "profiled+", "routed+", "off+")


class Shims:
    """O/T timing shims around every name lagom patches (see module docstring).

    Each outer call opens a frame; the inner shim of the same call (lagom's call of the original)
    adds its duration to the innermost open frame, so nested calls (a bucket group's collectives
    inside ``start_grad_sync``) are charged to their own frame. A frame's O - T is lagom's time.
    """

    def __init__(self, router):
        self.router = router
        self.per_call_us = []
        """lagom's added time per intercepted call (us)."""
        self.per_routed_call_us = []
        """The same for the calls that were routed to a pool entry (a site of the plan)."""
        self.routed_flags = []
        """Per intercepted call, in completion order: whether it was routed."""
        self.routed_by_entry: dict[str, list[float]] = {}
        """The same per patched entry point (``owner.name``)."""
        self._stack = []
        self._undo = []

    def _outer(self, fn, entry):
        @functools.wraps(fn)
        def shim(*args, **kwargs):
            frame = [0.0, self.router.calls_routed]
            self._stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self._stack.pop()
                added = (dt - frame[0]) * 1e6
                routed = self.router.calls_routed != frame[1]
                self.per_call_us.append(added)
                self.routed_flags.append(routed)
                if routed:
                    self.per_routed_call_us.append(added)
                    self.routed_by_entry.setdefault(entry, []).append(added)

        return shim

    def _inner(self, fn):
        @functools.wraps(fn)
        def shim(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._stack:
                    self._stack[-1][0] += time.perf_counter() - t0

        return shim

    def _targets(self):
        import torch.distributed as dist
        from megatron.core.distributed import param_and_grad_buffer as pgb
        from megatron.core.pipeline_parallel import p2p_communication as p2p
        from megatron.core.tensor_parallel import layers

        return [
            (dist, "all_reduce"),
            (dist, "all_to_all_single"),
            (pgb, "dist_reduce_scatter_func"),
            (pgb, "dist_all_gather_func"),
            (layers, "dist_reduce_scatter_func"),
            (layers, "dist_all_gather_func"),
            (pgb._ParamAndGradBucketGroup, "start_grad_sync"),
            (pgb._ParamAndGradBucketGroup, "start_param_sync"),
            (p2p.P2PCommunicator, "_communicate"),
        ]

    def install_inner(self):
        """Wraps the originals (before lagom's patches capture them)."""
        for owner, name in self._targets():
            orig = getattr(owner, name)
            self._undo.append((owner, name, orig))
            setattr(owner, name, self._inner(orig))

    def install_outer(self):
        """Wraps lagom's wrappers (after patches.install)."""
        for owner, name in self._targets():
            cur = getattr(owner, name)
            self._undo.append((owner, name, cur))
            setattr(owner, name, self._outer(cur, f"{getattr(owner, '__name__', owner)}.{name}"))

    def remove(self):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()

    def added_s(self):
        return sum(self.per_call_us) / 1e6


class Bench:
    """Training callback that cycles the modes and collects the figures."""

    def __init__(self, cycles):
        self.cycles = cycles
        self.times = {m: [] for m in MODES}
        self.hook_s = []
        self.end_s = []
        self.route_calls = []
        self.route_all = []
        self.route_routed = []
        self.route_by_entry: dict[str, list[float]] = {}
        self.shim_floor = []
        self.shim_floor_iters = []
        self.route_iters = []
        self.profiled_calls = []

    def on_setup(self, ctx):
        from lagom_megatron.megatron.hooks.profiler import Profiler
        from lagom_megatron.megatron.hooks.router import SiteRouter
        from lagom_megatron.megatron.hooks.sites import GroupNames, SiteRegistry
        from lagom_megatron.megatron.pool.comm_pool import CommPool, make_pool_backend

        groups = GroupNames.from_parallel_state()
        self.registry = SiteRegistry(groups, num_microbatches=ctx.args.num_microbatches)
        self.registry.bind_model(ctx.model)
        self.profiler = Profiler()
        self.pool = CommPool(make_pool_backend("gloo"), groups)
        self.router = SiteRouter(self.registry, self.profiler, self.pool)
        self.routed_router = SiteRouter(self.registry, self.profiler, self.pool)
        """The router of the routed+ iterations: its assignment is set once, after discovery, as the
        controller sets an applied plan's once, so its routes stay resolved between iterations."""
        self.configs = [c.config for c in ctx.model[:1]]
        self.handle = None
        self.shims = None

    def _mode(self, iteration):
        if iteration <= 2:
            return "discover"  # iteration 1: allocator warm-up, 2: sites and pool entries
        return MODES[(iteration - 3) % len(MODES)]

    def on_iteration_start(self, iteration):
        from lagom_megatron.megatron.hooks import patches

        mode = self.mode = self._mode(iteration)
        self.registry.start_iteration(record=mode != "routed+")  # an applied plan records no sites (controller)
        if mode == "off":
            return
        router = self.routed_router if mode == "routed+" else self.router
        if mode.endswith("+"):
            self.shims = Shims(router)
            self.shims.install_inner()
        if mode == "off+":
            self.shims.install_outer()
            return
        self.handle = patches.install(router, model_configs=self.configs)
        if self.shims is not None:
            self.shims.install_outer()
        self.profiler.start_iteration(timed=mode.startswith("profiled"))

    def on_iteration_end(self, iteration, elapsed_s, loss):
        from lagom_megatron.engine.knobs import CommConfig
        from lagom_megatron.megatron import consensus

        mode = self.mode
        if self.shims is not None:
            self.shims.remove()
        if mode not in ("off", "off+"):
            self.handle.remove()
        t0 = time.perf_counter()
        self.registry.finish_iteration()
        timings = self.profiler.finish_iteration()
        if mode.startswith("profiled") or mode == "discover":
            sites = {
                r.site_id: {"group": r.group.name, "nbytes": r.nbytes, "calls_per_iter": r.calls}
                for r in self.registry.records.values()
            }
            merged_sites, _, _, _ = consensus.merge_measurements(sites, timings, elapsed_s * 1e6)
        end_s = time.perf_counter() - t0
        it_s = consensus.merge_measurements({}, {}, elapsed_s * 1e6)[2] / 1e6  # slowest rank
        if mode == "discover":
            self.sites = sorted(merged_sites)
            needs = {}
            for v in merged_sites.values():
                needs.setdefault(v["group"], set()).add(CommConfig(n_channels=3))
            self.pool.prepare(needs)
            self.routed_router.set_assignment({sid: CommConfig(n_channels=3) for sid in self.sites})
        else:
            self.times[mode].append(it_s)
        if mode == "profiled+":
            self.profiled_calls.extend(self.shims.per_call_us)
            self.hook_s.append(self.shims.added_s())
            self.end_s.append(end_s)
        if mode == "off+":
            self.shim_floor.extend(self.shims.per_call_us)
            self.shim_floor_iters.append(list(self.shims.per_call_us))
        if mode == "routed+":
            self.route_calls.append(len(self.shims.per_call_us))
            self.route_all.extend(self.shims.per_call_us)
            self.route_routed.extend(self.shims.per_routed_call_us)
            for entry, values in self.shims.routed_by_entry.items():
                self.route_by_entry.setdefault(entry, []).extend(values)
            self.route_iters.append((list(self.shims.per_call_us), list(self.shims.routed_flags)))
        self.shims = None

    def matched_routed_us(self):
        """lagom's time per routed call (us), each call less the shims' cost of the same call.

        Calls of one iteration come in the same order in every mode, so call ``i`` of a routed+
        iteration is call ``i`` of an off+ iteration without lagom; the shims' cost of that call is
        the median over the off+ iterations. None if the call counts differ between iterations.
        """
        counts = {len(f) for f in self.shim_floor_iters} | {len(c) for c, _ in self.route_iters}
        if len(counts) != 1:
            return None
        floor = [statistics.median(col) for col in zip(*self.shim_floor_iters)]
        return [c - floor[i] for calls, flags in self.route_iters for i, (c, r) in enumerate(zip(calls, flags)) if r]

    def _matched_line(self):
        matched = self.matched_routed_us()
        if not matched:
            return "routing overhead after apply (same-call shim cost subtracted): n/a (call sequences differ)"
        q = [round(x, 1) for x in statistics.quantiles(matched, n=4)]
        return (
            f"routing overhead after apply (in the run, each call's own shim cost in the off+ iterations "
            f"subtracted): median {statistics.median(matched):.1f} us per routed call, quartiles {q} (goal < 20 us)"
        )

    def report(self):
        off = statistics.median(self.times["off"])
        prof = statistics.median(self.times["profiled"])
        spread = max((max(v) - min(v)) / 2 for v in (self.times["off"], self.times["profiled"]))
        direct = statistics.median(h + e for h, e in zip(self.hook_s, self.end_s))
        floor = statistics.median(self.shim_floor)
        isolated_us = isolated_routing_us()
        lines = [
            f"bench_profiler: {len(self.sites)} sites | {len(self.times['off'])} iterations per mode | "
            f"median iteration off {off * 1e3:.1f} ms, profiled {prof * 1e3:.1f} ms (noise +-{spread * 1e3:.1f} ms)",
            f"profiler overhead (direct: hooks {statistics.median(self.hook_s) * 1e3:.2f} ms + end of iteration "
            f"{statistics.median(self.end_s) * 1e3:.2f} ms): {100 * direct / off:.2f}% of the iteration (goal < 5%)",
            f"profiler hooks in the run: median {statistics.median(self.profiled_calls) - floor:.1f} us per intercepted call "
            f"(shims' own cost subtracted)",
            f"profiler overhead (iteration time profiled - off): {100 * (prof - off) / off:+.1f}% "
            f"(noise +-{100 * spread / off:.1f}%)",
            f"routing overhead after apply (in the run, shims' own {floor:.1f} us subtracted): median "
            f"{statistics.median(self.route_routed) - floor:.1f} us per routed call ({len(self.route_routed)} calls), "
            f"{statistics.median(self.route_all) - floor:.1f} us over all {statistics.median(self.route_calls):.0f} "
            f"intercepted calls/iteration (goal < 20 us)",
            f"routed-call overhead quartiles (us, shims included): {[round(q, 1) for q in statistics.quantiles(self.route_routed, n=4)]}, min {min(self.route_routed):.1f}",
            self._matched_line(),
            "routed calls by entry point (median us, shims' own cost subtracted; calls): "
            + ", ".join(
                f"{e} {statistics.median(v) - floor:.1f} ({len(v)})" for e, v in sorted(self.route_by_entry.items())
            ),
            f"routing overhead after apply (isolated loop, warm caches): {isolated_us:.1f} us per routed call",
        ]
        return "\n".join(lines)


def isolated_routing_us(n_calls: int = 20000, repeats: int = 5) -> float:
    """Microseconds lagom adds to a routed TP all-gather call (patched wrapper and router), in a tight loop.

    The fastest of ``repeats`` means over ``n_calls / repeats`` calls each, less the same for the
    bare no-op collective.
    """
    import torch

    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.megatron.hooks.patches import _collective_wrapper
    from lagom_megatron.megatron.hooks.profiler import Profiler
    from lagom_megatron.megatron.hooks.router import SiteRouter
    from lagom_megatron.megatron.hooks.sites import GroupInfo, GroupNames, SiteRegistry

    class _Pool:
        def group_for(self, info, cfg):
            return "pool-entry"

    group = object()
    names = GroupNames(local_world_size=2)
    names.alias(group, GroupInfo(name="tp", ranks=(0, 1)))
    registry = SiteRegistry(names, num_microbatches=2)
    router = SiteRouter(registry, Profiler(), _Pool())
    t = torch.zeros(1024)

    def collective(out, inp, group=None, async_op=False):
        return None

    wrapped = _collective_wrapper(router, "all_gather", collective)  # what patches.install puts in place

    def iteration(record=False):
        registry.start_iteration(record=record)
        for _ in range(18):
            wrapped(t, t, group=group, async_op=True)
        registry.finish_iteration()

    iteration(record=True)
    router.set_assignment({f"tp.sp_all_gather[{i}]": CommConfig(n_channels=3) for i in range(9)})
    reps = n_calls // (18 * repeats)
    routed = bare = math.inf
    for _ in range(repeats):  # the fastest of several means: a preemption on shared cores lands in one
        t0 = time.perf_counter()
        for _ in range(reps):
            iteration()
        routed = min(routed, (time.perf_counter() - t0) / (reps * 18))
        t0 = time.perf_counter()
        for _ in range(reps * 18):
            collective(t, t, group=group, async_op=True)
        bare = min(bare, (time.perf_counter() - t0) / (reps * 18))
    return (routed - bare) * 1e6


def _worker(ns):
    from lagom_megatron.training.argument_checks import validate_args
    from lagom_megatron.training.arguments import parse_args
    from lagom_megatron.training.loop import pretrain

    iters = 2 + ns.cycles * len(MODES)
    argv = ["--preset", ns.preset, "--mock-data", "--train-iters", str(iters), "--log-interval", str(iters)]
    args = validate_args(parse_args(argv), int(os.environ["WORLD_SIZE"]))
    bench = Bench(ns.cycles)
    pretrain(args, callbacks=[bench])
    if int(os.environ["RANK"]) == 0:
        print(bench.report(), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu-tp2-dp2")
    p.add_argument("--cycles", type=int, default=6, help="iterations per mode")
    ns = p.parse_args(argv)
    if "RANK" in os.environ:
        _worker(ns)
        return 0
    from lagom_megatron.config.presets import load_preset

    world = load_preset(ns.preset).world_size
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        os.path.abspath(__file__),
        "--preset",
        ns.preset,
        "--cycles",
        str(ns.cycles),
    ]
    return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    sys.exit(main())
