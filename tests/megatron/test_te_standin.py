"""The Transformer Engine stand-in (``te_standin``) against the installed Transformer Engine.

The stand-in is what the CPU suite tests the TE hooks with; these tests check that it has TE's
names and calling pattern. The ones that compare with TE itself run only where
``transformer_engine.pytorch`` imports (a GPU machine); elsewhere they are skipped.
"""

import inspect

import pytest

pytest.importorskip("torch")

from lagom_megatron.megatron.hooks.te_targets import find_te_targets  # noqa: E402

from .te_standin import distributed as standin_dist  # noqa: E402
from .te_standin.attention.dot_product_attention import context_parallel as standin_cp  # noqa: E402


def _te():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or TE's own error without CUDA
        pytest.skip(f"Transformer Engine not importable: {exc}")
    return find_te_targets()


def test_stand_in_has_the_names_lagom_hooks():
    t = find_te_targets("tests.megatron.te_standin")
    assert [c.__name__ for c in t.modules] == ["Linear", "LayerNormLinear"]
    assert [c.__name__ for c in t.functions] == [
        "_Linear",
        "_LayerNormLinear",
        "AttnFuncWithCPAndKVP2P",
        "AttnFuncWithCPAndQKVOA2A",
    ]
    assert t.attention.__name__ == "DotProductAttention"
    assert t.context_parallel is standin_cp
    assert t.distributed is standin_dist
    assert t.quantized_gathers == ["_all_gather_mxfp8", "_all_gather_nvfp4", "_start_all_gather_fp8_blockwise"]
    assert find_te_targets("no_such_package_for_lagom") is None


def test_installed_te_has_every_name_the_stand_in_copies():
    t = _te()
    names = {c.__name__ for c in t.modules} | {f.__name__ for f in t.functions}
    assert {"Linear", "LayerNormLinear", "_Linear", "_LayerNormLinear", "AttnFuncWithCPAndKVP2P"} <= names
    assert t.attention is not None and t.context_parallel is not None
    for fn in t.functions:  # autograd functions: forward and backward are staticmethods on the class
        assert isinstance(fn.__dict__["forward"], staticmethod) and isinstance(fn.__dict__["backward"], staticmethod)


def test_installed_te_issues_the_collectives_as_the_stand_in_does():
    _te()
    from transformer_engine.pytorch import distributed as te_dist
    from transformer_engine.pytorch.module import layernorm_linear, linear

    gather = inspect.getsource(te_dist.gather_along_first_dim)
    scatter = inspect.getsource(te_dist.reduce_scatter_along_first_dim)
    assert "torch.distributed.all_gather_into_tensor(" in gather and "async_op=async_op" in gather
    assert "torch.distributed.reduce_scatter_tensor(" in scatter and "async_op=async_op" in scatter
    assert list(inspect.signature(te_dist.reduce_scatter_along_first_dim).parameters) == list(
        inspect.signature(standin_dist.reduce_scatter_along_first_dim).parameters
    )
    for module in (linear, layernorm_linear):  # the backward posts both with async_op=True
        src = inspect.getsource(module)
        assert "gather_along_first_dim(" in src and "reduce_scatter_along_first_dim(" in src
        assert src.count("async_op=True") >= 2


def test_installed_te_gathers_quantized_inputs_as_the_stand_in_does():
    t = _te()
    from transformer_engine.pytorch import distributed as te_dist

    assert "_all_gather_mxfp8" in t.quantized_gathers  # NVFP4 since v2.8; block scaling renamed in v2.12
    for name in t.quantized_gathers:  # (inp, process_group, *, async_op, quantizer, out_shape), as lagom reads them
        params = inspect.signature(getattr(te_dist, name)).parameters
        assert (
            list(params)[:2] == ["inp", "process_group"] and params["async_op"].kind is inspect.Parameter.KEYWORD_ONLY
        )
        twin = "_start_all_gather_fp8_blockwise" if name == "_all_gather_fp8_blockwise" else name
        assert list(params) == list(inspect.signature(getattr(standin_dist, twin)).parameters)
        src = inspect.getsource(getattr(te_dist, name))
        assert "torch.distributed.all_gather_into_tensor(" in src and "group=process_group" in src
        if name != "_all_gather_fp8_blockwise" or "_coalescing_manager(" in src:  # v2.3-v2.4: synchronous only
            assert "torch.distributed._coalescing_manager(" in src and "async_ops=async_op" in src
    dispatch = inspect.getsource(te_dist.gather_along_first_dim)
    assert all(f"return {name}(" in dispatch for name in t.quantized_gathers)


def test_installed_te_context_parallel_ring_matches_the_stand_in():
    t = _te()
    assert list(inspect.signature(t.context_parallel.flash_attn_p2p_communicate).parameters) == list(
        inspect.signature(standin_cp.flash_attn_p2p_communicate).parameters
    )
    ring = inspect.getsource(t.context_parallel.flash_attn_p2p_communicate)
    assert "torch.distributed.batch_isend_irecv(" in ring and "torch.distributed.isend(" in ring
    fwd = inspect.getsource(t.attention.forward)
    assert "cp_group=self.cp_group" in fwd
    bwd = inspect.getsource(t.context_parallel.AttnFuncWithCPAndKVP2P.backward)
    assert "ctx.cp_group" in bwd and "flash_attn_p2p_communicate(" in bwd
    a2a = inspect.getsource(t.context_parallel.flash_attn_a2a_communicate)
    assert "torch.distributed.all_to_all_single(" in a2a and "group=cp_group, async_op=True" in a2a


def test_a_te_that_fails_to_import_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    import logging
    import sys

    pkg = tmp_path / "broken_te_for_lagom"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise OSError("libcuda.so.1: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lagom.patches"):
        assert find_te_targets("broken_te_for_lagom") is None
    assert "broken_te_for_lagom is installed but does not import (OSError: libcuda.so.1" in caplog.text
    sys.modules.pop("broken_te_for_lagom", None)
