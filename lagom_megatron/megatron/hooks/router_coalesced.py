"""Coalesced routing of the ``SiteRouter`` (a mixin): TE v2.18 gathers an MXFP8 / NVFP4 / FP8-block SP input as sync
all-gathers in one ``_coalescing_manager`` (``pytorch/distributed.py``: ``_start_all_gather_fp8_blockwise`` :1076-1223,
manager :1156-1200, v2.3-v2.11 ``_all_gather_fp8_blockwise``; ``_all_gather_nvfp4`` :1324-1506, :1410-1494;
``_all_gather_mxfp8`` :1509-1637, :1584-1634; via ``gather_along_first_dim`` :1640-1790, :1709-1749). The backward's
async call (``module/linear.py:947-951``, ``layernorm_linear.py:764-768``, ``layernorm_mlp.py:1189-1193``) is site
``tp.sp_all_gather[<module>]``; sync ones (``linear.py:372``) pass. Its ``parts`` are the inner gathers' outputs, one
NCCL group (torch 2.13 ``distributed_c10d.py:2909``): NCCL enqueues each as int8 bytes (v2.30.7
``src/enqueue.cc:2733-2737``), aggregates those within 4x of the smallest and asks the tuner once per aggregate
(``:405-441``, ``:2127-2147``): scale-inverses and data apart (``nccl.validate.nccl_bins``), a tuner row each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lagom_megatron.megatron.hooks.sites import ONE_RANK, dtype_name, tensor_nbytes


def _record_gathered(registry: Any, site_id: str, outputs: list[Any], group: Any) -> None:
    """One call of ``site_id``: the bytes of all ``outputs``, the largest one's dtype, and the parts NCCL bins."""
    parts = tuple((dtype_name(t), tensor_nbytes(t)) for t in outputs)
    dtype = max(parts, key=lambda p: p[1])[0] if parts else "uint8"
    facts = {"parts": parts} if len(parts) > 1 else None
    registry.record(site_id, op="all_gather", nbytes=sum(b for _, b in parts), dtype=dtype, group=group, facts=facts)


class CoalescedRouting:
    """TE quantized-gather methods of ``SiteRouter``."""

    registry: Any
    profiler: Any
    active: bool
    calls_routed: int
    _scope: Any
    _streams: dict
    _routes: dict

    def _resolve(self, site_id: str, info: Any) -> tuple[Any, Any, int]:
        raise NotImplementedError

    def _stream_call(self, group: Any, op: str, scope: Any) -> Any:
        raise NotImplementedError

    def quantized_gather(self, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A ``QUANTIZED_GATHERS`` call ``(inp, process_group, *, async_op, ...) -> (out, handle)``; async: one site."""
        if not kwargs.get("async_op", False) or not self.active:
            return orig(*args, **kwargs)
        in_args = "process_group" not in kwargs
        group = args[1] if in_args else kwargs["process_group"]
        scope = self._scope
        key = (id(group), "all_gather", scope)
        call = self._streams.get(key)
        if call is None:  # shared with the plain-tensor gathers of the same scope: the same site
            call = self._streams[key] = self._stream_call(group, "all_gather", scope)
        if call is ONE_RANK:
            return orig(*args, **kwargs)
        site_id = call.site_id or call.stream.next_id()
        route = self._routes.get(site_id) or self._resolve(site_id, call.info)
        if route[0] is not None:
            self.calls_routed += 1
            if route[1] is not None:
                if in_args:
                    args = (args[0], route[1]) + args[2:]
                else:
                    kwargs = dict(kwargs, process_group=route[1])
        gathered: list[Any] | None = [] if self.registry.recording else None
        profiler = self.profiler
        timed = profiler.timed
        if timed:
            profiler.poll()
        self._scope = ("coalesced", gathered)
        t0 = profiler.mark() if timed else None
        try:
            out, handle = orig(*args, **kwargs)
        finally:
            self._scope = scope
        if gathered is not None:
            _record_gathered(self.registry, site_id, gathered, call.info)
        if timed:
            if handle is None:  # TE fell back to a synchronous high-precision gather (``:1127-1134``)
                profiler.sync(site_id, t0)
            else:
                handle = profiler.issue(site_id, handle, t0)
        return out, handle

    def coalesced_call(self, op: str, orig: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A collective inside ``quantized_gather``: all-gathers counted, passed through on the helper's group."""
        gathered = self._scope[1]
        if gathered is not None and op == "all_gather":
            gathered.append(kwargs["output_tensor"] if "output_tensor" in kwargs else args[0])
        return orig(*args, **kwargs)
