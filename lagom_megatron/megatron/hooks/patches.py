"""Every hook lagom puts on Megatron-Core (0.16.x to main's 0.20; names since 0.9), torch.distributed and
``te_targets``, in one removable set; wrappers call ``router.SiteRouter``, only tag the call, pick its group, may split
a tensor. core_v0.19.0 / main keep ``start_param_sync`` and ``start_grad_sync`` (``param_and_grad_buffer.py:377,594`` /
``:383,600``) with the same groups, managers and aliases."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

from lagom_megatron.megatron.hooks.sites import FP32_ALL_TO_ALL
from lagom_megatron.megatron.hooks.te_targets import (
    TeTargets,
    find_fsdp2_param_group,
    find_megatron_fsdp,
    find_te_targets,
    userbuffers_note,
)

log = logging.getLogger("lagom.patches")

# torch.distributed functions patched in the torch.distributed module, and the router op of each (*_single: torch 2.13).
_DIST_COLLECTIVES = (
    ("all_reduce", "all_reduce"),
    ("all_to_all_single", "all_to_all"),
    ("all_gather_into_tensor", "all_gather"),
    ("reduce_scatter_tensor", "reduce_scatter"),
    ("all_gather_single", "all_gather"),
    ("reduce_scatter_single", "reduce_scatter"),
)

_INSTALLED: PatchHandle | None = None
_INHERITED = object()


def _raw(owner: Any, name: str) -> Any:
    # on a class, the raw attribute (a staticmethod stays one; an inherited name is deleted again)
    return owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)


class PatchHandle:
    """The installed patches; ``remove()`` restores every original (idempotent) that nobody replaced since."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any, Any]] = []
        self.removed = False

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, _raw(owner, name), value))
        setattr(owner, name, value)

    @property
    def patched(self) -> list[str]:
        """``owner.name`` of every patched attribute, in installation order."""
        return [f"{getattr(o, '__name__', type(o).__name__)}.{n}" for o, n, _, _ in self._undo]

    def remove(self) -> None:
        """Restores every original in reverse order and allows a new ``install``; a name rebound after ``install``
        keeps its new value (bucket groups rebind ``dist_reduce_scatter_func``, ``sites.grad_all_to_all``)."""
        global _INSTALLED
        if self.removed:
            return
        for owner, name, original, value in reversed(self._undo):
            if _raw(owner, name) is not value:
                continue
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()
        self.removed = True
        if _INSTALLED is self:
            _INSTALLED = None

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def installed() -> PatchHandle | None:
    """The handle of the patches currently installed, or None."""
    return _INSTALLED


