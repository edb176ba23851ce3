"""Pool entries of point-to-point sites and of sites that leave channels to NCCL, checked against a
stand-in of what NCCL makes of an entry's ``ncclConfig_t`` (NVIDIA/nccl v2.30.7):

* ``comm->nChannels``: the topology's count cut to ``maxCTAs``, duplicated up to ``minCTAs``
  (``src/graph/connect.cc:503-505``; the fake config's -1 is ``NCCL_CONFIG_UNDEF_INT``, unset);
* ``comm->p2pnChannels = pow2Up(min(nChannels, NCCL_MAX_P2P_NCHANNELS = 64))`` (``src/graph/paths.cc:980-990``);
* a collective starts from ``nc = comm->nChannels`` (``src/enqueue.cc:2070``), a plugin's non-zero
  ``*nChannels`` replaces it (``:2178``) and scheduling caps it at ``comm->nChannels`` (``:583``).

The entries are made by ``NcclPoolBackend.create_group`` with torch stand-ins that record the
``ProcessGroupNCCL.Options`` handed to ``new_group`` (``test_pool._fake_nccl``)."""

from __future__ import annotations

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.cost_model import CostModel
from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.plan import Plan, PlanEntry
from lagom_megatron.engine.profile import CollectiveSite
from lagom_megatron.nccl.export import tuner_rows
from lagom_megatron.nccl.pool import NcclPoolBackend

from .test_pool import _fake_nccl

UNSET = -1


def nccl_comm_channels(topology: int, config) -> int:
    """``comm->nChannels`` of a communicator NCCL's topology gives ``topology`` channels."""
    n = topology
    if config.max_ctas != UNSET:
        n = min(n, config.max_ctas)
    if config.min_ctas != UNSET:
        n = max(n, config.min_ctas)
    return n


def nccl_p2p_channels(comm_channels: int) -> int:
    n, p = min(comm_channels, 64), 1
    while p < n:
        p *= 2
    return p


def nccl_collective_channels(comm_channels: int, plugin_channels: int) -> int:
    """Channels a large collective runs on: the plugin's count when it set one, else the communicator's."""
    nc = plugin_channels if plugin_channels > 0 else comm_channels
    return min(nc, comm_channels)


def _entry(config, *, group, op, nbytes=16 << 20, group_size=8):
    return PlanEntry(
        config=config,
        predicted_t_comm_us=1.0,
        predicted_t_region_us=1.0,
        group=group,
        op=op,
        nbytes=nbytes,
        group_size=group_size,
    )


def _created(monkeypatch, backend, plan):
    """The recorded ``Options.config`` of the entry each non-default plan site is routed to."""
    calls = []
    _fake_nccl(monkeypatch, calls)
    out = {}
    for sid, e in plan.entries.items():
        if e.config.is_default():
            continue
        key = backend.entry_key(e.config, group=e.group)
        backend.create_group((0, 1), e.config, f"LAGOM_POOL_{e.group.upper()}_{'_'.join(key)}", group=e.group)
        out[sid] = (key, calls[-1]["opts"].config)
    return out


