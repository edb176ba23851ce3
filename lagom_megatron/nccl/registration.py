"""Whether registering a site's buffers (Megatron's ``--use-nccl-ub``) is possible here, and what it lets NCCL run:
its symmetric kernels, or copy-engine collectives on a pool entry whose ``ncclConfig_t.CTAPolicy`` is ZERO.

Every rule returns None when allowed, else one line naming the bad value and what is allowed. Sources:
megatron-core 0.16.1 and core_v0.19.0 (``megatron/core/...``), NVIDIA/nccl at the tags cited (``src/...``).
What a cluster file cannot say is assumed, and said: with no capabilities of a live run, torch 2.9 or newer (symmetric
windows) and a CUDA driver 12.5 or newer (copy engines); megatron-core 0.18 or newer (a pool entry registers the
same memory) unless the site says its buffers are registered only on the group's own communicator (``fixed``)."""

from __future__ import annotations

from typing import Any

from lagom_megatron.engine.cluster import ClusterSpec, release
from lagom_megatron.engine.knobs import Registration

REGISTERED_GROUPS: tuple[str, ...] = ("dp", "dp_cp", "intra_dist_opt", "expt_dp")
"""lagom's names (``megatron.groups``) of the groups whose buffers megatron-core registers under ``nccl_ub``: DDP
allocates each param-and-grad buffer in an NCCL memory pool registered with the buffer's ``data_parallel_group``
(core_v0.16.1 ``distributed/param_and_grad_buffer.py:753-770``, core_v0.19.0 ``:1129-1150``), which is the intra
distributed-optimizer data-parallel group with context parallel (``dp`` / ``dp_cp`` with one optimizer instance,
``intra_dist_opt`` with several) or, for expert parameters, the expert data-parallel one (``expt_dp``) (core_v0.16.1
``distributed/distributed_data_parallel.py:291-301``, core_v0.19.0 ``:218-226``). Megatron-FSDP registers its
FSDP group and, for experts, the expert FSDP group (core_v0.19.0
``distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:2068-2096``), the same ranks."""

BUFFER_OPS: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather")
"""The registered buffers' own collectives, input and output both in the pool: the gradients' all-reduce or
reduce-scatter and the parameters' all-gather (DDP ``start_grad_sync`` / ``start_param_sync``, Megatron-FSDP's
bucket gathers and reductions). Not the all-to-all of ``--ddp-reduce-scatter-with-fp32-accumulation``: its output is
a fresh ``torch.empty_like`` outside the pool (``distributed/reduce_scatter_with_fp32_accumulation.py:77`` at both
versions)."""

SYMMETRIC_TORCH = (2, 9)
"""megatron-core asks torch 2.9.0a0+ for symmetric windows, else falls back to local registration
(``nccl_allocator.py:116-122`` at core_v0.16.1 and core_v0.19.0)."""

SYMK_NCCL = (2, 27, 0)
SYMK_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
"""``ncclSymkImplemented`` (v2.30.7-1 ``src/sym_kernels.cc:511-537``; v2.27.7-1 ``src/symmetric.cc:197-219``):
AllGather any type; AllReduce and ReduceScatter a sum (or average, ``SumPostDiv``) of a float type but float64."""
SYMK_FLOATS: tuple[str, ...] = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
SYMK_REDUCTIONS: tuple[str, ...] = ("sum", "avg")

CE_NCCL = (2, 28, 0)
"""Copy-engine collectives appear in NCCL 2.28 (v2.28.9-1 ``src/enqueue.cc:2577-2581``; ``src/ce_coll.cc`` absent at
v2.27.7-1)."""
CE_OBSERVED_NCCL = (2, 29, 0)
"""First NCCL whose profiler reports a copy-engine collective (``ceColl`` events, profiler ABI v6: v2.30.7-1
``src/plugin/profiler.cc:823-850``): lagom offers copy engines only where its observed check can see them run."""
CE_OPS: tuple[str, ...] = ("all_gather", "all_to_all")
"""lagom's ops among ``ncclCeImplemented``'s AllGather, AlltoAll, Scatter, Gather (v2.30.7-1 ``src/ce_coll.cc:93-110``)."""
CE_DRIVER = 12050
"""``ncclCeImplemented`` needs CUDA driver 12.5 (``ce_coll.cc:97-98`` @v2.30.7-1); no record of lagom holds the
driver version, so it is assumed."""
HIER_CE_NCCL = (2, 30, 7)
"""Hierarchical copy engines across nodes (``ncclHierCeAvailable``, v2.30.7-1 ``src/ce_coll.cc:719-760``; absent at
v2.30.4-1)."""


