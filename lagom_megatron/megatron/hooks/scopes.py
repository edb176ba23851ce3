"""Wrappers that give collectives issued inside Transformer Engine, FSDP2 and MoE autograd code a site.

A wrapper sets a scope on the ``SiteRouter``; a backward reruns its forward's scope, so TE's backward SP collectives
(v2.18 ``pytorch/module/linear.py:947-951,1064-1068``, ``layernorm_linear.py:764-768,881-885``) and
``_AllToAll.backward`` (mc0.16.1 ``tensor_parallel/mappings.py:453-460``) get their module. Autograd looks
``forward`` / ``backward`` up on the class at call time (torch ``autograd/function.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_CTX_ATTR = "_lagom_scope"


def carry_forward(router: Any, orig: Callable[..., Any]) -> Any:
    """``staticmethod`` replacing ``Function.forward(ctx, ...)``: keeps the router's scope on ``ctx`` (None when TE
    v2.18 ``module/linear.py`` calls ``_Linear.forward(None, ...)`` without grad)."""

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
    """Replacement of a method whose collectives, synchronous ones too (FSDP2's), are the sites
    ``<group>.<prefix>_<op>[<self.attr or root>]``."""

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


def backward_scope(scope: Any) -> Any:
    """The scope a backward runs in, given its forward's: a stream kind gets ``_bwd``, named kept, else None."""
    if scope is None:
        return None
    tag, value = scope
    if tag == "stream":
        kind, per_mb = value
        return scope if kind.endswith("_bwd") else ("stream", (f"{kind}_bwd", per_mb))
    if tag == "named":
        return scope
    return None
