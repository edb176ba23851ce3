"""One-GPU probe of what lagom applies through NCCL, read in-process (run by check.sh).

check.sh starts it with ``NCCL_TUNER_PLUGIN`` (absolute path of the built plugin) and
``LAGOM_TUNER_CONFIG`` (a small plan table) in the environment, which NCCL reads when the first
communicator is created, and without ``TORCH_NCCL_ENABLE_TIMING``. It

1. creates a 1-rank NCCL default group (FileStore, no network port) and all-reduces on it;
2. reads lagom's plugin status in-process (``nccl.plugin_status.read_plugin_status``: the library
   as NCCL mapped it, its ABI version, init count, table loaded, per-row hits) and the
   controller's hit line (``summarize_hits``). NCCL runs a 1-rank collective as a local copy
   without asking the tuner, so row hits stay 0 on one GPU; the status proves the load;
3. prints the capabilities probe (``nccl.capabilities.gather_local``) when this checkout has it;
4. creates a group with a real ``ProcessGroupNCCL.Options`` (high-priority stream, min/max CTAs)
   and checks that its all-reduce runs and is right;
5. turns collective timing on as lagom does (:func:`timing_as_lagom`): an all-reduce before has no
   duration, ``enable_comm_timing`` on the existing default group, then a 64 MiB all-reduce's
   ``Work._get_duration()`` through ``work_duration_us`` (``lagom_megatron.megatron.hooks.profiler``);
6. with ``NCCL_PROFILER_PLUGIN`` naming the same library (check.sh sets it), reads the profiler
   half's state and records in-process (``nccl.plugin_status``): NCCL initialised it for the
   communicators; a 1-rank collective reaches no task event (a local copy), so the records list the
   communicators without calls on one GPU.

Usage: python plugin_probe.py OUT_DIR [--rehearse]. Writes OUT_DIR/plugin_probe.json; exit 0 when every check
passed (or the machine has no GPU: status "skipped"), 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from single_rank import finish, init_single_rank, no_gpu, parse_out_dir, rehearse_inputs, world_all_reduce_ok  # noqa: E402


def status_checks(status) -> dict[str, bool]:
    """Checks on a ``PluginStatus`` (or None) after NCCL created at least one communicator.

    Returns:
        plugin_loaded (mapped in this process), plugin_abi (3-6), plugin_initialised (init count
        >= 1), table_loaded (the plan table was read), table_ok (no unreadable table).
    """
    return {
        "plugin_loaded": status is not None,
        "plugin_abi": status is not None and 3 <= status.abi_version <= 6,
        "plugin_initialised": status is not None and status.init_count >= 1,
        "table_loaded": status is not None and status.table_loaded,
        "table_ok": status is not None and status.table_failures == 0,
    }


def timing_as_lagom(group, issue) -> tuple[dict, dict[str, bool]]:
    """Collective timing the way lagom's profiler turns it on and reads it (``enable_comm_timing``, then
    ``work_duration_us`` on each Work): ``issue()`` runs one collective on ``group`` and returns its finished Work.

    torch's ``ProcessGroupNCCL::enableCollectivesTiming`` sets the flag each ``WorkNCCL`` reads when it is created,
    and ``WorkNCCL::getDuration`` refuses a Work created without it (``ProcessGroupNCCL.cpp``); so a Work issued
    before the call has no duration, one issued after has its CUDA events' time.

    Returns:
        (the times in microseconds, checks): timing_off_before_enable, timing_enabled_on_group, work_get_duration.
    """
    import math

    from lagom_megatron.megatron.hooks.profiler import enable_comm_timing, work_duration_us

    before = work_duration_us(issue())
    accepted = enable_comm_timing([group])
    after = work_duration_us(issue())
    times = {"before_enable_us": before, "groups_accepted": accepted, "after_enable_us": after}
    checks = {
        "timing_off_before_enable": before is None,
        "timing_enabled_on_group": accepted == 1,
        "work_get_duration": after is not None and math.isfinite(after) and after > 0.0,
    }
    return times, checks


class StandInWork:
    """A finished ``WorkNCCL`` as far as timing goes: ``_get_duration`` (ms) raises unless timing was on at creation."""

    def __init__(self, timed: bool) -> None:
        self._timed = timed

    def _get_duration(self) -> float:
        if not self._timed:
            raise RuntimeError("getDuration only works if timing was enabled")
        return 0.25


class StandInGroup:
    """A ``ProcessGroup`` as far as timing goes: ``_enable_collectives_timing`` turns it on for later Works."""

    def __init__(self) -> None:
        self.timing = False

    def _enable_collectives_timing(self) -> None:
        self.timing = True

    def all_reduce(self) -> StandInWork:
        return StandInWork(self.timing)


def main(argv: list[str] | None = None) -> int:
    opts = parse_out_dir(argv, __doc__, ("plugin_probe.json", "probe_filestore"))
    out = opts.out_dir
    result: dict = {"status": "failed", "checks": {}}
    if opts.rehearse:  # the library is loaded by rehearse_inputs, as NCCL would: the status reader then finds it
        checks = rehearse_inputs(result)
        from lagom_megatron.nccl.plugin_status import read_plugin_status

        status = read_plugin_status()
        result["plugin_status"] = dataclasses.asdict(status) if status is not None else None
        # mapped but never initialised (NCCL did not run): the reader finds it, with no init yet
        checks["status_readable"] = status is not None and status.init_count == 0
        from lagom_megatron.nccl.plugin_status import profiler_state, read_observed

        checks["profiler_readable"] = profiler_state() == ("not initialised", "") and read_observed() == []
        group = StandInGroup()
        result["timing"], timing_checks = timing_as_lagom(group, group.all_reduce)
        checks.update(timing_checks)
        checks["timing_env_unset"] = "TORCH_NCCL_ENABLE_TIMING" not in os.environ
        return _finish(out, result, 0 if all(checks.values()) else 1)
    checks = result["checks"]
    try:
        import torch
        import torch.distributed as dist

        from lagom_megatron.nccl.plugin_status import read_plugin_status, summarize_hits

        if no_gpu(result):
            return _finish(out, result, 0)
        result["nccl_runtime"] = ".".join(map(str, torch.cuda.nccl.version()))
        result["env"] = {
            k: os.environ.get(k)
            for k in ("NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "LAGOM_TUNER_CONFIG", "TORCH_NCCL_ENABLE_TIMING")
        }
        dev = init_single_rank(out, "probe_filestore")
        checks["world_all_reduce"] = world_all_reduce_ok(dev, 1 << 20)

        status = read_plugin_status()
        result["plugin_status"] = dataclasses.asdict(status) if status is not None else None
        checks.update(status_checks(status))
        table = os.environ.get("LAGOM_TUNER_CONFIG")
        if table and Path(table).is_file():
            from lagom_megatron.nccl.export import TunerRow

            rows = [
                TunerRow(cells=tuple(line.split(",")), sites=(f"line{i}",))
                for i, line in enumerate(Path(table).read_text().splitlines(), 1)
                if line.strip() and not line.startswith("#")
            ]
            result["hit_summary"] = summarize_hits(status, rows)

        try:
            from lagom_megatron.nccl.capabilities import gather_local
        except ImportError as exc:
            result["capabilities"] = f"not in this checkout ({exc})"
        else:
            caps = gather_local()
            result["capabilities"] = dataclasses.asdict(caps) if dataclasses.is_dataclass(caps) else repr(caps)
            checks["capabilities_plugin_loaded"] = bool(getattr(caps, "plugin_loaded", False))

        opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        opts.config.min_ctas, opts.config.max_ctas = 1, 4
        group = dist.new_group([0], pg_options=opts)
        t2 = torch.full((1 << 20,), 2.0, device=dev)
        dist.all_reduce(t2, group=group)
        torch.cuda.synchronize()
        checks["options_group_all_reduce"] = bool(torch.all(t2 == 2.0).item())
        result["options"] = {"is_high_priority_stream": True, "min_ctas": 1, "max_ctas": 4}

        from lagom_megatron.nccl import plugin_status

        plugin_status.set_recording(True, reset=True)
        t3 = torch.ones(1 << 24, device=dev)

        def issue():
            work = dist.all_reduce(t3, async_op=True)
            work.wait()
            torch.cuda.synchronize()
            return work

        result["timing"], timing_checks = timing_as_lagom(dist.group.WORLD, issue)
        checks.update(timing_checks)
        after = result["timing"]["after_enable_us"]
        result["all_reduce_64MiB_duration_ms"] = after / 1000.0 if after is not None else None
        plugin_status.set_recording(False)
        state, foreign = plugin_status.profiler_state()
        records = plugin_status.read_observed() or []
        result["profiler"] = {"state": state, "foreign": foreign, "records": [dataclasses.asdict(c) for c in records]}
        if os.environ.get("NCCL_PROFILER_PLUGIN"):
            checks["profiler_initialised"] = state == "lagom" and len(records) >= 1
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a probe reports, it does not crash
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    ok = "error" not in result and all(checks.values())
    result["status"] = "ok" if ok else "failed"
    return _finish(out, result, 0 if ok else 1)


def _finish(out: Path, result: dict, code: int) -> int:
    return finish(out / "plugin_probe.json", result, code)


if __name__ == "__main__":
    sys.exit(main())