def _v(version: tuple[int, ...]) -> str:
    """``(2, 28, 0)`` -> ``2.28``, ``(2, 30, 7)`` -> ``2.30.7``."""
    return ".".join(map(str, version[:2] if version[2:] == (0,) else version))


def buffers_problem(site: Any) -> str | None:
    """Why megatron-core does not register ``site``'s buffers under ``nccl_ub``, or None (group and op)."""
    if site.group not in REGISTERED_GROUPS:
        return (
            f"group {site.group!r} holds no buffer megatron-core registers under --use-nccl-ub; allowed: "
            f"{list(REGISTERED_GROUPS)} (the data-parallel groups of its param-and-grad buffers)"
        )
    if site.op not in BUFFER_OPS:
        why = (
            "its output is allocated outside the registered pool"
            if site.op == "all_to_all"
            else "not a collective of the registered buffers"
        )
        return f"op {site.op!r} of group {site.group!r}: {why}; allowed: {list(BUFFER_OPS)}"
    return None


def symmetric_registration_problem(capabilities: Any = None) -> str | None:
    """Why megatron-core registers buffers locally, not as symmetric windows (torch below 2.9), or None; None also
    where the torch version is unknown (no ``capabilities``): torch 2.9 or newer is then assumed."""
    torch_version = getattr(capabilities, "torch_version", None)
    if not torch_version:
        return None
    try:
        found = release(torch_version)
    except ValueError:
        return f"torch {torch_version!r} has no version number; symmetric windows need torch >= {_v(SYMMETRIC_TORCH)}"
    if found[:2] < SYMMETRIC_TORCH:
        return (
            f"torch {torch_version}: megatron-core registers its buffers locally, not as symmetric windows "
            f"(nccl_allocator.py:116-122); allowed: torch >= {_v(SYMMETRIC_TORCH)}"
        )
    return None


def symmetric_kernel_problem(cluster: ClusterSpec, site: Any) -> str | None:
    """Why NCCL would not run ``site`` on its symmetric kernels with both buffers in symmetric windows, or None.

    NCCL 2.27+: ``ncclSymkImplemented`` (``SYMK_OPS``), an all-direct-NVLink communicator (``ncclSymkAvailable``,
    v2.30.7-1 ``src/sym_kernels.cc:591-597``) on one node, where the LSA team is every rank (across nodes the mask
    keeps only GIN kernels, ``sym_kernels.cc:584-587``); 2.28+ takes any call (``ncclMakeSymmetricTaskList``, v2.28.9
    ``src/enqueue.cc:360-362``, ``src/scheduler/symmetric_sched.cc:26-35``), 2.27 a lone collective on one node
    (v2.27.7-1 ``src/enqueue.cc:338-360``, ``symmetricSupport`` ``src/init.cc:1250``). NVSwitch nodes only: a
    bridged pair is all-direct NVLink only for a two-rank group on one bridge, which a cluster file cannot tell."""
    v = cluster.nccl
    if site.op not in SYMK_OPS:
        return f"op {site.op!r} has no symmetric kernel (ncclSymkImplemented); allowed: {list(SYMK_OPS)}"
    if site.op != "all_gather":
        reduce_op, dtype = getattr(site, "reduce_op", None), getattr(site, "dtype", None)
        if reduce_op is not None and reduce_op not in SYMK_REDUCTIONS:
            return f"reduction {reduce_op!r} has no symmetric kernel; allowed: {list(SYMK_REDUCTIONS)}"
        if dtype and dtype != "unknown" and dtype not in SYMK_FLOATS:
            return f"dtype {dtype!r} has no symmetric {site.op} kernel; allowed: {list(SYMK_FLOATS)}"
    if cluster.intra_link != "nvlink" or not cluster.nvswitch:
        link = "NVLink without NVSwitch"
        if cluster.intra_link == "pcie":
            link = "NVLink-bridged pairs over PCIe" if cluster.nvlink_bridge_gbps else "PCIe"
        return (
            f"cluster {cluster.name!r} links its GPUs by {link}: symmetric kernels need every rank on direct "
            "NVLink (isAllDirectNvlink); allowed: NVSwitch nodes"
        )
    if v < SYMK_NCCL:
        return f"NCCL {cluster.nccl_version} has no symmetric kernels; allowed: NCCL >= {_v(SYMK_NCCL)}"
    if (
        cluster.sm_arch < 90
    ):  # every kernel is built under __CUDA_ARCH__ >= 900 (v2.30.7-1 src/device/symmetric/generate.py:176)
        return f"sm_{cluster.sm_arch} GPUs have no symmetric kernels (NCCL builds them for sm_90+); allowed: sm_90+"
    nodes = cluster.nccl_nodes(site.n_nodes, site.group_size)
    if nodes > 1:
        return (
            f"group spans {nodes} NCCL nodes: across nodes NCCL has only its GIN symmetric kernels (network "
            "put/get), which lagom does not assume; allowed: a group within one node or NVLink domain"
        )
    parts = len(getattr(site, "parts", ()) or ())
    if v < (2, 28, 0) and parts > 1:
        return (
            f"NCCL {cluster.nccl_version} runs symmetric kernels only for a lone collective; this call coalesces "
            f"{parts} tensors; allowed: NCCL >= 2.28 or one tensor"
        )
    return None


