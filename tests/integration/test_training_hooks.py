"""The CPU shims install and remove cleanly, and pretrain() drives callbacks in the documented order."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lagom_megatron.integration import cpu_shims

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_shims_apply_remove_idempotent():
    import megatron.core.utils as mc_utils
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.transformer import torch_norm

    before = (torch.cuda.current_device, vars(torch.Tensor).get("cuda"), mc_utils.torch,
              p2p_communication._batched_p2p_ops, vars(torch_norm.WrappedTorchNorm)["__new__"])
    assert cpu_shims.apply() and cpu_shims.apply()  # second call is a no-op
    try:
        assert torch.cuda.current_device() == "cpu"
        assert mc_utils.torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.zeros(1).type() == "torch.FloatTensor"  # only Megatron's optimizer modules see CUDA names
        assert p2p_communication._batched_p2p_ops is not before[3]
    finally:
        cpu_shims.remove()
    after = (torch.cuda.current_device, vars(torch.Tensor).get("cuda"), mc_utils.torch,
             p2p_communication._batched_p2p_ops, vars(torch_norm.WrappedTorchNorm)["__new__"])
    assert all(a is b for a, b in zip(before, after)) and not cpu_shims.is_applied()


def test_cpu_shims_leave_gpu_runs_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_shims.apply() is False and not cpu_shims.is_applied()


DRIVER = r'''
import json, os, sys
from lagom_megatron.integration.arguments import parse_args, validate_args
from lagom_megatron.integration.training import pretrain

class Recorder:
    def __init__(self): self.events = []
    def on_setup(self, ctx):
        self.events.append(["setup", len(ctx.model), type(ctx.model[0]).__name__, type(ctx.optimizer).__name__,
                            ctx.ddp_config.overlap_grad_reduce, callable(ctx.forward_backward_func)])
    def on_iteration_start(self, it): self.events.append(["start", it])
    def on_iteration_end(self, it, elapsed_s, loss): self.events.append(["end", it, elapsed_s > 0, loss])
    def on_train_end(self): self.events.append(["train_end"])

rec = Recorder()
args = validate_args(parse_args(sys.argv[2:]), int(os.environ["WORLD_SIZE"]))
result = pretrain(args, callbacks=[rec])
if int(os.environ["RANK"]) == 0:
    json.dump({"events": rec.events, "losses": result.losses, "times": result.iteration_times_s,
               "lrs": result.learning_rates}, open(sys.argv[1], "w"))
'''


@pytest.mark.distributed
def test_callbacks_and_result(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / "events.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(driver), str(out),
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
           "--lr-warmup-iters", "2", "--mock-data", "--tokenizer-type", "ByteLevel", "--overlap-grad-reduce",
           "--log-interval", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # --log-interval 2: lines for iterations 2 and 3 (the last one always), not 1.
    assert [" iteration        2/       3 |" in proc.stdout, " iteration        1/       3 |" in proc.stdout] == [True, False]
    data = json.loads(out.read_text())
    events = data["events"]
    assert events[0] == ["setup", 1, "DistributedDataParallel", "ChainedOptimizer", True, True]
    assert [e[0] for e in events[1:]] == ["start", "end"] * 3 + ["train_end"]
    assert [e[1] for e in events[1:-1]] == [1, 1, 2, 2, 3, 3]
    assert [e[3] for e in events[2:-1:2]] == data["losses"] and len(data["times"]) == 3
    # Linear warm-up over 2 iterations of 4 samples from 0 to 1e-3, then linear decay to --min-lr 0
    # at iteration 3 (the learning rate after each step, as logged).
    assert data["lrs"] == pytest.approx([5e-4, 1e-3, 0.0])
