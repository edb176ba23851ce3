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
from lagom_megatron.megatron.apply import Applier  # noqa: E402
from lagom_megatron.nccl.rules import NcclRules  # noqa: E402

from .test_router import _iteration, _router  # noqa: E402


class NcclRefusal(RuntimeError):
    """What torch raises when NCCL returns ncclInvalidUsage from an enqueue (a DistBackendError)."""


def _bucket_group(tensors, *, average=False, nccl_ub=False, distopt=True, group=None):
    """A megatron-core ``_ParamAndGradBucketGroup`` as the router reads it in ``start_grad_sync``."""
    ddp = types.SimpleNamespace(use_distributed_optimizer=distopt, average_in_collective=average, nccl_ub=nccl_ub)
    return types.SimpleNamespace(buckets=[types.SimpleNamespace(grad_data=t, param_data=t) for t in tensors],
                                 ddp_config=ddp, is_first_batch=False, grad_reduce_handle=None,
                                 param_gather_handle=None, intra_distributed_optimizer_instance_group=group,
                                 data_parallel_group=group)


def test_the_router_records_the_reduction_and_the_buckets():
    router, registry, tp, _ = _router()
    bg = _bucket_group([torch.zeros(8, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.uint8)], average=True, group=tp)
    registry._bucket_tags[id(bg)] = "chunk0.bucket0"

    def start_grad_sync(self, force_all_reduce=False):
        return None

    t = torch.zeros(4)
    calls = [lambda: router.bucket_sync(bg, "grad", start_grad_sync, (), {}),
             lambda: router.collective("all_reduce", lambda *a, **k: "w", (t, torch.distributed.ReduceOp.MAX, tp, True), {}),
             lambda: router.collective("reduce_scatter", lambda *a, **k: "w", (t, t), {"group": tp, "async_op": True})]
    _iteration(router, registry, calls)
    sites = {s.site_id: s for s in registry.sites()}
    rs = sites["tp.grad_reduce_scatter[chunk0.bucket0]"]
    assert (rs.reduce_op, rs.parts, rs.registered) == ("avg", (("bfloat16", 16), ("uint8", 4)), "")
    assert sites["tp.dgrad_all_reduce[0]"].reduce_op == "max"
    assert sites["tp.sp_reduce_scatter[0]"].reduce_op == "sum"  # torch's default op


@pytest.mark.parametrize("op, reduce_op, dtype, nvls", [
    ("reduce_scatter", "sum", "bfloat16", True),
    ("reduce_scatter", "avg", "bfloat16", False),       # --ddp-average-in-collective: ncclAvg
    ("all_reduce", "sum", "float8_e4m3fn", False),      # FP8: not in ncclNvlsSupported
    ("all_reduce", "max", "float32", False),            # fp32 reduces with NVLS for sum only
    ("all_reduce", None, "bfloat16", False),            # reduction not recorded: never forced
    ("all_gather", None, "uint8", True),                # all-gather runs NVLS whatever its dtype
])
def test_nvls_stays_out_of_the_domain_of_a_reduction_nccl_has_none_for(op, reduce_op, dtype, nvls):
    from lagom_megatron.engine.profile import CollectiveSite

    rules = NcclRules(ClusterSpec.load("h100-sxm-ib400"), mechanism="communicator")
    site = CollectiveSite(site_id="dp.x[0]", op=op, nbytes=64 << 20, dtype=dtype, group="dp", group_size=8,
                          reduce_op=reduce_op)
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
    pool = types.SimpleNamespace(backend=types.SimpleNamespace(name="gloo"), prepare=lambda *a, **k: 0,
                                 entries=lambda: [], describe=lambda: "1 entry", destroy=lambda keep=None: 1, live=1)
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
    pool = types.SimpleNamespace(backend=types.SimpleNamespace(name="gloo"), prepare=lambda *a, **k: 0,
                                 entries=lambda: [], describe=lambda: "", destroy=lambda keep=None: 0, live=0)
    applier = Applier(pool=pool, router=router, files=None, cluster=None)
    applier.apply({}, what="probes")
    assert applier.check_first_use() and router.first_use.armed  # nothing routed yet: still guarding
    router.set_assignment({"tp.dgrad_all_reduce[0]": CommConfig(n_channels=2)})
    _iteration(router, registry, [call])
    assert applier.check_first_use() and not router.first_use.armed and applier.error is None