def copy_engine_problem(
    cluster: ClusterSpec,
    *,
    op: str,
    n_nodes: int = 1,
    group_size: int | None = None,
    cta_scope: str | None = "communicator",
    capabilities: Any = None,
    registered: str = "",
) -> str | None:
    """Why a pool entry with ``cta_policy`` ZERO would not run ``op`` on copy engines, or None.

    NCCL appends a CE task when the communicator's CTAPolicy has ZERO and ``ncclCeAvailable`` (v2.30.7-1
    ``src/enqueue.cc:3050-3055``): ``ncclCeImplemented`` (``CE_OPS``, driver 12.5), the LSA (load/store) team is
    every rank, ``comm->symmetricSupport`` (all CUDA P2P, ``src/init.cc:1674-1675``) and a registered receive window
    (``src/ce_coll.cc:112-131``). The LSA team is one node or one MNNVL domain (``src/dev_runtime.cc:79-104``);
    across them only ``ncclHierCeAvailable`` (2.30.7+), which needs a host RMA proxy (``ce_coll.cc:750-754``) that no
    cluster file records: refused. Only NVSwitch nodes: over PCIe peer-to-peer the cluster file does not say that
    every pair has CUDA P2P. ``cta_scope``: what the mechanism sets ``cta_policy`` per (``NcclRules.scope``)."""
    v = cluster.nccl
    if op not in CE_OPS:
        return f"op {op!r} has no copy-engine collective (ncclCeImplemented); allowed: {list(CE_OPS)}"
    if cluster.intra_link == "pcie":
        link = "NVLink-bridged pairs over PCIe" if cluster.nvlink_bridge_gbps else "PCIe"
        return (
            f"cluster {cluster.name!r} links its GPUs by {link} (intra_link 'pcie'): copy engines need every rank "
            "in one NVLink load/store team; allowed: NVSwitch nodes"
        )
    if not cluster.nvswitch:
        return (
            f"cluster {cluster.name!r} has no NVSwitch: copy engines need every rank in one NVLink load/store team; "
            "allowed: NVSwitch nodes"
        )
    if v < CE_NCCL:
        return f"NCCL {cluster.nccl_version} has no copy-engine collectives; allowed: NCCL >= {_v(CE_NCCL)}"
    if v < CE_OBSERVED_NCCL:
        return (
            f"NCCL {cluster.nccl_version} runs copy engines but reports no profiler event for them, so lagom could "
            f"not tell that they ran (silent fallback to SMs); allowed: NCCL >= {_v(CE_OBSERVED_NCCL)}"
        )
    nodes = cluster.nccl_nodes(n_nodes, group_size or max(2, n_nodes * cluster.gpus_per_node))
    if nodes > 1:
        hier = (
            f"NCCL {cluster.nccl_version}'s hierarchical copy engines need a host RMA proxy that the cluster file "
            "does not record"
            if v >= HIER_CE_NCCL
            else f"hierarchical copy engines need NCCL >= {_v(HIER_CE_NCCL)} and a host RMA proxy"
        )
        return f"group spans {nodes} NCCL nodes: {hier}; allowed: a group within one node or NVLink domain"
    if cta_scope != "communicator":
        return (
            "the mechanism cannot set a CTA policy per communicator (NCCL_CTA_POLICY would hit every one); "
            "allowed: mechanism 'tuner' or 'communicator' (a pool entry's ncclConfig_t.CTAPolicy)"
        )
    if capabilities is not None:
        fixed = capabilities.fixed_knobs().get("cta_policy")
        if fixed:
            return f"{fixed} sets every communicator's CTA policy (src/init.cc:2160-2167 @v2.30.7-1); allowed: unset"
        if "cta_policy" not in capabilities.config_fields:
            return (
                f"torch {capabilities.torch_version} binds no ncclConfig_t.CTAPolicy; allowed: a torch whose "
                "ProcessGroupNCCL.Options config has cta_policy (2.8+)"
            )
    symm = symmetric_registration_problem(capabilities)
    if symm:
        return f"copy engines need a registered receive window: {symm}"
    if registered == "fixed":
        return (
            "megatron-core keeps no handle on its NCCL memory pool (before 0.18; core_v0.18.0 "
            "param_and_grad_buffer.py:1074), so a pool entry cannot register it; allowed: megatron-core >= 0.18"
        )
    if registered == "pool":  # registered, but not in a window: NCCL would run the call on SMs (ce_coll.cc:126-129)
        return (
            "megatron-core registered the buffers without symmetric windows (--disable-symmetric-registration or "
            "torch < 2.9), which copy engines need; allowed: symmetric registration"
        )
    return None


