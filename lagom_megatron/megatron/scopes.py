"""Wrappers that give collectives issued inside Transformer Engine, FSDP2 and MoE autograd code a site.

``patches.py`` installs these (it is the one module that replaces names); this module only
builds the replacement functions. Each wrapper sets a *scope* on the ``SiteRouter`` while the
wrapped code runs, so that a collective issued inside is named by structure (layer and module),
not only by call order:

* ``module_forward``: a module's ``forward`` (TE ``Linear`` / ``LayerNormLinear`` /
  ``LayerNormMLP`` / ``DotProductAttention``) runs in the named scope of the module's path in
  the model (``chunk0.decoder.layers.3.self_attention.linear_qkv``; ``SiteRegistry.module_name``).
* ``carry_forward`` / ``carry_backward``: an autograd ``Function``'s ``forward`` keeps the scope it
  ran in on its ``ctx``; its ``backward`` runs in that scope again (a call-order stream scope gets
  the ``_bwd`` kind). This is how a collective issued in backward gets the module of its
  forward: TE issues its sequence-parallel all-gather and reduce-scatter in ``_Linear.backward``
  (TE v2.18 ``pytorch/module/linear.py:947-951,1064-1068``) and ``_LayerNormLinear.backward``
  (``layernorm_linear.py:764-768,881-885``); megatron-core's MoE all-to-all backward is
  ``_AllToAll.backward`` (mc0.16.1 ``tensor_parallel/mappings.py:453-460``).
* ``named_method``: a method whose collectives form one site per object, named by an attribute
  of the object (FSDP2's ``FSDPParamGroup.unshard`` / ``post_backward``, by ``_module_fqn``).

Autograd runs ``Function.backward`` by looking the attribute up on the class at call time, and
``Function.apply`` looks up ``forward`` the same way, so replacing the class attributes reaches
calls made by TE and Megatron-Core (torch ``autograd/function.py``: ``BackwardCFunction.apply``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_CTX_ATTR = "_lagom_scope"


def carry_forward(router: Any, orig: Callable[..., Any]) -> Any:
    """``staticmethod`` replacing an autograd ``Function.forward(ctx, ...)``: keeps the router's scope on ``ctx``.

    ``ctx`` may be None (TE calls ``_Linear.forward(None, ...)`` directly when no gradient is
    needed, TE v2.18 ``module/linear.py``); then nothing is kept.
    """

    @functools.wraps(orig)
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if ctx is not None:
            try:
                setattr(ctx, _CTX_ATTR, router.current_scope())
            except AttributeError:  # a ctx that refuses attributes: backward is then unscoped
                pass
        return orig(ctx, *args, **kwargs)

    forward.__lagom_original__ = orig  # type: ignore[attr-defined]
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

    backward.__lagom_original__ = orig  # type: ignore[attr-defined]
    return staticmethod(backward)


def module_forward(router: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    """Replacement of ``Module.forward``: runs it in the named scope of the module (``router.module``)."""

    @functools.wraps(orig)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return router.module(self, orig, args, kwargs)

    forward.__lagom_original__ = orig  # type: ignore[attr-defined]
    return forward


def named_method(router: Any, orig: Callable[..., Any], *, prefix: str, attr: str) -> Callable[..., Any]:
    """Replacement of a method whose collectives are the sites ``<group>.<prefix>_<op>[<self.attr>]``.

    Synchronous collectives inside are sites too (FSDP2 issues its all-gathers and
    reduce-scatters synchronously on side streams on GPU and on the caller's thread on CPU).
    An empty or missing ``attr`` is named ``root``.
    """

    @functools.wraps(orig)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self, attr, None) or "root"
        with router.named(str(name), prefix=prefix, tag_sync=True):
            return orig(self, *args, **kwargs)

    method.__lagom_original__ = orig  # type: ignore[attr-defined]
    return method


def stream_scoped(router: Any, orig: Callable[..., Any], kind: str, *, per_microbatch: bool) -> Callable[..., Any]:
    """Replacement of a function whose collectives form the call-order stream ``kind``."""

    @functools.wraps(orig)
    def fn(*args: Any, **kwargs: Any) -> Any:
        with router.scope(kind, per_microbatch=per_microbatch):
            return orig(*args, **kwargs)

    fn.__lagom_original__ = orig  # type: ignore[attr-defined]
    return fn


def backward_scope(scope: Any) -> Any:
    """The scope a backward runs in, given the scope its forward ran in (see module docstring).

    ``("stream", (kind, per_mb))`` -> ``("stream", (kind + "_bwd", per_mb))`` unless already a
    backward kind; named scopes are kept; a bucket scope (DDP internals) or None gives None.
    """
    if scope is None:
        return None
    tag, value = scope
    if tag == "stream":
        kind, per_mb = value
        return scope if kind.endswith("_bwd") else ("stream", (f"{kind}_bwd", per_mb))
    if tag == "named":
        return scope
    return None
