"""The CPU shims install only without CUDA, are idempotent, and remove() restores every original.
(The callbacks of pretrain() are checked on the baseline run of test_training.py.)"""

import importlib
import types

import pytest
import torch

from lagom_megatron.training import cpu_shims


def test_cpu_shims_apply_remove_idempotent():
    import megatron.core.utils as mc_utils
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.transformer import torch_norm

    before = (
        torch.cuda.current_device,
        vars(torch.Tensor).get("cuda"),
        mc_utils.torch,
        p2p_communication._batched_p2p_ops,
        vars(torch_norm.WrappedTorchNorm)["__new__"],
    )
    assert cpu_shims.apply() and cpu_shims.apply()  # second call is a no-op
    try:
        assert torch.cuda.current_device() == "cpu"
        assert mc_utils.torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.zeros(1).type() == "torch.FloatTensor"  # only Megatron's optimizer modules see CUDA names
        assert p2p_communication._batched_p2p_ops is not before[3]
    finally:
        cpu_shims.remove()
    after = (
        torch.cuda.current_device,
        vars(torch.Tensor).get("cuda"),
        mc_utils.torch,
        p2p_communication._batched_p2p_ops,
        vars(torch_norm.WrappedTorchNorm)["__new__"],
    )
    assert all(a is b for a, b in zip(before, after)) and not cpu_shims.is_applied()


def test_cpu_shims_leave_gpu_runs_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_shims.apply() is False and not cpu_shims.is_applied()


# What megatron-core 0.19's start_grad_sync does before any collective (param_and_grad_buffer.py:632,638
# @core_v0.19.0, :638,644 @main): the current stream waits for each parameter's CUDA-graph event.
STREAM_STAND_IN = """
import torch

def start_grad_sync(params):
    current_stream = torch.cuda.current_stream()
    for param in params:
        event = getattr(param, "_cudagraph_wgrad_ready_event", None)
        if event is not None:
            current_stream.wait_event(event)
    return len(params)
"""


def test_the_stream_wait_of_start_grad_sync_is_a_no_op_on_cpu(tmp_path, monkeypatch):
    import megatron.core.distributed.param_and_grad_buffer as pgb

    (tmp_path / "stream_stand_in.py").write_text(STREAM_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))
    stand_in = importlib.import_module("stream_stand_in")
    param = torch.zeros(2)
    param._cudagraph_wgrad_ready_event = object()
    with pytest.raises((AssertionError, RuntimeError)):  # CPU build: not compiled with CUDA; CUDA build: no driver
        stand_in.start_grad_sync([param])
    assert cpu_shims.apply()
    try:
        assert pgb.torch is not torch
        monkeypatch.setattr(stand_in, "torch", pgb.torch)  # as apply() gives param_and_grad_buffer its torch
        assert stand_in.start_grad_sync([param, torch.zeros(1)]) == 2
    finally:
        cpu_shims.remove()
    assert pgb.torch is torch


class _PastTheWait(Exception):
    pass


class _Bucket:
    """A bucket whose parameters carry a CUDA-graph event; anything read after the wait ends the call."""

    def __init__(self, params):
        self.params_list = params

    def __getattr__(self, name):
        raise _PastTheWait(name)


class _Config:
    def __getattr__(self, name):
        raise _PastTheWait(name)


def test_the_installed_start_grad_sync_gets_past_its_stream_wait():
    """The installed megatron-core's own ``start_grad_sync`` (0.16.1: no wait; 0.19+: ``current_stream()``) runs
    to its first read of the bucket's gradients or config under the shims, and no further."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    param = torch.zeros(2)
    param._cudagraph_wgrad_ready_event = object()
    group = types.SimpleNamespace(
        is_first_batch=False,
        grad_reduce_handle=None,
        previous_grad_reduce_bucket_group=None,
        buckets=[_Bucket([param])],
        ddp_config=_Config(),
    )
    assert cpu_shims.apply()
    try:
        with pytest.raises(_PastTheWait):
            pgb._ParamAndGradBucketGroup.start_grad_sync(group)
    finally:
        cpu_shims.remove()
