"""Registered buffers: which groups megatron-core registers, where NCCL runs symmetric kernels or copy engines on them
(per NCCL version and hardware), and plans that choose copy engines where they cannot run, refused by the readers."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lagom_megatron.cli.main import main
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import CommConfig, Registration
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.megatron.pool.gloo import GlooRules
from lagom_megatron.nccl.capabilities import Capabilities
from lagom_megatron.nccl.registration import (
    buffers_problem,
    copy_engine_problem,
    plan_registration_problem,
    symmetric_kernel_problem,
    symmetric_registration_problem,
)
from lagom_megatron.nccl.rules import NcclRules, symmetric_kernels

H100, A100 = ClusterSpec.load("h100-sxm-ib400"), ClusterSpec.load("a100-ib100")  # NVSwitch nodes
A40_PCIE, A40_BRIDGED = ClusterSpec.load("a40-pcie-ib200"), ClusterSpec.load("a40-nvlink-ib800")

NO_SYMK_PCIE = (
    "cluster 'a40-pcie-ib200' links its GPUs by PCIe: symmetric kernels need every rank on direct NVLink "
    "(isAllDirectNvlink); allowed: NVSwitch nodes"
)
NO_SYMK_BRIDGED = (
    "cluster 'a40-nvlink-ib800' links its GPUs by NVLink-bridged pairs over PCIe: symmetric kernels need every rank "
    "on direct NVLink (isAllDirectNvlink); allowed: NVSwitch nodes"
)
NO_SYMK_NODES = (
    "group spans 2 NCCL nodes: across nodes NCCL has only its GIN symmetric kernels (network put/get), which lagom "
    "does not assume; allowed: a group within one node or NVLink domain"
)
NO_CE_PCIE = (
    "cluster 'a40-pcie-ib200' links its GPUs by PCIe (intra_link 'pcie'): copy engines need every rank in one "
    "NVLink load/store team; allowed: NVSwitch nodes"
)
NO_CE_BRIDGED = (
    "cluster 'a40-nvlink-ib800' links its GPUs by NVLink-bridged pairs over PCIe (intra_link 'pcie'): copy engines "
    "need every rank in one NVLink load/store team; allowed: NVSwitch nodes"
)


def _at(cluster: ClusterSpec, version: str) -> ClusterSpec:
    return dataclasses.replace(cluster, nccl_version=version)


def _site(op="all_gather", group="dp", nodes=1, **kw):
    """A data-parallel bucket site of 8 ranks per node (the presets' nodes)."""
    reduce_op = None if op == "all_gather" else "sum"
    return CollectiveSite(
        site_id=f"{group}.{op}[chunk0.bucket0]",
        op=op,
        nbytes=64 << 20,
        dtype="bfloat16",
        group=group,
        group_size=8 * nodes,
        n_nodes=nodes,
        reduce_op=reduce_op,
        **kw,
    )


def _caps(torch="2.9.1", fields=("cta_policy",), overrides=()):
    return Capabilities(
        torch_version=torch,
        nccl_version=(2, 28, 9),
        config_fields=fields,
        plugin_loaded=True,
        plugin_abi=5,
        nvls_multicast=True,
        collnet=False,
        overrides=overrides,
    )


@pytest.mark.parametrize(
    "cluster, version, nodes, reason",
    [
        (H100, "2.26.6", 1, "NCCL 2.26.6 has no symmetric kernels; allowed: NCCL >= 2.27"),
        (H100, "2.27.5", 1, None),
        (H100, "2.28.9", 1, None),
        (H100, "2.30.7", 1, None),
        (H100, "2.28.9", 2, NO_SYMK_NODES),
        (H100, "2.30.7", 2, NO_SYMK_NODES),
        (A100, "2.26.6", 1, "NCCL 2.26.6 has no symmetric kernels; allowed: NCCL >= 2.27"),
        (A100, "2.28.9", 1, "sm_80 GPUs have no symmetric kernels (NCCL builds them for sm_90+); allowed: sm_90+"),
        (A40_PCIE, "2.26.6", 1, NO_SYMK_PCIE),
        (A40_PCIE, "2.30.7", 1, NO_SYMK_PCIE),
        (A40_BRIDGED, "2.28.9", 1, NO_SYMK_BRIDGED),
        (A40_BRIDGED, "2.30.7", 1, NO_SYMK_BRIDGED),
    ],
)
def test_symmetric_kernels_per_nccl_version_and_hardware(cluster, version, nodes, reason):
    """NCCL 2.27+ on an all-direct-NVLink communicator within one node (``ncclSymkAvailable``, v2.30.7-1
    ``sym_kernels.cc:591-597``; across nodes only GIN kernels, ``:584-587``); the rules' bool agrees."""
    c = _at(cluster, version)
    site = _site("reduce_scatter", nodes=nodes)
    assert symmetric_kernel_problem(c, site) == reason
    assert symmetric_kernels(c, site) is (reason is None)


def test_symmetric_kernels_only_for_the_ops_types_and_calls_nccl_implements():
    """``ncclSymkImplemented`` (v2.30.7-1 ``sym_kernels.cc:511-537``): AllGather any type, AllReduce and
    ReduceScatter a float sum but float64; 2.27 only a lone collective (v2.27.7-1 ``enqueue.cc:339``)."""
    c = _at(H100, "2.30.7")
    assert symmetric_kernel_problem(c, _site("all_to_all")) == (
        "op 'all_to_all' has no symmetric kernel (ncclSymkImplemented); allowed: "
        "['all_reduce', 'all_gather', 'reduce_scatter']"
    )
    assert symmetric_kernel_problem(c, dataclasses.replace(_site("all_reduce"), reduce_op="max")) == (
        "reduction 'max' has no symmetric kernel; allowed: ['sum', 'avg']"
    )
    assert symmetric_kernel_problem(c, dataclasses.replace(_site("all_reduce"), dtype="float64")) == (
        "dtype 'float64' has no symmetric all_reduce kernel; allowed: "
        "['float32', 'float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2']"
    )
    assert symmetric_kernel_problem(c, dataclasses.replace(_site("all_gather"), dtype="int64")) is None
    two = dataclasses.replace(_site("reduce_scatter"), parts=(("bfloat16", 32 << 20), ("bfloat16", 32 << 20)))
    assert symmetric_kernel_problem(_at(H100, "2.27.5"), two) == (
        "NCCL 2.27.5 runs symmetric kernels only for a lone collective; this call coalesces 2 tensors; "
        "allowed: NCCL >= 2.28 or one tensor"
    )
    assert symmetric_kernel_problem(_at(H100, "2.28.9"), two) is None


NO_CE_EVENTS = "NCCL 2.28.9 runs copy engines but reports no profiler event for them, so lagom could not tell that they ran (silent fallback to SMs); allowed: NCCL >= 2.29"


@pytest.mark.parametrize(
    "cluster, version, nodes, reason",
    [
        (H100, "2.26.6", 1, "NCCL 2.26.6 has no copy-engine collectives; allowed: NCCL >= 2.28"),
        (H100, "2.27.5", 1, "NCCL 2.27.5 has no copy-engine collectives; allowed: NCCL >= 2.28"),
        (H100, "2.28.9", 1, NO_CE_EVENTS),
        (H100, "2.29.2", 1, None),
        (H100, "2.30.7", 1, None),
        (
            H100,
            "2.29.2",
            2,
            "group spans 2 NCCL nodes: hierarchical copy engines need NCCL >= 2.30.7 and a host RMA proxy; "
            "allowed: a group within one node or NVLink domain",
        ),
        (
            H100,
            "2.30.7",
            2,
            "group spans 2 NCCL nodes: NCCL 2.30.7's hierarchical copy engines need a host RMA proxy that the "
            "cluster file does not record; allowed: a group within one node or NVLink domain",
        ),
        (A100, "2.27.5", 1, "NCCL 2.27.5 has no copy-engine collectives; allowed: NCCL >= 2.28"),
        (A100, "2.29.2", 1, None),
        (A40_PCIE, "2.26.6", 1, NO_CE_PCIE),
        (A40_PCIE, "2.30.7", 1, NO_CE_PCIE),
        (A40_BRIDGED, "2.28.9", 1, NO_CE_BRIDGED),
        (A40_BRIDGED, "2.30.7", 2, NO_CE_BRIDGED),
    ],
)
def test_copy_engines_per_nccl_version_and_hardware(cluster, version, nodes, reason):
    """NCCL 2.28+ (``ce_coll.cc`` first at v2.28.3-1), every rank in one NVLink load/store team (``ncclCeAvailable``,
    v2.30.7-1 ``ce_coll.cc:112-131``); across nodes only ``ncclHierCeAvailable`` (2.30.7, ``:719-760``)."""
    assert copy_engine_problem(_at(cluster, version), op="all_gather", n_nodes=nodes, group_size=8 * nodes) == reason


def test_copy_engines_for_the_ops_the_mechanism_and_the_run_that_allow_them():
    c = _at(H100, "2.30.7")
    assert copy_engine_problem(c, op="all_to_all", group_size=8) is None
    assert copy_engine_problem(c, op="reduce_scatter", group_size=8) == (
        "op 'reduce_scatter' has no copy-engine collective (ncclCeImplemented); allowed: ['all_gather', 'all_to_all']"
    )
    # an MNNVL domain of 16 GPUs: two hosts are one NCCL node, one load/store team
    assert copy_engine_problem(dataclasses.replace(c, nvlink_domain_gpus=16), op="all_gather", n_nodes=2) is None
    assert copy_engine_problem(c, op="all_gather", group_size=8, cta_scope="process") == (
        "the mechanism cannot set a CTA policy per communicator (NCCL_CTA_POLICY would hit every one); allowed: "
        "mechanism 'tuner' or 'communicator' (a pool entry's ncclConfig_t.CTAPolicy)"
    )
    assert copy_engine_problem(c, op="all_gather", group_size=8, capabilities=_caps()) is None
    assert copy_engine_problem(c, op="all_gather", group_size=8, capabilities=_caps(torch="2.8.0")) == (
        "copy engines need a registered receive window: torch 2.8.0: megatron-core registers its buffers locally, "
        "not as symmetric windows (nccl_allocator.py:116-122); allowed: torch >= 2.9"
    )
    fixed = _caps(overrides=(("NCCL_CTA_POLICY", "1"),))
    assert copy_engine_problem(c, op="all_gather", group_size=8, capabilities=fixed) == (
        "NCCL_CTA_POLICY=1 sets every communicator's CTA policy (src/init.cc:2160-2167 @v2.30.7-1); allowed: unset"
    )
    assert copy_engine_problem(c, op="all_gather", group_size=8, capabilities=_caps(fields=())) == (
        "torch 2.9.1 binds no ncclConfig_t.CTAPolicy; allowed: a torch whose ProcessGroupNCCL.Options config has "
        "cta_policy (2.8+)"
    )
    assert copy_engine_problem(c, op="all_gather", group_size=8, registered="fixed") == (
        "megatron-core keeps no handle on its NCCL memory pool (before 0.18; core_v0.18.0 "
        "param_and_grad_buffer.py:1074), so a pool entry cannot register it; allowed: megatron-core >= 0.18"
    )
    # registered without a window (--disable-symmetric-registration): NCCL sees no symmetric receive buffer
    assert copy_engine_problem(c, op="all_gather", group_size=8, registered="pool") == (
        "megatron-core registered the buffers without symmetric windows (--disable-symmetric-registration or "
        "torch < 2.9), which copy engines need; allowed: symmetric registration"
    )
    assert copy_engine_problem(c, op="all_gather", group_size=8, registered="symmetric") is None


def test_which_buffers_megatron_core_registers():
    """DDP registers each buffer with its data-parallel group (core_v0.19.0 ``distributed_data_parallel.py:218-226``,
    ``param_and_grad_buffer.py:1129-1150``); the fp32-accumulating all-to-all writes outside the pool (``:77``)."""
    assert buffers_problem(_site("reduce_scatter", group="expt_dp")) is None
    assert buffers_problem(_site("all_gather", group="tp")) == (
        "group 'tp' holds no buffer megatron-core registers under --use-nccl-ub; allowed: "
        "['dp', 'dp_cp', 'intra_dist_opt', 'expt_dp'] (the data-parallel groups of its param-and-grad buffers)"
    )
    assert buffers_problem(_site("all_to_all")) == (
        "op 'all_to_all' of group 'dp': its output is allocated outside the registered pool; allowed: "
        "['all_reduce', 'reduce_scatter', 'all_gather']"
    )
    assert symmetric_registration_problem(None) is None  # no capabilities: torch 2.9+ assumed
    assert symmetric_registration_problem(_caps(torch="2.10.0+cu128")) is None


def test_the_rules_answer_the_engine_s_question():
    h100 = NcclRules(_at(H100, "2.29.2"))
    assert h100.registration(_site("all_gather")) == Registration(symmetric_kernels=True, copy_engine=True)
    assert h100.registration(_site("reduce_scatter")) == Registration(symmetric_kernels=True, copy_engine=False)
    assert h100.registration(_site("all_gather", nodes=2)) == Registration(symmetric_kernels=False, copy_engine=False)
    assert h100.registration(_site("all_gather", group="tp")) is None
    assert h100.registration(_site("all_to_all")) is None
    assert NcclRules(_at(H100, "2.29.2"), mechanism="env").registration(_site("all_gather")) == Registration(
        symmetric_kernels=True, copy_engine=False
    )
    assert NcclRules(_at(H100, "2.27.5")).registration(_site("all_gather")) == Registration(
        symmetric_kernels=True, copy_engine=False
    )
    assert NcclRules(A40_PCIE).registration(_site("all_gather")) == Registration(
        symmetric_kernels=False, copy_engine=False
    )
    old_torch = NcclRules(_at(H100, "2.29.2"), capabilities=_caps(torch="2.8.0"))
    assert old_torch.registration(_site("all_gather")) == Registration(symmetric_kernels=False, copy_engine=False)
    assert GlooRules(ClusterSpec.load("cpu-gloo")).registration(_site("all_gather")) is None


def _plan(cluster: ClusterSpec, *, op="all_gather", group="dp", registered=("dp",), nodes=1) -> Plan:
    entry = PlanEntry(
        config=CommConfig(cta_policy="ZERO"),
        predicted_t_comm_us=100.0,
        predicted_t_region_us=100.0,
        predicted_default_t_region_us=120.0,
        group=group,
        op=op,
        nbytes=64 << 20,
        group_size=8 * nodes,
        n_nodes=nodes,
    )
    return Plan(
        entries={f"{group}.param_{op}[chunk0.bucket0]": entry},
        mechanism="communicator",
        registered_groups=tuple(registered),
        fingerprint={"cluster": cluster.name, "nccl_version": cluster.nccl_version, "backend": "nccl"},
    )


def _validate(tmp_path, capsys, plan: Plan, cluster: str) -> tuple[int, str]:
    """``lagom plan validate``'s exit code and its output's last line (the verdict, or the error)."""
    path = tmp_path / "plan.json"
    plan.save(path)
    rc = main(["plan", "validate", str(path), "--cluster", cluster])
    out = capsys.readouterr()
    return rc, (out.out if rc == 0 else out.err).strip().splitlines()[-1]


def test_a_plan_that_chooses_cta_policy_zero_refused_on_a_pcie_cluster(tmp_path, capsys):
    rc, err = _validate(tmp_path, capsys, _plan(A40_PCIE), "a40-pcie-ib200")
    assert rc != 0
    assert err.endswith(
        "entry 'dp.param_all_gather[chunk0.bucket0]': cta_policy 'ZERO' is not allowed (" + NO_CE_PCIE + "); "
        "allowed: [None, 'DEFAULT', 'EFFICIENCY']"
    )


def test_a_plan_with_copy_engines_accepted_on_h100_where_its_group_is_registered(tmp_path, capsys):
    """The h100-sxm-ib400 preset: NVSwitch, NCCL 2.30.7 (torch 2.15's)."""
    assert H100.nccl_version == "2.30.7"
    rc, out = _validate(tmp_path, capsys, _plan(H100), "h100-sxm-ib400")
    assert rc == 0 and out.endswith(
        "valid (1 entries, cluster h100-sxm-ib400, NCCL 2.30.7; verification: never verified)"
    )
    rc, err = _validate(tmp_path, capsys, _plan(H100, registered=()), "h100-sxm-ib400")
    assert rc != 0 and err.endswith(
        "entry 'dp.param_all_gather[chunk0.bucket0]': cta_policy 'ZERO': the plan does not register group 'dp' "
        "(copy engines need its buffers registered); allowed: 'dp' in registered_groups (now [])"
    )
    rc, err = _validate(tmp_path, capsys, _plan(H100, op="reduce_scatter"), "h100-sxm-ib400")
    assert rc != 0 and err.endswith(
        "entry 'dp.param_reduce_scatter[chunk0.bucket0]': cta_policy 'ZERO' is not allowed (op 'reduce_scatter' "
        "has no copy-engine collective (ncclCeImplemented); allowed: ['all_gather', 'all_to_all']); "
        "allowed: [None, 'DEFAULT', 'EFFICIENCY']"
    )
    rc, err = _validate(tmp_path, capsys, _plan(H100, nodes=2), "h100-sxm-ib400")
    assert rc != 0 and "group spans 2 NCCL nodes: NCCL 2.30.7's hierarchical copy engines need a host RMA proxy" in err
    older = tmp_path / "h100-nccl2275.yaml"  # the same hardware on torch 2.9's NCCL 2.27.5
    older.write_text(yaml.safe_dump({k: v for k, v in _at(H100, "2.27.5").to_dict().items() if v is not None}))
    rc, err = _validate(tmp_path, capsys, _plan(_at(H100, "2.27.5")), str(older))
    assert rc != 0 and "(NCCL 2.27.5 has no copy-engine collectives; allowed: NCCL >= 2.28)" in err


def test_registered_groups_naming_a_group_megatron_core_does_not_register_refused():
    h100 = NcclRules(_at(H100, "2.28.9"), mechanism="communicator")
    plan = dataclasses.replace(_plan(h100.cluster, group="tp", registered=("tp",)))
    assert plan_registration_problem(plan, h100) == (
        "registered_groups: group 'tp' holds no buffer megatron-core registers under --use-nccl-ub; "
        "allowed: ['dp', 'dp_cp', 'intra_dist_opt', 'expt_dp']"
    )
    assert plan_registration_problem(_plan(h100.cluster), h100) is None
    gloo = GlooRules(ClusterSpec.load("cpu-gloo"))
    assert plan_registration_problem(_plan(h100.cluster), gloo) == (
        "registered_groups ['dp']: gloo cluster 'cpu-gloo' registers no NCCL buffers; allowed: none"
    )
