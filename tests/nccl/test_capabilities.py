"""Capabilities: gathered from the process (plugin status, not the variable's text), compared across
ranks, and the search domain they give: plans searched under NCCL 2.21 / 2.24 / 2.30, with and
without lagom's plugin loaded, hold only knobs the agreed mechanism applies, and sites NCCL cannot
tell apart get one config."""

from __future__ import annotations

import numpy as np
import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.problem import SearchProblem
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.engine.search import search
from lagom_megatron.megatron.pool.comm_pool import rules_for
from lagom_megatron.nccl.capabilities import (
    Capabilities,
    differences,
    gather_local,
    host_id,
    knob_overrides,
    perturb,
    restrict_domains,
)
from lagom_megatron.nccl.options import nccl_options_for
from lagom_megatron.nccl.plugin_status import PluginStatus
from lagom_megatron.nccl.pool import NcclPoolBackend
from lagom_megatron.nccl.rules import tuner_abi

FIELDS = (
    "blocking",
    "cga_cluster_size",
    "collnet_enable",
    "cta_policy",
    "max_ctas",
    "min_ctas",
    "net_name",
    "nvls_ctas",
    "split_share",
    "traffic_class",
)


def _status(abi=6, inits=1):
    return PluginStatus(
        path="/opt/lagom/libnccl-tuner-lagom.so", abi_version=abi, init_count=inits, row_hits=(), table_loaded=False
    )


def caps(version=(2, 30, 3), plugin=True, environ=None, multicast=True):
    """The capabilities a rank would gather on NCCL ``version`` (stand-ins for the process)."""
    abi = tuner_abi(version)
    status = (lambda: _status(abi)) if plugin and abi >= 3 else (lambda: None)
    return gather_local(
        environ=environ or {},
        status_reader=status,
        nccl_version=version,
        config_fields=FIELDS,
        multicast=multicast,
        torch_version="2.9.1",
    )


def test_plugin_loaded_comes_from_the_process_not_the_variable():
    text_only = gather_local(
        environ={"NCCL_TUNER_PLUGIN": "/opt/lagom/libnccl-tuner-lagom.so"},
        status_reader=lambda: None,
        nccl_version=(2, 27, 5),
        config_fields=FIELDS,
        multicast=True,
        torch_version="2.9.1",
    )
    assert (text_only.plugin_loaded, text_only.plugin_abi, text_only.mechanism()) == (False, 0, "communicator")
    loaded = gather_local(
        environ={},
        status_reader=lambda: _status(5),
        nccl_version=(2, 28, 3),
        config_fields=FIELDS,
        multicast=True,
        torch_version="2.9.1",
    )
    assert (loaded.plugin_loaded, loaded.plugin_abi, loaded.mechanism()) == (True, 5, "tuner")
    # mapped but never initialised by NCCL (no communicator through it): not loaded
    idle = gather_local(
        environ={},
        status_reader=lambda: _status(0, 0),
        nccl_version=(2, 28, 3),
        config_fields=FIELDS,
        multicast=True,
        torch_version="2.9.1",
    )
    assert idle.mechanism() == "communicator"
    cpu = gather_local(
        environ={},
        status_reader=lambda: _status(6),
        nccl_version=None,
        config_fields=(),
        multicast="detect",
        torch_version="2.9.1",
    )
    assert (cpu.plugin_loaded, cpu.nvls_multicast, cpu.nccl_version) == (False, None, None)


def test_overrides_come_from_environment_and_nccl_conf_files(tmp_path):
    conf = tmp_path / "nccl.conf"
    conf.write_text("# site defaults\nNCCL_ALGO=Ring\nNCCL_DEBUG=INFO\nNCCL_MAX_CTAS=8\n")
    env = {"NCCL_CONF_FILE": str(conf), "NCCL_MAX_CTAS": "16", "NCCL_NVLS_ENABLE": "0"}
    got = dict(knob_overrides(env, home=str(tmp_path)))
    # the environment wins over the file (NCCL's setenv(..., 0)); NCCL_DEBUG fixes no knob
    assert got == {"NCCL_ALGO": "Ring", "NCCL_MAX_CTAS": "16", "NCCL_NVLS_ENABLE": "0"}
    c = caps(environ=env)
    assert c.fixed_knobs() == {"algorithm": "NCCL_ALGO=Ring", "n_channels": "NCCL_MAX_CTAS=16"}
    assert c.nvls_multicast is False  # NCCL_NVLS_ENABLE=0 disables NVLS whatever the device says


