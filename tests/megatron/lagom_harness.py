"""Runs several ``pretrain`` runs in one torchrun launch (saves the start-up of 4 processes per run).

    torchrun --standalone --nproc-per-node 4 tests/megatron/lagom_harness.py SPEC.json OUT.json

SPEC: ``{"runs": [{"name": str, "argv": [pretrain_gpt.py flags], "env": {VAR: value}}]}``.
Rank 0 writes OUT: per run the losses, whether lagom's hooks were installed during training, and
whether every patched name was restored afterwards. Rank 0 prints ``HARNESS RUN <name>`` before
each run so that a test can split the log.
"""

import json
import os
import sys


def _originals():
    import torch.distributed as dist
    from megatron.core import utils as mc_utils
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as mfsdp
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers, mappings

    return {
        "mfsdp.all_gather_params": mfsdp.AllGatherPipeline.all_gather_params,
        "mfsdp.async_bucket_gather": mfsdp.AllGatherPipeline.async_bucket_gather,
        "mfsdp._bucket_group_gradient_reduce": mfsdp.GradReducePipeline._bucket_group_gradient_reduce,
        "mfsdp._coalescing_manager": mfsdp._coalescing_manager,
        "dist.all_reduce": dist.all_reduce,
        "dist.all_to_all_single": dist.all_to_all_single,
        "dist.all_gather_into_tensor": dist.all_gather_into_tensor,
        "dist.reduce_scatter_tensor": dist.reduce_scatter_tensor,
        "utils.dist_all_gather_func": mc_utils.dist_all_gather_func,
        "schedules.drain_embedding_wgrad_compute": schedules.drain_embedding_wgrad_compute,
        "_AllToAll.forward": mappings._AllToAll.forward,
        "_AllToAll.backward": mappings._AllToAll.backward,
        "pgb.dist_reduce_scatter_func": pgb.dist_reduce_scatter_func,
        "pgb.dist_all_gather_func": pgb.dist_all_gather_func,
        "layers.dist_reduce_scatter_func": layers.dist_reduce_scatter_func,
        "layers.dist_all_gather_func": layers.dist_all_gather_func,
        "BucketGroup.start_grad_sync": pgb._ParamAndGradBucketGroup.start_grad_sync,
        "BucketGroup.start_param_sync": pgb._ParamAndGradBucketGroup.start_param_sync,
        "pgb._coalescing_manager": pgb._coalescing_manager,
        "P2PCommunicator._communicate": p2p.P2PCommunicator._communicate,
    }


class _Probe:
    """Callback recording how many entry points were patched while training ran."""

    def __init__(self):
        self.patched = 0

    def on_iteration_start(self, iteration):
        from lagom_megatron.megatron.hooks import patches

        h = patches.installed()
        self.patched = max(self.patched, len(h.patched) if h is not None else 0)


def _fresh_rendezvous(i, rank):
    """Points the next init_process_group at a new TCPStore: re-initialising on torchrun's agent
    store reuses its keys and hangs. Rank 0 picks a free port and publishes it there."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    # a generous wait for rank 0's key, scaled as every test limit (tests/timeouts.py)
    wait_s = 600 * float(os.environ.get("LAGOM_TEST_TIMEOUT_SCALE", "1"))
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=wait_s)
    )
    key = f"lagom_harness_port_{i}"
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        agent.set(key, str(port))
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def main(spec_path, out_path):
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    from lagom_megatron.megatron.hooks import patches
    from lagom_megatron.training.argument_checks import validate_args
    from lagom_megatron.training.arguments import parse_args
    from lagom_megatron.training.loop import pretrain

    rank = int(os.environ["RANK"])
    spec = json.load(open(spec_path))
    results = {}
    for i, run in enumerate(spec["runs"]):
        if i > 0:
            _fresh_rendezvous(i, rank)
        if rank == 0:
            print(f"HARNESS RUN {run['name']}", flush=True)
        saved = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        before = _originals()
        probe = _Probe()
        try:
            args = validate_args(parse_args(run["argv"]), int(os.environ["WORLD_SIZE"]))
            result = pretrain(args, callbacks=[probe])
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            destroy_num_microbatches_calculator()
        after = _originals()
        results[run["name"]] = {
            "losses": result.losses,
            "patched_during": probe.patched,
            "restored": sorted(k for k in before if before[k] is after[k]),
            "not_restored": sorted(k for k in before if before[k] is not after[k]),
            "installed_after": patches.installed() is not None,
        }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
