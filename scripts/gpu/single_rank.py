"""What the one-GPU check scripts (``nccl_check.py``, ``plugin_probe.py``) share: a 1-rank NCCL
default group on GPU 0 without a network port, its first all-reduce, and the JSON result file.

``init_single_rank`` follows torch 2.13's ``init_process_group``: a ``FileStore`` with world size 1
stands in for the TCP rendezvous, and ``device_id`` (where this torch's signature has it) binds the
group to GPU 0 and creates NCCL's communicator eagerly, so the variables NCCL reads at the first
communicator creation (NCCL_TUNER_PLUGIN, NCCL_DEBUG_FILE, ...) take effect there.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any


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
    kwargs: dict[str, Any] = {"backend": "nccl", "store": dist.FileStore(str(out / store_name), 1), "rank": 0,
                              "world_size": 1}
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
    """Writes ``result`` as JSON to ``path``, prints it without its traceback, returns ``code``."""
    path.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, indent=2, default=str))
    return code