def test_p2p_sites_get_their_channel_count_through_the_entrys_cta_bounds(monkeypatch):
    plan = Plan(
        entries={
            "pp.send_recv[0]": _entry(CommConfig(n_channels=4), group="pp", op="send", group_size=2),
            "ep.dispatch_all_to_all[0]": _entry(CommConfig(n_channels=16), group="ep", op="all_to_all"),
            "ep.combine_all_to_all[0]": _entry(CommConfig(n_channels=2), group="ep", op="all_to_all"),
            "dp.grad_reduce_scatter[0]": _entry(
                CommConfig(n_channels=24, protocol="Simple"), group="dp", op="reduce_scatter"
            ),
        }
    )
    backend = NcclPoolBackend(use_tuner_plugin=True, tuner_table="/runs/tuner_table.rank0.csv")
    backend.table_id = "abc"
    backend.set_cta_bounds(plan)
    made = _created(monkeypatch, backend, plan)
    topology = 32  # an NVSwitch node's channels
    for sid, want in (("pp.send_recv[0]", 4), ("ep.dispatch_all_to_all[0]", 16), ("ep.combine_all_to_all[0]", 2)):
        _, cfg = made[sid]
        assert (cfg.min_ctas, cfg.max_ctas) == (want, want)
        assert nccl_p2p_channels(nccl_comm_channels(topology, cfg)) == want
    # two P2P sites of one group with different counts are two communicators
    assert made["ep.dispatch_all_to_all[0]"][0] != made["ep.combine_all_to_all[0]"][0]
    # the collective keeps its row's count on its group's bounded entry; P2P has no tuner row
    _, dp = made["dp.grad_reduce_scatter[0]"]
    assert nccl_collective_channels(nccl_comm_channels(topology, dp), 24) == 24
    assert [r.sites for r in tuner_rows(plan, extended=True)] == [("dp.grad_reduce_scatter[0]",)]
    # the cost model predicts the CTAs NCCL's rule gives those communicators (8 PCIe tasks, 2 per peer)
    a40 = ClusterSpec.load("a40-pcie-ib200")
    a2a = CollectiveSite(
        site_id="ep.x[0]", op="all_to_all", nbytes=32 << 20, dtype="bfloat16", group="ep", group_size=8
    )
    model = CostModel.from_priors([a2a], [1.0], a40)
    codes = model.default_codes()
    assert [float(model.prior_parts(0, codes[0][0], codes[1][0], float(n), 512.0, 0.0)[2]) for n in (2, 16)] == [
        2.0,
        16.0,
    ]


def test_communicator_mode_bounds_p2p_the_same_way(monkeypatch):
    plan = Plan(entries={"pp.send_recv[0]": _entry(CommConfig(n_channels=8), group="pp", op="send", group_size=2)})
    made = _created(monkeypatch, NcclPoolBackend(use_tuner_plugin=False), plan)
    _, cfg = made["pp.send_recv[0]"]
    assert nccl_p2p_channels(nccl_comm_channels(16, cfg)) == 8


def test_a_site_that_leaves_channels_to_nccl_runs_at_nccls_own_count(monkeypatch):
    """Two tensor-parallel sites: one planned at 8 channels, one tuned in protocol only. The second
    gets an entry with NCCL's own CTA bounds, so NCCL starts from its topology's count; on the first's
    entry (min = max = 8) it would run 8 channels."""
    plan = Plan(
        entries={
            "tp.sp_all_gather[0]": _entry(CommConfig(n_channels=8, protocol="LL128"), group="tp", op="all_gather"),
            "tp.sp_all_gather[1]": _entry(CommConfig(protocol="Simple"), group="tp", op="all_gather", nbytes=32 << 20),
        }
    )
    backend = NcclPoolBackend(use_tuner_plugin=True, tuner_table="/runs/tuner_table.rank0.csv")
    backend.set_cta_bounds(plan)
    made = _created(monkeypatch, backend, plan)
    topology = 24  # DGX A100
    key8, bounded = made["tp.sp_all_gather[0]"]
    key_own, own = made["tp.sp_all_gather[1]"]
    assert key8 != key_own and (own.min_ctas, own.max_ctas) == (UNSET, UNSET)
    rows = {r.sites[0]: int(r.cells[5]) for r in tuner_rows(plan, extended=True)}
    assert rows == {"tp.sp_all_gather[0]": 8, "tp.sp_all_gather[1]": -1}
    plugin = {sid: max(0, n) for sid, n in rows.items()}  # -1: the plugin leaves *nChannels at 0
    assert nccl_collective_channels(nccl_comm_channels(topology, bounded), plugin["tp.sp_all_gather[0]"]) == 8
    assert nccl_collective_channels(nccl_comm_channels(topology, own), plugin["tp.sp_all_gather[1]"]) == topology
    # on the bounded entry, as before, it would have run at the bound instead
    assert nccl_collective_channels(nccl_comm_channels(topology, bounded), plugin["tp.sp_all_gather[1]"]) == 8


