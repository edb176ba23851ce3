"""Real-NCCL check on one GPU: pool options, per-communicator NCCL_ALGO, and the tuner plugin.

Run by check.sh with NCCL_TUNER_PLUGIN, LAGOM_TUNER_CONFIG, NCCL_DEBUG=INFO and NCCL_DEBUG_FILE
already in the environment (NCCL reads them at the first communicator creation). It

1. creates a 1-rank NCCL default group (FileStore, no network port) and all-reduces on it;
2. creates pool entries with ``create_nccl_pool_entry``: one through the tuner plugin (tag
   ``pool_plugin``, n_channels=4, cga_cluster_size=2 and cta_policy where this torch binds it),
   one with a per-communicator NCCL_ALGO/NCCL_PROTO and no plugin (tag ``pool_env``);
3. all-reduces on each entry and checks the results;
4. reads NCCL's debug log back: the plugin's ``LAGOM/tuner:`` lines (one init per communicator,
   with its tag) and NCCL's "NCCL_ALGO set by environment" line for the env entry.

Note: NCCL runs a 1-rank collective as a local copy without asking the tuner, so on one GPU the
plugin shows up through its per-communicator init lines, not per-call decisions.

Usage: python nccl_check.py OUT_DIR [--rehearse]. Writes OUT_DIR/nccl.json.
"""

from __future__ import annotations

import glob
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from single_rank import finish, init_single_rank, no_gpu, parse_out_dir, rehearse_inputs, world_all_reduce_ok  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    opts = parse_out_dir(argv, __doc__, ("nccl.json", "filestore"))
    out = opts.out_dir
    result: dict = {"status": "failed", "checks": {}}
    if opts.rehearse:
        ok = all(rehearse_inputs(result).values())
        return _finish(out, result, 0 if ok else 1)
    checks = result["checks"]
    try:
        import torch
        import torch.distributed as dist

        from lagom_megatron.engine.knobs import CommConfig
        from lagom_megatron.nccl.options import nccl_config_fields, runtime_nccl_version
        from lagom_megatron.nccl.pool import create_nccl_pool_entry

        if no_gpu(result):
            return _finish(out, result, 0)
        result["nccl_runtime"] = ".".join(map(str, runtime_nccl_version() or ()))
        fields = sorted(nccl_config_fields())
        result["nccl_config_fields"] = fields
        os.environ["LAGOM_TUNER_COMM_TAG"] = "world"
        dev = init_single_rank(out, "filestore")
        checks["world_all_reduce"] = world_all_reduce_ok(dev, 1 << 18)
        os.environ.pop("LAGOM_TUNER_COMM_TAG", None)

        plugin_cfg = {"n_channels": 4, "cga_cluster_size": 2}
        if "cta_policy" in fields:
            plugin_cfg["cta_policy"] = "EFFICIENCY"
        g1 = create_nccl_pool_entry(
            [0], CommConfig(**plugin_cfg), tag="pool_plugin", use_tuner_plugin=True, op="all_reduce"
        )
        t1 = torch.full((1 << 20,), 3.0, device=dev)
        dist.all_reduce(t1, group=g1)
        torch.cuda.synchronize()
        checks["pool_plugin_all_reduce"] = bool(torch.all(t1 == 3.0).item())
        result["pool_plugin_config"] = plugin_cfg

        # The env entry sets NCCL_ALGO/NCCL_PROTO, which the plugin mode refuses in the process
        # environment; here they are only set around this entry's creation.
        g2 = create_nccl_pool_entry(
            [0],
            CommConfig(algorithm="Ring", protocol="Simple", n_channels=2),
            tag="pool_env",
            use_tuner_plugin=False,
            op="all_reduce",
        )
        t2 = torch.full((1 << 20,), 5.0, device=dev)
        dist.all_reduce(t2, group=g2)
        torch.cuda.synchronize()
        checks["pool_env_all_reduce"] = bool(torch.all(t2 == 5.0).item())
        checks["env_restored"] = "NCCL_ALGO" not in os.environ and "LAGOM_TUNER_COMM_TAG" not in os.environ
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a check script reports, it does not crash
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()

    log_text = ""
    for path in sorted(glob.glob(str(out / "nccl_debug*.log"))):
        log_text += Path(path).read_text(errors="replace")
    lagom_lines = [line.strip() for line in log_text.splitlines() if "LAGOM/tuner:" in line]
    result["lagom_tuner_log"] = lagom_lines[:50]
    checks["plugin_loaded"] = any("ABI v" in line for line in lagom_lines)
    checks["plugin_saw_tag_pool_plugin"] = any("tag 'pool_plugin'" in line for line in lagom_lines)
    checks["plugin_read_table"] = any("rows of" in line for line in lagom_lines)
    checks["nccl_algo_per_comm"] = any(
        "NCCL_ALGO set by environment to allreduce:Ring" in line for line in log_text.splitlines()
    )
    result["nccl_tuner_lines"] = [
        line.strip() for line in log_text.splitlines() if "tuner" in line.lower() and "LAGOM" not in line
    ][:20]
    ok = "error" not in result and all(checks.values())
    result["status"] = "ok" if ok else "failed"
    return _finish(out, result, 0 if ok else 1)


def _finish(out: Path, result: dict, code: int) -> int:
    return finish(out / "nccl.json", result, code)


if __name__ == "__main__":
    sys.exit(main())
