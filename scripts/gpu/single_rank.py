"""What the one-GPU check scripts (``nccl_check.py``, ``plugin_probe.py``) share: a 1-rank NCCL
default group on GPU 0 without a network port, its first all-reduce, and the JSON result file.

``init_single_rank`` follows torch 2.13's ``init_process_group``: a ``FileStore`` with world size 1
stands in for the TCP rendezvous, and ``device_id`` (where this torch's signature has it) binds the
group to GPU 0 and creates NCCL's communicator eagerly, so the variables NCCL reads at the first
communicator creation (NCCL_TUNER_PLUGIN, NCCL_DEBUG_FILE, ...) take effect there.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from pathlib import Path
from typing import Any

TABLE_COLUMNS = 12
"""Columns of a plan table row of lagom's plugin (``# collective_type,...,commTag`` in check.sh)."""


def parse_out_dir(argv: list[str] | None, doc: str, outputs: tuple[str, ...]) -> argparse.Namespace:
    """``OUT_DIR [--rehearse]`` of both check scripts (``--help`` prints the usage, exit 0). ``outputs``: the names
    the script writes in OUT_DIR; a folder holding one of them is refused (exit 2), whatever else it holds stays."""
    from lagom_megatron.preflight.files import output_folder_problem

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help=f"folder for {', '.join(outputs)} (names it must not hold yet)")
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="no GPU: check the inputs check.sh gives this step and write the result file, "
        "with the NCCL checks marked not run (check.sh --rehearse)",
    )
    args = parser.parse_args(argv)
    problem = output_folder_problem(
        args.out_dir,
        allowed=lambda p: p.name not in outputs,
        advice=f"give a folder without {', '.join(outputs)} (an existing file is never replaced)",
    )
    if problem:
        parser.error(f"OUT_DIR {problem}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return args


def rehearse_inputs(result: dict, *, table_var: str = "LAGOM_TUNER_CONFIG") -> dict[str, bool]:
    """What a rehearsal can check without a GPU: the plugin library of ``NCCL_TUNER_PLUGIN`` loads
    and exports a ``ncclTunerPlugin_v*`` struct (as NCCL's ``dlopen`` + ``dlsym`` would find it), and
    each row of the plan table ``table_var`` names has :data:`TABLE_COLUMNS` columns. Marks ``result``
    as ``rehearsed``."""
    import ctypes

    checks: dict[str, bool] = {}
    lib = os.environ.get("NCCL_TUNER_PLUGIN", "")
    try:
        handle = ctypes.CDLL(lib) if lib else None
    except OSError:
        handle = None
    checks["plugin_library_loads"] = handle is not None
    checks["plugin_exports_abi"] = handle is not None and any(
        hasattr(handle, f"ncclTunerPlugin_v{v}") for v in range(3, 7)
    )
    table = os.environ.get(table_var, "")
    rows = (
        [line for line in Path(table).read_text().splitlines() if line.strip() and not line.startswith("#")]
        if table and Path(table).is_file()
        else []
    )
    checks["table_rows_well_formed"] = bool(rows) and all(len(r.split(",")) == TABLE_COLUMNS for r in rows)
    result.update(status="rehearsed", reason="--rehearse: no GPU; the NCCL checks did not run", rehearsal_checks=checks)
    return checks


def no_gpu(result: dict) -> bool:
    """Records torch's version in ``result``; True, with ``result`` marked skipped (and why), where
    this machine has no CUDA device or this torch has no NCCL."""
    import torch
    import torch.distributed as dist

    result["torch"] = torch.__version__
    if torch.cuda.is_available() and dist.is_nccl_available():
        return False
    result.update(status="skipped", reason="no CUDA device or torch without NCCL")
    return True


def init_single_rank(out: Path, store_name: str) -> Any:
    """Sets GPU 0 and creates the 1-rank NCCL default group (store file ``out/store_name``).

    Returns:
        The ``torch.device`` of GPU 0.

    Raises:
        RuntimeError: from torch when CUDA or NCCL cannot create the group (the caller reports it).
    """
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    kwargs: dict[str, Any] = {
        "backend": "nccl",
        "store": dist.FileStore(str(out / store_name), 1),
        "rank": 0,
        "world_size": 1,
    }
    if "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = dev
    dist.init_process_group(**kwargs)
    return dev


def world_all_reduce_ok(dev: Any, numel: int) -> bool:
    """All-reduces ``numel`` float32 ones on the default group and checks they stay ones (1 rank)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(numel, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return bool(torch.all(t == 1).item())


def finish(path: Path, result: dict, code: int) -> int:
    """Writes ``result`` as JSON to ``path`` (atomically), prints it without its traceback, returns ``code``."""
    from lagom_megatron.engine.files import write_text_atomic

    write_text_atomic(path, json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, indent=2, default=str))
    return code


if __name__ == "__main__":  # a module of the two check scripts, not a step of its own
    import sys

    print(__doc__.strip() + "\n\nusage: imported by nccl_check.py and plugin_probe.py (python nccl_check.py --help)")
    sys.exit(0 if sys.argv[1:] in ([], ["-h"], ["--help"]) else 2)