def test_channels_per_network_peer_reach_nccl_by_the_field_torch_binds_or_the_variable():
    """``nChannelsPerNetPeer`` is an ``ncclConfig_t`` field from NCCL 2.28 (``src/nccl.h.in`` at
    v2.28.3-1); no torch release we read binds it, so the rules keep it process scope
    (``NCCL_NCHANNELS_PER_NET_PEER``, which overrides the field, ``src/init.cc:2038-2047``) unless the
    agreed capabilities show a torch that binds ``n_channels_per_net_peer``."""
    import dataclasses

    import pytest

    from lagom_megatron.nccl.capabilities import gather_local
    from lagom_megatron.nccl.env_vars import validate_env
    from lagom_megatron.nccl.options import nccl_options_for
    from lagom_megatron.nccl.rules import NcclRules, process_env

    from .test_pool import TORCH_28_FIELDS

    cfg = CommConfig(n_channels=4, net_peer_channels=2)
    with pytest.raises(ValueError, match="needs NCCLConfig.n_channels_per_net_peer, which this torch does not bind"):
        nccl_options_for(cfg, fields=TORCH_28_FIELDS)
    bound = TORCH_28_FIELDS + ("n_channels_per_net_peer",)
    assert nccl_options_for(cfg, fields=bound)["config"]["n_channels_per_net_peer"] == 2
    with pytest.raises(ValueError, match="needs NCCL >= 2.28"):
        nccl_options_for(cfg, fields=bound, nccl_version=(2, 27, 5))
    with pytest.raises(ValueError, match="power of two"):
        nccl_options_for(CommConfig(net_peer_channels=3), fields=bound)
    h200 = ClusterSpec.load("h200-sxm")
    offline = NcclRules(h200)
    assert offline.scope("net_peer_channels") == "process"
    assert offline.domains(op="send", n_nodes=2, group_size=2)["net_peer_channels"] == (None, 1, 2, 4, 8, 16)
    assert offline.domains(op="send", n_nodes=1, group_size=2)["net_peer_channels"] == (None,)  # no network peer
    assert offline.domains(op="all_reduce", n_nodes=2, group_size=16)["net_peer_channels"] == (None,)
    assert process_env({"net_peer_channels": [2]}) == {"NCCL_NCHANNELS_PER_NET_PEER": "2"}
    validate_env({"NCCL_NCHANNELS_PER_NET_PEER": "2"})
    with pytest.raises(ValueError, match="powers of two"):
        validate_env({"NCCL_NCHANNELS_PER_NET_PEER": "3"})
    caps = gather_local(
        environ={},
        status_reader=lambda: None,
        nccl_version=(2, 30, 7),
        config_fields=bound,
        multicast=False,
        torch_version="2.99",
    )
    live = NcclRules(h200, capabilities=caps)
    assert live.scope("net_peer_channels") == "communicator"
    assert live.domains(op="send", n_nodes=2, group_size=2)["net_peer_channels"] == (None, 1, 2, 4, 8, 16)
    unbound = NcclRules(h200, capabilities=dataclasses.replace(caps, config_fields=TORCH_28_FIELDS))
    # a running job cannot change a process-wide value: not searched live without the field
    assert unbound.domains(op="send", n_nodes=2, group_size=2)["net_peer_channels"] == (None,)
    # a pool entry per distinct value, in plugin and communicator mode
    for plugin in (True, False):
        backend = NcclPoolBackend(use_tuner_plugin=plugin)
        keys = {backend.entry_key(CommConfig(n_channels=4, net_peer_channels=v), group="pp") for v in (None, 2)}
        assert len(keys) == 2
