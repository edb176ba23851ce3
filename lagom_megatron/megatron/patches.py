"""Every hook lagom puts on Megatron-Core's collectives and torch.distributed, in one removable set.

``install(router)`` replaces the entry points below with thin wrappers that call the
``router.SiteRouter``; it returns a ``PatchHandle`` whose ``remove()`` puts every original back.
Installing twice is refused. Nothing here changes what is communicated: the wrappers only
observe the call, pick the process group (a communicator-pool entry over the same ranks) and may
split a tensor into elementwise pieces.

Patched names, each where it is looked up (megatron-core 0.16.x; the names exist since 0.9):

* ``param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync`` / ``start_param_sync``: the
  DDP bucket-group transitions, the only level with a structural id (bucket index) and one handle
  per bucket group. The collective group is the bucket group's ``data_parallel_group`` /
  ``intra_distributed_optimizer_instance_group`` attribute, read on every call, so routing swaps
  it for the duration of the call (Megatron's own ``ProcessGroupCollection`` is consumed at DDP
  construction, too early for a plan found during training).
* ``param_and_grad_buffer.dist_reduce_scatter_func`` / ``dist_all_gather_func`` and the same two
  names in ``tensor_parallel.layers``: module-level aliases bound at import, so patching
  ``torch.distributed`` does not reach them (Megatron's own tests patch them the same way).
* ``torch.distributed.all_reduce``: the tensor-parallel dgrad all-reduce in
  ``tensor_parallel.layers``, the non-distributed-optimizer DDP all-reduce and the
  ``finalize_model_grads`` all-reduces call it through the ``torch.distributed`` module.
  Synchronous calls outside a tagged scope pass straight through.
* ``torch.distributed.all_to_all_single``: the MoE token dispatcher's all-to-all (tagged only
  inside ``MoEAlltoAllTokenDispatcher.token_dispatch`` / ``token_combine``, also patched).
* ``pipeline_parallel.p2p_communication.P2PCommunicator._communicate``: every pipeline send and
  receive of the schedules; the communicator's ``pp_group`` attribute is swapped for the call.
  Wrapping ``torch.distributed.isend`` instead would break ``P2POp``, which checks identity.
* ``config.finalize_model_grads_func`` of the given model configs (an attribute, not a module
  name): wrapped so that its all-reduces are tagged ``<group>.finalize_all_reduce[k]``.

``gloo_threads(n)`` is the one patch outside ``install``: a context manager that, while a pool
entry is created, makes ``torch.distributed`` build its gloo backend with ``n`` worker threads
(torch's ``new_group`` ignores ``pg_options`` for gloo in torch 2.x).
"""

from __future__ import annotations

import datetime
import functools
import importlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

_INSTALLED: "PatchHandle | None" = None


class PatchHandle:
    """The installed patches; ``remove()`` restores every original (idempotent)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []
        self.removed = False

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    @property
    def patched(self) -> list[str]:
        """``owner.name`` of every patched attribute, in installation order."""
        return [f"{getattr(o, '__name__', type(o).__name__)}.{n}" for o, n, _ in self._undo]

    def remove(self) -> None:
        """Restores every original in reverse order and allows a new ``install``."""
        global _INSTALLED
        if self.removed:
            return
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()
        self.removed = True
        if _INSTALLED is self:
            _INSTALLED = None

    def __enter__(self) -> "PatchHandle":
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

    wrapper.__lagom_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def install(router: Any, *, model_configs: list[Any] | tuple[Any, ...] = ()) -> PatchHandle:
    """Installs every hook (module docstring) calling ``router``; returns the handle.

    Args:
        router: a ``SiteRouter`` (anything with ``bucket_sync``, ``collective``, ``p2p``, ``scope``).
        model_configs: Megatron ``TransformerConfig``s whose ``finalize_model_grads_func`` to tag.

    Raises:
        RuntimeError: the patches are already installed (remove the first handle first).
    """
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
        for module in (pgb, layers):
            for alias, op in (("dist_reduce_scatter_func", "reduce_scatter"), ("dist_all_gather_func", "all_gather")):
                if hasattr(module, alias):
                    handle._set(module, alias, _collective_wrapper(router, op, getattr(module, alias)))
        handle._set(dist, "all_reduce", _collective_wrapper(router, "all_reduce", dist.all_reduce))
        handle._set(dist, "all_to_all_single", _collective_wrapper(router, "all_to_all", dist.all_to_all_single))

        comm_cls = p2p.P2PCommunicator
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


@contextmanager
def gloo_threads(n_threads: int) -> Iterator[None]:
    """While active, gloo backends created by ``torch.distributed.new_group`` get ``n_threads`` workers.

    torch 2.x's ``new_group`` builds ``ProcessGroupGloo(store, rank, size, timeout=...)`` (torch 2.14
    adds ``enable_reconfigure=``: torch 2.14.1 ``distributed_c10d.py:669-676``, ``_create_gloo_process_group``,
    which the options object carries as a field of the same name) and ignores ``pg_options`` for gloo; the options object with ``_threads`` is only accepted by the
    constructor's other overload. This swaps ``distributed_c10d.ProcessGroupGloo`` for a subclass
    that passes such options, and restores it on exit.

    Raises:
        ValueError: ``n_threads`` < 1.
    """
    if n_threads < 1:
        raise ValueError(f"gloo worker threads must be >= 1; got {n_threads}")
    from torch.distributed import distributed_c10d as c10d

    original = c10d.ProcessGroupGloo

    class _ProcessGroupGlooWithThreads(original):  # type: ignore[misc, valid-type]
        def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     **options: Any) -> None:
            opts = original._Options()
            opts._timeout = timeout
            opts._threads = n_threads
            opts._devices = [original.create_default_device()]
            for name, value in options.items():  # torch 2.14: enable_reconfigure=, also an _Options field
                if not hasattr(opts, name):
                    raise TypeError(f"ProcessGroupGloo got an unexpected keyword argument {name!r}")
                setattr(opts, name, value)
            super().__init__(store, rank, size, opts)

    c10d.ProcessGroupGloo = _ProcessGroupGlooWithThreads
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = original
