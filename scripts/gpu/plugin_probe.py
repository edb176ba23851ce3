"""One-GPU probe of what lagom applies through NCCL, read in-process (run by check.sh).

check.sh starts it with ``NCCL_TUNER_PLUGIN`` (absolute path of the built plugin),
``LAGOM_TUNER_CONFIG`` (a small plan table) and ``TORCH_NCCL_ENABLE_TIMING=1`` in the environment,
which NCCL and ProcessGroupNCCL read when the first communicator is created. It

1. creates a 1-rank NCCL default group (FileStore, no network port) and all-reduces on it;
2. reads lagom's plugin status in-process (``nccl.plugin_status.read_plugin_status``: the library
   as NCCL mapped it, its ABI version, init count, table loaded, per-row hits) and the
   controller's hit line (``summarize_hits``). NCCL runs a 1-rank collective as a local copy
   without asking the tuner, so row hits stay 0 on one GPU; the status proves the load;
3. prints the capabilities probe (``nccl.capabilities.gather_local``) when this checkout has it;
4. creates a group with a real ``ProcessGroupNCCL.Options`` (high-priority stream, min/max CTAs)
   and checks that its all-reduce runs and is right;
5. times an all-reduce with ``Work._get_duration()`` (milliseconds between the collective's CUDA
   events on NCCL's stream; torch ``WorkNCCL::getDuration`` needs timing enabled and a completed work);
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


def timed_duration_ms(work) -> float:
    """``work._get_duration()`` after ``work.wait()`` and a device synchronize; milliseconds.

    Raises:
        RuntimeError: from torch when timing was not enabled (``TORCH_NCCL_ENABLE_TIMING``) or the
            work has no CUDA events.
        ValueError: a duration that is not a finite positive number.
    """
    import math

    work.wait()
    sync = getattr(work, "synchronize", None)
    if sync is not None:
        sync()
    ms = float(work._get_duration())
    if not math.isfinite(ms) or ms <= 0.0:
        raise ValueError(f"Work._get_duration() gave {ms!r} ms; expected a positive time")
    return ms


def main(argv: list[str] | None = None) -> int:
    opts = parse_out_dir(argv, __doc__)
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
        checks["timing_enabled"] = os.environ.get("TORCH_NCCL_ENABLE_TIMING") == "1"
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
        ms = timed_duration_ms(dist.all_reduce(t3, async_op=True))
        result["all_reduce_64MiB_duration_ms"] = ms
        checks["work_get_duration"] = ms > 0.0
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
