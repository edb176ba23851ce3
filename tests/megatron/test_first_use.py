"""What a call tells the search, and what happens when NCCL refuses a call on a pool entry.

* The router records the reduction of a call as torch's functions and megatron-core's
  ``start_grad_sync`` pass it (torch 2.13 ``all_reduce(tensor, op, group, async_op)``; core_v0.16.1
  ``param_and_grad_buffer.py:395-397``: ``ReduceOp.AVG`` with ``average_in_collective``) and the
  (dtype, bytes) of a bucket group's buckets; the rules then keep NVLS out of the domain of an
  averaging or FP8 reduction (``ncclNvlsSupported``, NVIDIA/nccl v2.30.7 ``src/include/device.h:587-601``).
* A call NCCL refuses on its entry (``ncclInvalidUsage`` at enqueue, ``src/enqueue.cc:2052-2066``,
  which ``ProcessGroupNCCL`` raises from the collective call) is issued again on its own group, and
  the check at the iteration's end reverts to NCCL's defaults (``megatron.first_use``).
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from lagom_megatron.engine.cluster import ClusterSpec  # noqa: E402
from lagom_megatron.engine.knobs import CommConfig  # noqa: E402
from lagom_megatron.megatron.control.apply import Applier  # noqa: E402
from lagom_megatron.nccl.rules import NcclRules  # noqa: E402

from .test_router import _iteration, _router  # noqa: E402


class NcclRefusal(RuntimeError):
    """What torch raises when NCCL returns ncclInvalidUsage from an enqueue (a DistBackendError)."""


def _bucket_group(tensors, *, average=False, nccl_ub=False, distopt=True, group=None):
    """A megatron-core ``_ParamAndGradBucketGroup`` as the router reads it in ``start_grad_sync``."""
    ddp = types.SimpleNamespace(use_distributed_optimizer=distopt, average_in_collective=average, nccl_ub=nccl_ub)
    return types.SimpleNamespace(
        buckets=[types.SimpleNamespace(grad_data=t, param_data=t) for t in tensors],
        ddp_config=ddp,
        is_first_batch=False,
        grad_reduce_handle=None,
        param_gather_handle=None,
        intra_distributed_optimizer_instance_group=group,
        data_parallel_group=group,
    )


def test_the_router_records_the_reduction_and_the_buckets():
    router, registry, tp, _ = _router()
    bg = _bucket_group(
        [torch.zeros(8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.uint8)], average=True, group=tp
    )
    registry._bucket_tags[id(bg)] = "chunk0.bucket0"

    def start_grad_sync(self, force_all_reduce=False):
        return None

    t = torch.zeros(4)
    calls = [
        lambda: router.bucket_sync(bg, "grad", start_grad_sync, (), {}),
        lambda: router.collective("all_reduce", lambda *a, **k: "w", (t, torch.distributed.ReduceOp.MAX, tp, True), {}),
        lambda: router.collective("reduce_scatter", lambda *a, **k: "w", (t, t), {"group": tp, "async_op": True}),
    ]
    _iteration(router, registry, calls)
    sites = {s.site_id: s for s in registry.sites()}
    rs = sites["tp.grad_reduce_scatter[chunk0.bucket0]"]
    assert (rs.reduce_op, rs.parts, rs.registered) == ("avg", (("bfloat16", 16), ("uint8", 4)), "")
    assert sites["tp.dgrad_all_reduce[0]"].reduce_op == "max"
    assert sites["tp.sp_reduce_scatter[0]"].reduce_op == "sum"  # torch's default op


@pytest.mark.parametrize(
    "op, reduce_op, dtype, nvls",
    [
        ("reduce_scatter", "sum", "bfloat16", True),
        ("reduce_scatter", "avg", "bfloat16", False),  # --ddp-average-in-collective: ncclAvg
        ("all_reduce", "sum", "float8_e4m3fn", False),  # FP8: not in ncclNvlsSupported
        ("all_reduce", "max", "float32", False),  # fp32 reduces with NVLS for sum only
        ("all_reduce", None, "bfloat16", False),  # reduction not recorded: never forced
        ("all_gather", None, "uint8", True),  # all-gather runs NVLS whatever its dtype
    ],
)
def test_nvls_stays_out_of_the_domain_of_a_reduction_nccl_has_none_for(op, reduce_op, dtype, nvls):
    from lagom_megatron.engine.profile import CollectiveSite

    rules = NcclRules(ClusterSpec.load("h100-sxm-ib400"), mechanism="communicator")
    site = CollectiveSite(
        site_id="dp.x[0]", op=op, nbytes=64 << 20, dtype=dtype, group="dp", group_size=8, reduce_op=reduce_op
    )
    d, note = rules.site_domains(site)
    assert ("NVLS" in d["algorithm"]) is nvls, d["algorithm"]
    assert ("no NVLS" in note) is (not nvls)
    if not nvls:  # the plan validator refuses it too, naming why
        with pytest.raises(ValueError, match="no NVLS"):
            rules.validate(CommConfig(algorithm="NVLS"), op=op, group_size=8, reduce_op=reduce_op, dtype=dtype)


def test_a_call_nccl_refuses_on_its_entry_runs_on_its_own_group_and_reverts_every_rank():
    router, registry, tp, _ = _router()
    seen = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(group)
        if group != tp:
            raise NcclRefusal("NCCL error: invalid usage (No algorithm/protocol available for function AllReduce)")
        return "work"

    t = torch.zeros(4)
    call = lambda: router.collective("all_reduce", all_reduce, (t,), {"group": tp, "async_op": True})  # noqa: E731
    _iteration(router, registry, [call, call])
    router.set_assignment({"tp.dgrad_all_reduce[0]": CommConfig(n_channels=3, algorithm="NVLS")})
    pool = types.SimpleNamespace(
        backend=types.SimpleNamespace(name="gloo"),
        prepare=lambda *a, **k: 0,
        entries=lambda: [],
        describe=lambda: "1 entry",
        destroy=lambda keep=None: 1,
        live=1,
    )
    applier = Applier(pool=pool, router=router, files=None, cluster=None)
    assert applier.apply({"tp": {CommConfig(n_channels=3)}}, what="a plan") and router.first_use.armed
    seen.clear()
    assert _iteration(router, registry, [call, call]) == ["work", "work"]  # the step completes
    entry = ("entry", "tp", 3)
    assert seen == [entry, tp, tp]  # refused on the entry, issued again on tp; its next call goes to tp at once
    assert not applier.check_first_use()  # the collective check: every rank reverts
    assert router.assignment == {} and not router.first_use.armed
    assert "NCCL refused 1 call(s) on their pool entries: tp.dgrad_all_reduce[0]: NcclRefusal" in applier.error


def test_first_calls_that_succeed_end_the_guard_after_an_iteration_that_routed():
    router, registry, tp, _ = _router()
    t = torch.zeros(4)
    call = lambda: router.collective("all_reduce", lambda *a, **k: "w", (t,), {"group": tp, "async_op": True})  # noqa: E731
    _iteration(router, registry, [call])
    pool = types.SimpleNamespace(
        backend=types.SimpleNamespace(name="gloo"),
        prepare=lambda *a, **k: 0,
        entries=lambda: [],
        describe=lambda: "",
        destroy=lambda keep=None: 0,
        live=0,
    )
    applier = Applier(pool=pool, router=router, files=None, cluster=None)
    applier.apply({}, what="probes")
    assert applier.check_first_use() and router.first_use.armed  # nothing routed yet: still guarding
    router.set_assignment({"tp.dgrad_all_reduce[0]": CommConfig(n_channels=2)})
    _iteration(router, registry, [call])
    assert applier.check_first_use() and not router.first_use.armed and applier.error is None


class _Coalescing:
    """torch 2.13's ``_coalescing_manager`` (``distributed_c10d.py:2837-2935``) as megatron-core's
    bucket groups use it (no device: the fast path): calls on an open group are queued, the
    ``*_coalesced`` call at the exit issues them, and an asynchronous manager's handle gets its work.
    NCCL refuses the group on ``refuse`` (the exit raises, as ``AutoNcclGroup``'s destructor does)."""

    def __init__(self, refuse):
        self.queued, self.issued, self.refuse = {}, [], refuse

    def manager(self, group=None, device=None, async_ops=False):
        import contextlib

        @contextlib.contextmanager
        def cm_gen():
            self.queued[group] = []
            cm = types.SimpleNamespace(works=[])
            cm.append = lambda work=None: work and cm.works.append(work)
            yield cm
            ops = self.queued.pop(group)
            if ops and group == self.refuse:
                raise RuntimeError("NCCL Error 5: invalid usage (run with NCCL_DEBUG=WARN for details)")
            self.issued.append((group, ops))
            if async_ops:
                cm.append(("work", group))

        return cm_gen()

    def reduce_scatter(self, output, input, op=None, group=None, async_op=False):
        self.queued[group].append(input)


def _start_grad_sync(pgb, reduce_scatter):
    """megatron-core core_v0.16.1 ``start_grad_sync`` (``param_and_grad_buffer.py:364-500``): the
    gradients are scaled before the coalescing manager opens, the collectives are queued in it, and
    an asynchronous call keeps the manager as its handle. ``pgb._coalescing_manager`` is the module
    name megatron-core looks up at call time (lagom patches it)."""

    def start_grad_sync(self, force_all_reduce=False):
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        group = self.intra_distributed_optimizer_instance_group
        with pgb._coalescing_manager(group, async_ops=True) as cm:
            for bucket in self.buckets:
                reduce_scatter(bucket.grad_data[:2], bucket.grad_data, op=None, group=group, async_op=True)
        self.grad_reduce_handle = cm

    return start_grad_sync


def test_a_bucket_group_nccl_refuses_scales_its_gradients_once_and_runs_on_its_own_group():
    router, registry, tp, _ = _router()
    entry = ("entry", "tp", 3)
    torch_cm = _Coalescing(refuse=entry)
    pgb = types.SimpleNamespace()
    pgb._coalescing_manager = lambda *a, **k: router.bucket_coalescing(torch_cm.manager, a, k)  # as patched
    rs = lambda *a, **k: router.collective("reduce_scatter", torch_cm.reduce_scatter, a, k)  # noqa: E731
    grad = torch.full((4,), 8.0)
    bg = _bucket_group([grad], group=tp)
    bg.buckets[0].gradient_scaling_factor = 0.5  # 1 / data-parallel size without average_in_collective
    registry._bucket_tags[id(bg)] = "chunk0.bucket0"
    sync = _start_grad_sync(pgb, rs)

    def call():
        bg.grad_reduce_handle = None
        return router.bucket_sync(bg, "grad", sync, (), {})

    _iteration(router, registry, [call])
    grad.fill_(8.0)
    router.set_assignment({"tp.grad_reduce_scatter[chunk0.bucket0]": CommConfig(n_channels=3, algorithm="NVLS")})
    pool = types.SimpleNamespace(
        backend=types.SimpleNamespace(name="gloo"),
        prepare=lambda *a, **k: 0,
        entries=lambda: [],
        describe=lambda: "1 entry",
        destroy=lambda keep=None: 1,
        live=1,
    )
    applier = Applier(pool=pool, router=router, files=None, cluster=None)
    assert applier.apply({"tp": {CommConfig(n_channels=3)}}, what="a plan") and router.first_use.armed
    torch_cm.issued.clear()
    _iteration(router, registry, [call])
    assert grad.tolist() == [4.0] * 4  # scaled once: the refused manager is not re-entered through start_grad_sync
    assert [g for g, _ in torch_cm.issued] == [tp] and torch_cm.issued[0][1][0] is grad  # the same buffer, on tp
    assert bg.grad_reduce_handle.works == [("work", tp)]  # Megatron waits the own group's work
    assert bg.intra_distributed_optimizer_instance_group is tp and router.first_use.pending is None
    _iteration(router, registry, [call])  # the refused site's next call goes to tp at once
    assert [g for g, _ in torch_cm.issued] == [tp, tp] and grad.tolist() == [2.0] * 4
    assert not applier.check_first_use() and router.assignment == {}
    assert "NCCL refused 1 call(s) on their pool entries: tp.grad_reduce_scatter[chunk0.bucket0]" in applier.error


def test_an_error_that_is_not_nccls_refusal_is_raised_never_issued_again():
    router, registry, tp, _ = _router()
    seen = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(group)
        if group != tp:  # one rank's own failure: re-issuing it on tp alone would pair other communicators' calls
            raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, unhandled cuda error (run with NCCL_DEBUG=INFO)")
        return "work"

    t = torch.zeros(4)
    call = lambda: router.collective("all_reduce", all_reduce, (t,), {"group": tp, "async_op": True})  # noqa: E731
    _iteration(router, registry, [call])
    router.set_assignment({"tp.dgrad_all_reduce[0]": CommConfig(n_channels=3)})
    router.first_use.arm()
    seen.clear()
    with pytest.raises(RuntimeError, match="unhandled cuda error"):
        _iteration(router, registry, [call])
    assert seen == [("entry", "tp", 3)] and router.first_use.failures == []