def test_host_and_topology_as_nccl_counts_them(tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("abc\n")
    assert host_id({"NCCL_HOSTID": "node7"}) == "node7"
    assert host_id({}, boot_id_file=str(boot)).endswith("abc")
    t = caps().with_topology(["a", "a", "b", "b", "b", "b"])
    assert (t.n_nodes, t.ranks_per_node) == (2, 4)


def test_differences_name_rank_and_field_and_round_trip():
    a = caps()
    records = [a, a, perturb(a, "plugin_loaded"), perturb(a, "overrides")]
    got = differences(records)
    assert [(r, f) for r, f, _, _ in got] == [(2, "plugin_loaded"), (2, "plugin_abi"), (3, "overrides")]
    assert ("NCCL_MAX_CTAS", "4") in got[-1][3]
    assert Capabilities.from_dict(a.to_dict()) == a
    assert differences([a, Capabilities.from_dict({**a.to_dict(), "host": "elsewhere"})]) == []  # host not compared
    with pytest.raises(ValueError, match="unknown capability field.*'bogus'"):
        Capabilities.from_dict({**a.to_dict(), "bogus": 1})


def test_variable_that_fixes_a_knob_removes_it_with_a_warning_naming_it():
    c = caps(environ={"NCCL_MIN_CTAS": "4", "NCCL_MAX_CTAS": "4", "NCCL_PROTO": "Simple"})
    rules = rules_for("nccl", ClusterSpec.load("h100-sxm-ib400"), capabilities=c)
    d = rules.domains(op="all_reduce", n_nodes=1, group_size=8)
    assert d["n_channels"] == (None,) and d["protocol"] == (None,)
    assert len(d["algorithm"]) > 1  # algorithm is still searched
    text = " ".join(rules.warnings())
    assert "NCCL_MAX_CTAS=4 fixes n_channels" in text and "NCCL_PROTO=Simple fixes protocol" in text
    assert all(p.n_channels is None and p.protocol is None for p in rules.probe_configs())


@pytest.mark.parametrize(
    "n_nodes, multicast, collnet, want_nvls",
    [(1, True, False, True), (1, False, False, False), (2, True, False, False), (2, True, True, True)],
)
def test_nvls_only_where_nccl_enables_it(n_nodes, multicast, collnet, want_nvls):
    c = caps(multicast=multicast, environ={"NCCL_COLLNET_ENABLE": "1"} if collnet else {})
    spec = ClusterSpec.load("h100-sxm-ib400")
    d = {
        "algorithm": ("Ring", "Tree", "NVLS", "NVLSTree", "CollNetDirect"),
        "n_threads": (64, 512),
        "chunk_size": (None, 4096),
    }
    got, _ = restrict_domains(d, c, op="all_reduce", n_nodes=n_nodes, mechanism="tuner")
    assert ("NVLS" in got["algorithm"]) is want_nvls
    assert ("CollNetDirect" in got["algorithm"]) is collnet
    assert got["n_threads"] == (None,)  # NCCL_NTHREADS is read once per process, before any plan
    # the cluster rules alone agree for NVLS across nodes without SHARP, and never offer PAT reduce-scatter
    rs = rules_for("nccl", spec).domains(op="reduce_scatter", n_nodes=4, group_size=4)
    assert "PAT" not in rs["algorithm"]
    ar = rules_for("nccl", spec).domains(op="all_reduce", n_nodes=2, group_size=16)
    assert "NVLS" not in ar["algorithm"]


def test_pat_never_under_a_network_plugin_and_reduce_scatter_needs_a_known_non_averaging_op():
    """NCCL runs PAT only on a host network device (2.30.7 ``src/graph/tuning.cc:215-221``) and skips
    PAT reduce-scatter for an averaging reduction (``src/enqueue.cc:2010-2012``)."""
    spec = ClusterSpec.load("h100-sxm-ib400")
    d = {"algorithm": ("Ring", "PAT"), "n_threads": (None,), "chunk_size": (None,)}
    assert restrict_domains(d, caps(), op="all_gather", n_nodes=4, mechanism="communicator")[0]["algorithm"] == (
        "Ring",
        "PAT",
    )
    offload = caps(environ={"NCCL_NET_PLUGIN": "gpudirect_tcpxo"})
    assert restrict_domains(d, offload, op="all_gather", n_nodes=4, mechanism="communicator")[0]["algorithm"] == (None,)
    # NCCL_PAT_ENABLE=1 returns before the network-device test (tuning.cc:217-219): PAT stays
    forced = caps(environ={"NCCL_NET_PLUGIN": "gpudirect_tcpxo", "NCCL_PAT_ENABLE": "1"})
    assert restrict_domains(d, forced, op="all_gather", n_nodes=4, mechanism="communicator")[0]["algorithm"] == (
        "Ring",
        "PAT",
    )
    rules = rules_for("nccl", spec)
    assert "PAT" in rules.domains(op="reduce_scatter", n_nodes=4, group_size=4, reduce_op="sum")["algorithm"]
    assert "PAT" not in rules.domains(op="reduce_scatter", n_nodes=4, group_size=4, reduce_op="avg")["algorithm"]


def test_p2p_channel_variables_cut_the_p2p_bounds_to_the_distinct_counts():
    """``comm->p2pnChannels = pow2Up(max(min(nChannels, NCCL_MAX_P2P_NCHANNELS), NCCL_MIN_P2P_NCHANNELS))``
    (NVIDIA/nccl v2.30.7 ``src/graph/paths.cc:956-991``; cached NCCL_PARAMs, one value per process): with
    ``NCCL_MAX_P2P_NCHANNELS=4`` a bound above 4 runs 4 P2P channels, with ``NCCL_MIN_P2P_NCHANNELS=8`` a
    bound below 8 runs 8, so only the bounds that give distinct counts stay (the least of each)."""
    d = {"n_channels": (1, 2, 4, 8, 16, 32, 64), "n_threads": (None,), "chunk_size": (None,)}
    cut = restrict_domains(d, caps(environ={"NCCL_MAX_P2P_NCHANNELS": "4"}), op="send", n_nodes=1, mechanism="tuner")[0]
    assert cut["n_channels"] == (1, 2, 4)
    cut = restrict_domains(
        d, caps(environ={"NCCL_MIN_P2P_NCHANNELS": "8"}), op="all_to_all", n_nodes=1, mechanism="tuner"
    )[0]
    assert cut["n_channels"] == (1, 16, 32, 64)
    both = caps(environ={"NCCL_MIN_P2P_NCHANNELS": "8", "NCCL_MAX_P2P_NCHANNELS": "8"})
    assert restrict_domains(d, both, op="send", n_nodes=1, mechanism="tuner")[0]["n_channels"] == (None,)
    # collectives do not read them
    assert restrict_domains(d, both, op="all_gather", n_nodes=1, mechanism="tuner")[0]["n_channels"] == d["n_channels"]


# ---------------------------------------------------------------------------------------------- plans

SITES = (
    [
        CollectiveSite(
            site_id=f"tp.sp_reduce_scatter[{i}]",
            op="reduce_scatter",
            nbytes=41_943_040,
            dtype="bf16",
            group="tp",
            group_size=8,
            n_nodes=1,
            calls_per_iter=1,
        )
        for i in range(6)
    ]
    + [
        CollectiveSite(
            site_id=f"tp.sp_all_gather[{i}]",
            op="all_gather",
            nbytes=41_943_040,
            dtype="bf16",
            group="tp",
            group_size=8,
            n_nodes=1,
            calls_per_iter=1,
        )
        for i in range(3)
    ]
    + [
        CollectiveSite(
            site_id=f"dp.grad_reduce_scatter[{i}]",
            op="reduce_scatter",
            nbytes=(i + 1) * 2**24,
            dtype="fp32",
            group="dp",
            group_size=8,
            n_nodes=8,
            calls_per_iter=1,
        )
        for i in range(3)
    ]
    + [
        CollectiveSite(
            site_id="dp.grad_all_reduce[0]",
            op="all_reduce",
            nbytes=2**26,
            dtype="fp32",
            group="dp",
            group_size=16,
            n_nodes=2,
            calls_per_iter=1,
        )
    ]
)
RATIOS = np.array([0.3, 0.8, 1.5, 3.0, 0.5, 2.0, 0.4, 1.0, 2.5, 1.0, 1.5, 0.7, 1.2])


def _plan(version, plugin, multicast=True):
    c = caps(version, plugin, multicast=multicast)
    spec = ClusterSpec.load("h100-sxm-ib400")
    rules = rules_for("nccl", spec, capabilities=c)
    probe = CostModel.from_priors(SITES, np.ones(len(SITES)), rules.cluster)
    st = SearchProblem.from_model(probe, rules=rules).default_state()
    t_comm = probe.evaluate(np.arange(len(SITES)), st.alg, st.proto, st.nc, st.nt, np.zeros(len(SITES)))[0]
    model = CostModel.from_priors(SITES, t_comm * RATIOS, rules.cluster, a=3.0, b=3.0)
    problem = SearchProblem.from_model(model, rules=rules)
    return c, rules, search(problem, method="priority").plan


@pytest.mark.parametrize("version", [(2, 21, 5), (2, 24, 3), (2, 30, 3)])
@pytest.mark.parametrize("plugin", [True, False])
def test_plans_hold_only_what_the_agreed_mechanism_applies(version, plugin):
    c, rules, plan = _plan(version, plugin)
    mechanism = "tuner" if plugin and version >= (2, 22, 0) else "communicator"
    assert rules.mechanism == mechanism == plan.mechanism
    tuned = {sid: e for sid, e in plan.entries.items() if not e.config.is_default()}
    assert tuned, "the search tuned nothing: the test would prove nothing"
    backend = NcclPoolBackend(use_tuner_plugin=mechanism == "tuner")
    for sid, e in plan.entries.items():
        cfg = e.config
        assert cfg.n_threads is None, (sid, cfg)  # read once per process, before any plan
        if not (mechanism == "tuner" and version >= (2, 30, 0)):
            assert cfg.chunk_size is None, (sid, cfg)
        if mechanism == "communicator" and version < (2, 24, 0):
            assert cfg.algorithm is None and cfg.protocol is None, (sid, cfg)  # CTA bounds only
        if mechanism == "communicator":
            assert cfg.protocol != "LL128", (sid, cfg)
        if e.op == "reduce_scatter":
            assert cfg.algorithm != "PAT", (sid, cfg)
        if e.n_nodes > 1:
            assert cfg.algorithm != "NVLS", (sid, cfg)  # no CollNet here
        rules.validate(cfg, op=e.op, n_nodes=e.n_nodes, group_size=e.group_size)
        # what the pool would do with it on this NCCL: nothing raises (the crashes of 2.21 and LL128)
        entry = backend._entry_config(cfg)
        nccl_options_for(entry, nccl_version=version, use_tuner_plugin=mechanism == "tuner", op=e.op)
    if mechanism == "tuner":
        rows = {(e.group, e.op, e.nbytes): set() for e in plan.entries.values()}
        for e in plan.entries.values():
            rows[(e.group, e.op, e.nbytes)].add(e.config)
        assert all(len(v) == 1 for v in rows.values()), {k: v for k, v in rows.items() if len(v) > 1}


def test_plans_without_multicast_never_hold_nvls():
    _, _, plan = _plan((2, 30, 3), True, multicast=False)
    assert all(e.config.algorithm not in ("NVLS", "NVLSTree") for e in plan.entries.values())


def test_indistinguishable_sites_share_the_best_of_their_configs():
    c = caps((2, 30, 3), True)
    rules = rules_for("nccl", ClusterSpec.load("h100-sxm-ib400"), capabilities=c)
    sites = SITES[:6]
    model = CostModel.from_priors(sites, np.array([1e3, 2e3, 4e3, 8e3, 16e3, 32e3]), rules.cluster, a=3.0, b=3.0)
    problem = SearchProblem.from_model(model, rules=rules)
    st = problem.default_state()
    st.nc[:] = [2, 4, 8, 16, 24, 32]
    tied, changed = problem.tie_indistinguishable(st)
    assert changed == 5 and len(set(tied.nc.tolist())) == 1
    idx = np.arange(6)
    totals = {n: problem.evaluate_codes(idx, st.alg, st.proto, np.full(6, n), st.nt, st.lvl)[2].sum() for n in st.nc}
    assert tied.nc[0] == min(totals, key=totals.get)
    # under communicator options each config has its own communicator: nothing is tied
    comm = SearchProblem.from_model(
        model, rules=rules_for("nccl", ClusterSpec.load("h100-sxm-ib400"), "communicator", capabilities=c)
    )
    assert comm.tie_indistinguishable(st)[1] == 0


@pytest.mark.parametrize(
    "version, plugin, has_protocol_probe",
    [((2, 21, 5), False, False), ((2, 22, 3), True, False), ((2, 24, 3), False, True), ((2, 30, 3), True, True)],
)
def test_probe_configs_are_what_a_per_communicator_entry_applies(version, plugin, has_protocol_probe):
    c = caps(version, plugin)
    rules = rules_for("nccl", ClusterSpec.load("h100-sxm-ib400"), capabilities=c)
    probes = rules.probe_configs()
    assert probes and all(p.chunk_size is None for p in probes)  # no ncclConfig_t field for chunk size
    assert any(p.protocol for p in probes) is has_protocol_probe  # per-function NCCL_PROTO needs 2.24
    backend = NcclPoolBackend(use_tuner_plugin=plugin)
    backend.plugin_active = False  # probes always run on per-communicator entries
    for p in probes:  # none of them raises where the Simple probe crashed NCCL 2.21 runs
        nccl_options_for(backend._entry_config(p), nccl_version=version, use_tuner_plugin=False, op="all_reduce")


def test_live_rules_get_the_pool_budget_and_the_nvls_heads():
    """``rules_for`` as the controller calls it: the pool budget reaches the rules, and where NVLS
    multicast runs the entries' NVLS buffers (one per channel per head, 8 ranks per node) count, so
    the channel cap is lower than with ring buffers alone."""
    from lagom_megatron.nccl.pool import NVLS_BYTES_PER_CHANNEL_HEAD, RING_BUFFER_BYTES

    spec = ClusterSpec.load("h100-sxm-ib400")
    budget = 512 * 2**20
    nvls = rules_for("nccl", spec, capabilities=caps().with_topology(["a"] * 8), pool_budget_bytes=budget)
    ring = rules_for(
        "nccl", spec, capabilities=caps(multicast=False).with_topology(["a"] * 8), pool_budget_bytes=budget
    )
    assert (nvls.pool_budget_bytes, nvls.nvls_heads, ring.nvls_heads) == (budget, 8, 0)
    assert nvls.channel_cap() == budget // (RING_BUFFER_BYTES + 8 * NVLS_BYTES_PER_CHANNEL_HEAD) == 20
    assert ring.channel_cap() == budget // RING_BUFFER_BYTES == 55
    assert max(nvls.domains(op="all_reduce", group_size=8)["n_channels"]) == 16
    assert rules_for("nccl", spec, capabilities=caps()).channel_cap() is None  # no budget: no cap