def registration(
    cluster: ClusterSpec, site: Any, *, cta_scope: str | None = "communicator", capabilities: Any = None
) -> Registration | None:
    """``KnobRules.registration`` on NCCL: None where megatron-core does not register ``site``'s buffers (its group
    or op, ``buffers_problem``); else what registering them lets NCCL run."""
    if cluster.backend != "nccl" or buffers_problem(site) is not None:
        return None
    symm = symmetric_registration_problem(capabilities) is None
    ce = copy_engine_problem(
        cluster,
        op=site.op,
        n_nodes=site.n_nodes,
        group_size=site.group_size,
        cta_scope=cta_scope,
        capabilities=capabilities,
        registered=getattr(site, "registered", ""),
    )
    return Registration(
        symmetric_kernels=symm and symmetric_kernel_problem(cluster, site) is None,
        copy_engine=ce is None,
    )


def plan_registration_problem(plan: Any, rules: Any) -> str | None:
    """Why ``plan`` cannot run under ``rules``: a ``registered_groups`` name megatron-core does not register, or an
    entry with ``cta_policy`` ZERO whose buffers the plan does not register (or cannot: ``buffers_problem``); the
    entries' own values are ``rules.validate``'s. One line naming the group or site, or None."""
    groups = tuple(getattr(plan, "registered_groups", ()) or ())
    cluster = rules.cluster
    if groups and cluster.backend != "nccl":
        return (
            f"registered_groups {list(groups)}: {cluster.backend} cluster {cluster.name!r} registers no NCCL "
            "buffers; allowed: none"
        )
    for g in groups:
        if g not in REGISTERED_GROUPS:
            return (
                f"registered_groups: group {g!r} holds no buffer megatron-core registers under --use-nccl-ub; "
                f"allowed: {list(REGISTERED_GROUPS)}"
            )
    for site_id, e in plan.entries.items():
        if e.config.cta_policy != "ZERO":
            continue
        why = buffers_problem(e)
        if why is None and e.group not in groups:
            why = (
                f"the plan does not register group {e.group!r} (copy engines need its buffers registered); "
                f"allowed: {e.group!r} in registered_groups (now {list(groups)})"
            )
        if why:
            return f"entry {site_id!r}: cta_policy 'ZERO': {why}"
    return None
