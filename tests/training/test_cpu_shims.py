"""The CPU shims install only without CUDA, are idempotent, and remove() restores every original.
(The callbacks of pretrain() are checked on the baseline run of test_training.py.)"""

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