def _collective_wrapper(router: Any, op: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    collective = router.collective  # bound once: the wrapper is one frame and one call per collective

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return collective(op, orig, args, kwargs)

    return wrapper


def _quantized_gather_wrapper(router: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    gather = router.quantized_gather

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return gather(orig, args, kwargs)

    return wrapper


# Scope wrappers give collectives in TE, FSDP2 and MoE autograd code a site; a backward reruns its forward's scope, so
# TE's backward SP collectives (v2.18 ``pytorch/module/linear.py:947-951,1064-1068``,
# ``layernorm_linear.py:764-768,881-885``) and ``_AllToAll.backward`` (mc0.16.1 ``tensor_parallel/mappings.py:453-460``)
# get their module. Autograd looks ``forward`` / ``backward`` up on the class per call (torch ``autograd/function.py``).
_CTX_ATTR = "_lagom_scope"


def carry_forward(router: Any, orig: Callable[..., Any]) -> Any:
    """``Function.forward`` keeping the scope on ``ctx`` (None in TE v2.18 ``module/linear.py`` without grad)."""

    @functools.wraps(orig)
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if ctx is not None:
            try:
                setattr(ctx, _CTX_ATTR, router.current_scope())
            except AttributeError:  # a ctx that refuses attributes: backward is then unscoped
                pass
        return orig(ctx, *args, **kwargs)

    return staticmethod(forward)


def carry_backward(router: Any, orig: Callable[..., Any]) -> Any:
    """``staticmethod`` replacing ``Function.backward(ctx, *grads)``: runs it in the forward's scope."""

    @functools.wraps(orig)
    def backward(ctx: Any, *grads: Any) -> Any:
        scope = getattr(ctx, _CTX_ATTR, None)
        if scope is None:
            return orig(ctx, *grads)
        with router.reenter(scope):
            return orig(ctx, *grads)

    return staticmethod(backward)


def module_forward(router: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement of ``Module.forward``: runs it in the named scope of the module (``router.module``)."""

    @functools.wraps(orig)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return router.module(self, orig, args, kwargs)

    return forward


def named_method(router: Any, orig: Callable[..., Any], *, prefix: str, attr: str) -> Callable[..., Any]:
    """A method whose collectives, sync ones too (FSDP2's), are sites ``<group>.<prefix>_<op>[<self.attr or root>]``."""

    @functools.wraps(orig)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self, attr, None) or "root"
        with router.named(str(name), prefix=prefix, tag_sync=True):
            return orig(self, *args, **kwargs)

    return method


def stream_scoped(router: Any, orig: Callable[..., Any], kind: str, *, per_microbatch: bool) -> Callable[..., Any]:
    """Replacement of a function whose collectives form the call-order stream ``kind``."""

    @functools.wraps(orig)
    def fn(*args: Any, **kwargs: Any) -> Any:
        with router.scope(kind, per_microbatch=per_microbatch):
            return orig(*args, **kwargs)

    return fn


def install(
    router: Any,
    *,
    model_configs: list[Any] | tuple[Any, ...] = (),
    te: TeTargets | None | str = "auto",
    fsdp2: type | None | str = "auto",
    megatron_fsdp: list[Any] | str = "auto",
) -> PatchHandle:
    """Installs every hook calling ``router`` (RuntimeError if installed); ``te`` / ``fsdp2`` / ``megatron_fsdp``:
    ``"auto"`` finds them, None / ``[]`` none; ``model_configs``: whose ``finalize_model_grads_func`` to tag."""
    global _INSTALLED
    if _INSTALLED is not None:
        raise RuntimeError("lagom patches are already installed; call remove() on the existing handle first")
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.tensor_parallel import layers

    handle = PatchHandle()
    try:
        bg_cls = pgb._ParamAndGradBucketGroup
        bucket_sync = router.bucket_sync
        for name, kind in (("start_grad_sync", "grad"), ("start_param_sync", "param")):
            orig = getattr(bg_cls, name)

            def bucket_wrapper(self: Any, *args: Any, _orig: Callable = orig, _kind: str = kind, **kwargs: Any) -> Any:
                return bucket_sync(self, _kind, _orig, args, kwargs)

            functools.update_wrapper(bucket_wrapper, orig)
            handle._set(bg_cls, name, bucket_wrapper)
        orig_cm = pgb._coalescing_manager

        def bucket_coalescing(*args: Any, **kwargs: Any) -> Any:
            return router.bucket_coalescing(orig_cm, args, kwargs)

        functools.update_wrapper(bucket_coalescing, orig_cm)
        handle._set(pgb, "_coalescing_manager", bucket_coalescing)
        from megatron.core import utils as mc_utils

        for module in (pgb, layers, mc_utils):  # aliases bound at import: patching torch.distributed misses them
            for alias, op in (("dist_reduce_scatter_func", "reduce_scatter"), ("dist_all_gather_func", "all_gather")):
                fn = getattr(module, alias, None)
                # the fp32-accumulating reduce-scatter is no collective: its all_to_all_single is, hooked below
                if fn is not None and fn is not getattr(module, FP32_ALL_TO_ALL, None):
                    handle._set(module, alias, _collective_wrapper(router, op, fn))
        for name, op in _DIST_COLLECTIVES:
            if hasattr(dist, name):
                handle._set(dist, name, _collective_wrapper(router, op, getattr(dist, name)))
        _install_extras(
            handle,
            router,
            te=find_te_targets() if te == "auto" else te,
            fsdp2=find_fsdp2_param_group() if fsdp2 == "auto" else fsdp2,
        )
        _install_megatron_fsdp(handle, router, find_megatron_fsdp() if megatron_fsdp == "auto" else megatron_fsdp)
        note = userbuffers_note(model_configs)
        if note:
            log.warning(note)

        comm_cls = p2p.P2PCommunicator  # not torch.distributed.isend: P2POp checks the function's identity
        orig_comm = comm_cls._communicate

        def communicate(self: Any, **kwargs: Any) -> Any:
            return router.p2p(self, orig_comm, kwargs)

        functools.update_wrapper(communicate, orig_comm)
        handle._set(comm_cls, "_communicate", communicate)

        try:
            disp = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
            a2a_cls = getattr(disp, "MoEAlltoAllTokenDispatcher", None)
        except ImportError:
            a2a_cls = None
        if a2a_cls is not None:
            for name in ("token_dispatch", "token_combine"):
                orig = getattr(a2a_cls, name)

                def moe_wrapper(self: Any, *args: Any, _orig: Callable = orig, _name: str = name, **kwargs: Any) -> Any:
                    with router.scope(f"{_name.split('_')[1]}_all_to_all", per_microbatch=True):
                        return _orig(self, *args, **kwargs)

                functools.update_wrapper(moe_wrapper, orig)
                handle._set(a2a_cls, name, moe_wrapper)

        for cfg in model_configs:
            fn = getattr(cfg, "finalize_model_grads_func", None)
            if fn is None:
                continue

            def finalize(*args: Any, _fn: Callable = fn, **kwargs: Any) -> Any:
                with router.scope("finalize_all_reduce", per_microbatch=False):
                    return _fn(*args, **kwargs)

            handle._set(cfg, "finalize_model_grads_func", finalize)
    except BaseException:
        handle.remove()
        raise
    _INSTALLED = handle
    return handle


def _install_megatron_fsdp(handle: PatchHandle, router: Any, modules: list[Any]) -> None:
    for mod in modules:
        for cls, name, method in (
            (mod.AllGatherPipeline, "all_gather_params", "mfsdp_all_gather"),
            (mod.AllGatherPipeline, "async_bucket_gather", "mfsdp_bucket"),
            (mod.GradReducePipeline, "_bucket_group_gradient_reduce", "mfsdp_reduce"),
        ):
            orig = getattr(cls, name)

            def pipeline_method(self: Any, *args: Any, _orig: Callable = orig, _m: str = method, **kwargs: Any) -> Any:
                return getattr(router, _m)(self, _orig, args, kwargs)

            functools.update_wrapper(pipeline_method, orig)
            handle._set(cls, name, pipeline_method)
        orig_cm = mod._coalescing_manager

        def coalescing_manager(*args: Any, _orig: Callable = orig_cm, **kwargs: Any) -> Any:
            return router.mfsdp_coalescing(_orig, args, kwargs)

        functools.update_wrapper(coalescing_manager, orig_cm)
        handle._set(mod, "_coalescing_manager", coalescing_manager)


def _install_extras(handle: PatchHandle, router: Any, *, te: TeTargets | None, fsdp2: type | None) -> None:
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import mappings

    orig_ops = p2p._p2p_ops

    def p2p_ops(**kwargs: Any) -> Any:
        return router.p2p_ops(orig_ops, kwargs)

    functools.update_wrapper(p2p_ops, orig_ops)
    handle._set(p2p, "_p2p_ops", p2p_ops)
    if hasattr(schedules, "drain_embedding_wgrad_compute"):
        handle._set(
            schedules,
            "drain_embedding_wgrad_compute",
            stream_scoped(
                router, schedules.drain_embedding_wgrad_compute, "embedding_wgrad_all_gather", per_microbatch=False
            ),
        )
    functions = [mappings._AllToAll] + (list(te.functions) if te is not None else [])
    for fn_cls in functions:  # Function.forward / backward are staticmethods: class lookup gives the function
        handle._set(fn_cls, "forward", carry_forward(router, fn_cls.forward))
        handle._set(fn_cls, "backward", carry_backward(router, fn_cls.backward))
    if te is not None:
        for mod_cls in te.modules:
            handle._set(mod_cls, "forward", module_forward(router, mod_cls.forward))
        if te.attention is not None:
            orig_attn = te.attention.forward

            def attention(self: Any, *args: Any, **kwargs: Any) -> Any:
                return router.attention(self, orig_attn, args, kwargs)

            functools.update_wrapper(attention, orig_attn)
            handle._set(te.attention, "forward", attention)
        for name in te.quantized_gathers:
            handle._set(te.distributed, name, _quantized_gather_wrapper(router, getattr(te.distributed, name)))
        if te.context_parallel is not None:
            orig_ring = te.context_parallel.flash_attn_p2p_communicate

            def ring(*args: Any, **kwargs: Any) -> Any:
                return router.ring_exchange(orig_ring, args, kwargs)

            functools.update_wrapper(ring, orig_ring)
            handle._set(te.context_parallel, "flash_attn_p2p_communicate", ring)
    if fsdp2 is not None:
        for name, prefix in (("unshard", "fsdp"), ("post_backward", "fsdp")):
            if hasattr(fsdp2, name):
                handle._set(fsdp2, name, named_method(router, getattr(fsdp2, name), prefix=prefix, attr="_module_fqn"))
