"""patches.install / remove: every entry point is replaced, delegates to the router, and is restored."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core.distributed import param_and_grad_buffer as pgb  # noqa: E402
from megatron.core.pipeline_parallel import p2p_communication as p2p  # noqa: E402
from megatron.core.tensor_parallel import layers  # noqa: E402

from lagom_megatron.megatron.hooks import patches  # noqa: E402

from .lagom_harness import _originals as _names  # noqa: E402  (the names lagom patches, one list)


class Recorder:
    """A router that records what the wrappers hand it and returns a marker."""

    def __init__(self):
        self.calls = []

    def collective(self, op, orig, args, kwargs):
        self.calls.append(("collective", op, orig, args, kwargs))
        return "routed"

    def bucket_sync(self, bucket_group, kind, orig, args, kwargs):
        self.calls.append(("bucket", kind, bucket_group, args, kwargs))
        return "bucket"

    def bucket_coalescing(self, orig, args, kwargs):
        self.calls.append(("bucket_coalescing", orig, args, kwargs))
        return "coalescing"

    def p2p(self, communicator, orig, kwargs):
        self.calls.append(("p2p", communicator, kwargs))
        return "p2p"

    def quantized_gather(self, orig, args, kwargs):
        self.calls.append(("quantized_gather", orig, args, kwargs))
        return "gathered", None

    def scope(self, kind, *, per_microbatch):
        import contextlib

        self.calls.append(("scope", kind, per_microbatch))
        return contextlib.nullcontext()


class Config:
    def __init__(self):
        self.finalize_model_grads_func = lambda *a, **k: ("finalized", a, k)


def test_install_routes_every_entry_point_and_remove_restores_them():
    before = _names()
    cfg = Config()
    original_finalize = cfg.finalize_model_grads_func
    router = Recorder()
    handle = patches.install(router, model_configs=[cfg])
    try:
        during = _names()
        changed = sorted(k for k in before if before[k] is not during[k])
        assert changed == sorted(before), f"not patched: {sorted(set(before) - set(changed))}"
        assert patches.installed() is handle
        assert len(handle.patched) >= len(before) + 1  # + finalize_model_grads_func (+ MoE dispatcher)
        # module-level aliases reach the router with Megatron's arguments untouched
        assert layers.dist_all_gather_func("out", "inp", group="g", async_op=True) == "routed"
        assert router.calls[-1][1] == "all_gather" and router.calls[-1][3] == ("out", "inp")
        assert router.calls[-1][4] == {"group": "g", "async_op": True}
        assert router.calls[-1][2] is before["layers.dist_all_gather_func"]
        assert pgb.dist_reduce_scatter_func("o", "i") == "routed" and router.calls[-1][1] == "reduce_scatter"
        assert dist.all_reduce("t") == "routed" and router.calls[-1][1] == "all_reduce"
        bg = object.__new__(pgb._ParamAndGradBucketGroup)
        assert bg.start_grad_sync(force_all_reduce=True) == "bucket"
        assert router.calls[-1][:3] == ("bucket", "grad", bg) and router.calls[-1][4] == {"force_all_reduce": True}
        assert bg.start_param_sync() == "bucket" and router.calls[-1][1] == "param"
        # the bucket groups' coalescing manager (the module's own name) reaches the router too
        assert pgb._coalescing_manager("g", async_ops=True) == "coalescing"
        assert router.calls[-1] == ("bucket_coalescing", before["pgb._coalescing_manager"], ("g",), {"async_ops": True})
        comm = object.__new__(p2p.P2PCommunicator)
        assert comm._communicate(tensor_send_next=None, recv_prev=True) == "p2p"
        assert router.calls[-1][2] == {"tensor_send_next": None, "recv_prev": True}
        result = cfg.finalize_model_grads_func([1], num_tokens=3)
        assert result == ("finalized", ([1],), {"num_tokens": 3})
        assert ("scope", "finalize_all_reduce", False) in router.calls
        with pytest.raises(RuntimeError, match="already installed"):
            patches.install(Recorder())
    finally:
        handle.remove()
    after = _names()
    assert all(before[k] is after[k] for k in before), [k for k in before if before[k] is not after[k]]
    assert cfg.finalize_model_grads_func is original_finalize
    assert patches.installed() is None
    handle.remove()  # idempotent
    second = patches.install(Recorder())  # allowed again after remove
    second.remove()
    assert all(before[k] is v for k, v in _names().items())


def test_remove_restores_autograd_staticmethods_and_te_fsdp2_methods_exactly():
    from megatron.core.tensor_parallel import mappings

    from lagom_megatron.megatron.hooks.te_targets import find_fsdp2_param_group, find_te_targets

    te = find_te_targets("tests.megatron.te_standin")
    fsdp2 = find_fsdp2_param_group()
    classes = [mappings._AllToAll, *te.functions, *te.modules, te.attention] + ([fsdp2] if fsdp2 else [])
    names = ("forward", "backward", "unshard", "post_backward")

    def raw():
        return {(c.__name__, n): c.__dict__.get(n) for c in classes for n in names}

    before = raw()
    ring = te.context_parallel.flash_attn_p2p_communicate
    gathers = {n: getattr(te.distributed, n) for n in te.quantized_gathers}
    router = Recorder()
    handle = patches.install(router, te=te, fsdp2=fsdp2)
    try:
        # TE's quantized gathers reach the router with their arguments untouched
        assert te.distributed._all_gather_mxfp8("inp", "pg", async_op=True) == ("gathered", None)
        assert router.calls[-1] == ("quantized_gather", gathers["_all_gather_mxfp8"], ("inp", "pg"), {"async_op": True})
        during = raw()
        changed = {k for k in before if before[k] is not during[k]}
        assert ("_AllToAll", "backward") in changed and ("_Linear", "backward") in changed
        assert ("DotProductAttention", "forward") in changed and ("LayerNormLinear", "forward") in changed
        assert fsdp2 is None or ("FSDPParamGroup", "unshard") in changed
        assert isinstance(mappings._AllToAll.__dict__["backward"], staticmethod)
        assert te.context_parallel.flash_attn_p2p_communicate is not ring
    finally:
        handle.remove()
    after = raw()
    assert all(before[k] is after[k] for k in before), [k for k in before if before[k] is not after[k]]
    assert te.context_parallel.flash_attn_p2p_communicate is ring
    assert {n: getattr(te.distributed, n) for n in te.quantized_gathers} == gathers


def test_the_fp8_block_scaling_gather_of_te_2_3_to_2_11_is_hooked_too(tmp_path, monkeypatch):
    """TE v2.3-v2.11 named the FP8 block-scaling gather ``_all_gather_fp8_blockwise`` (v2.11
    ``pytorch/distributed.py:1066``, same signature, one ``_coalescing_manager`` from v2.5), and
    ``gather_along_first_dim`` looks it up as a module global (v2.11 ``:1661``), as v2.18 does
    ``_start_all_gather_fp8_blockwise``."""
    from lagom_megatron.megatron.hooks.te_targets import find_te_targets

    pkg = tmp_path / "te_v211_layout"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "distributed.py").write_text(
        "def _all_gather_fp8_blockwise(inp, process_group, *, async_op=False, quantizer=None, out_shape=None):\n"
        "    return 'unhooked', None\n\n\n"
        "def gather_along_first_dim(inp, process_group, async_op=False, quantizer=None):\n"
        "    return _all_gather_fp8_blockwise(inp, process_group, async_op=async_op, quantizer=quantizer,\n"
        "                                     out_shape=[8])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    te = find_te_targets("te_v211_layout")
    assert te.quantized_gathers == ["_all_gather_fp8_blockwise"]
    orig = te.distributed._all_gather_fp8_blockwise
    router = Recorder()
    handle = patches.install(router, te=te, fsdp2=None, megatron_fsdp=[])
    try:
        assert te.distributed.gather_along_first_dim("inp", "pg", async_op=True) == ("gathered", None)
        assert router.calls[-1] == (
            "quantized_gather",
            orig,
            ("inp", "pg"),
            {"async_op": True, "quantizer": None, "out_shape": [8]},
        )
    finally:
        handle.remove()
    assert te.distributed._all_gather_fp8_blockwise is orig


def test_backward_scope_of_each_forward_scope():
    from lagom_megatron.megatron.hooks.router import backward_scope

    assert backward_scope(("stream", ("dispatch_all_to_all", True))) == ("stream", ("dispatch_all_to_all_bwd", True))
    assert backward_scope(("stream", ("combine_all_to_all_bwd", True))) == ("stream", ("combine_all_to_all_bwd", True))
    named = ("named", ("chunk0.decoder.layers.0.self_attention.linear_qkv", None, False))
    assert backward_scope(named) is named
    assert backward_scope(("bucket", (0, None))) is None and backward_scope(None) is None


def test_userbuffers_are_flagged_at_install_as_not_nccl(caplog):
    import logging
    import types

    from lagom_megatron.megatron.hooks.te_targets import userbuffers_note

    assert userbuffers_note([types.SimpleNamespace(tp_comm_overlap=False)]) is None
    assert userbuffers_note([]) is None
    cfg = Config()
    cfg.tp_comm_overlap = True
    with caplog.at_level(logging.WARNING, logger="lagom.patches"):
        handle = patches.install(Recorder(), model_configs=[cfg], te=None, fsdp2=None)
        handle.remove()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "--tp-comm-overlap" in text and "outside NCCL" in text and "SMs" in text


def test_megatrons_fp32_reduce_scatter_is_left_unwrapped_and_kept_after_remove(monkeypatch):
    """``--ddp-reduce-scatter-with-fp32-accumulation``: a bucket group's ``__init__`` rebinds the module's
    ``dist_reduce_scatter_func`` (core_v0.16.1 ``param_and_grad_buffer.py:163-165``); its ``all_to_all_single`` is the
    collective. Restoring torch's reduce-scatter on ``remove()`` would hand Megatron's fp32 path an ``_IllegalWork``."""
    monkeypatch.setattr(pgb, "dist_reduce_scatter_func", pgb.dist_reduce_scatter_func)  # undone after the test
    fp32 = pgb.reduce_scatter_with_fp32_accumulation
    handle = patches.install(Recorder(), te=None, fsdp2=None, megatron_fsdp=[])
    try:
        assert pgb.dist_reduce_scatter_func is not dist.reduce_scatter_tensor  # wrapped: torch's reduce-scatter
        pgb.dist_reduce_scatter_func = fp32  # what a bucket group built now does (``global dist_reduce_scatter_func``)
    finally:
        handle.remove()
    assert pgb.dist_reduce_scatter_func is fp32
    handle = patches.install(Recorder(), te=None, fsdp2=None, megatron_fsdp=[])
    try:
        assert pgb.dist_reduce_scatter_func is fp32  # no collective of its own: not a reduce-scatter site
        assert "dist_reduce_scatter_func" in [n.split(".")[-1] for n in handle.patched]  # layers' alias still is
        assert dist.all_to_all_single("o", "i", group="g") == "routed"  # the call it makes reaches the router
    finally:
        handle.remove()
    assert pgb.dist_reduce_scatter_func is fp32
