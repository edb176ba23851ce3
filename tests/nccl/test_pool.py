"""NCCL communicator options (``nccl.options``) and pool entries (``nccl.pool``): option mapping per
torch version (fake Options classes), environment refusals, scoped environment, and the refusal
when NCCL is not available (CPU torch)."""

import os

import pytest

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.nccl.env_vars import PER_COMMUNICATOR_OVERRIDES
from lagom_megatron.nccl.options import (
    build_options,
    check_env_conflicts,
    nccl_config_fields,
    nccl_options_for,
    nccl_version_tuple,
)
from lagom_megatron.nccl.pool import create_nccl_pool_entry, scoped_env

TORCH_25_FIELDS = ("blocking", "cga_cluster_size", "min_ctas", "max_ctas", "net_name", "split_share")
TORCH_28_FIELDS = TORCH_25_FIELDS + ("traffic_class", "collnet_enable", "cta_policy", "nvls_ctas")


def make_options_cls(field_names):
    """A stand-in for ProcessGroupNCCL.Options whose config binds exactly ``field_names``."""

    class FakeConfig:
        __slots__ = field_names

        def __init__(self):
            for name in field_names:
                setattr(self, name, -1)

    class FakeOptions:
        def __init__(self, is_high_priority_stream=False):
            self.is_high_priority_stream = is_high_priority_stream
            self.config = FakeConfig()

    return FakeOptions


@pytest.mark.parametrize("torch_fields", [TORCH_25_FIELDS, TORCH_28_FIELDS], ids=["torch2.5-2.7", "torch2.8+"])
def test_fields_are_detected_from_the_options_class(torch_fields):
    assert nccl_config_fields(make_options_cls(torch_fields)) == frozenset(torch_fields)


@pytest.mark.parametrize(
    "torch_fields, expect_nvls", [(TORCH_25_FIELDS, False), (TORCH_28_FIELDS, True)], ids=["torch2.5-2.7", "torch2.8+"]
)
def test_channels_map_to_both_cta_ends(torch_fields, expect_nvls):
    cfg = CommConfig(n_channels=6, cga_cluster_size=2)
    mapping = nccl_options_for(cfg, fields=nccl_config_fields(make_options_cls(torch_fields)))
    expected = {"min_ctas": 6, "max_ctas": 6, "cga_cluster_size": 2}
    if expect_nvls:
        expected["nvls_ctas"] = 6
    assert mapping == {"config": expected, "env": {}}
    opts = build_options(mapping["config"], options_cls=make_options_cls(torch_fields), high_priority_stream=True)
    assert (opts.config.min_ctas, opts.config.max_ctas, opts.config.cga_cluster_size) == (6, 6, 2)
    assert opts.config.blocking == 1 and opts.is_high_priority_stream is True
    assert getattr(opts.config, "nvls_ctas", None) == (6 if expect_nvls else None)


def test_cta_policy_needs_torch_28():
    cfg = CommConfig(cta_policy="efficiency")
    assert nccl_options_for(cfg, fields=TORCH_28_FIELDS)["config"] == {"cta_policy": 1}
    with pytest.raises(ValueError, match=r"cta_policy needs NCCLConfig.cta_policy.*torch >= 2.8"):
        nccl_options_for(cfg, fields=TORCH_25_FIELDS)
    assert nccl_options_for(CommConfig(cta_policy="ZERO"), fields=TORCH_28_FIELDS)["config"] == {"cta_policy": 2}
    with pytest.raises(ValueError, match="ZERO needs NCCL >= 2.28"):
        nccl_options_for(CommConfig(cta_policy="ZERO"), fields=TORCH_28_FIELDS, nccl_version=(2, 27, 5))
    with pytest.raises(ValueError, match=r"cta_policy must be one of \['DEFAULT', 'EFFICIENCY', 'ZERO'\]; got 'FAST'"):
        nccl_options_for(CommConfig(cta_policy="FAST"))


@pytest.mark.parametrize(
    "n, version, ok",
    [(64, (2, 27, 5), True), (64, (2, 21, 5), False), (32, (2, 21, 5), True), (0, None, False), (65, None, False)],
)
def test_channel_domain_depends_on_nccl_version(n, version, ok):
    cfg = CommConfig(n_channels=n)
    if ok:
        assert nccl_options_for(cfg, nccl_version=version)["config"]["max_ctas"] == n
    else:
        with pytest.raises(ValueError, match=rf"n_channels must be an integer in 1\.\.(32|64).*got {n}"):
            nccl_options_for(cfg, nccl_version=version)


def test_cga_domain():
    with pytest.raises(ValueError, match=r"cga_cluster_size must be an integer in 0\.\.8; got 9"):
        nccl_options_for(CommConfig(cga_cluster_size=9))


def test_algorithm_and_protocol_are_scoped_per_nccl_function():
    env = nccl_options_for(CommConfig(algorithm="Tree", protocol="LL"), tag="dp")["env"]
    assert env == {"NCCL_ALGO": "allreduce:Tree", "NCCL_PROTO": "allreduce:LL", "LAGOM_TUNER_COMM_TAG": "dp"}
    env = nccl_options_for(CommConfig(algorithm="nvls"), op="all_gather")["env"]
    assert env == {"NCCL_ALGO": "allgather:NVLS"}
    env = nccl_options_for(CommConfig(algorithm="PAT"))["env"]
    assert env == {"NCCL_ALGO": "allgather:PAT;reducescatter:PAT"}
    env = nccl_options_for(CommConfig(protocol="simple"))["env"]
    assert env == {
        "NCCL_PROTO": "broadcast:Simple;reduce:Simple;allgather:Simple;reducescatter:Simple;allreduce:Simple"
    }


def test_tuner_plugin_mode_sets_no_algo_env():
    env = nccl_options_for(
        CommConfig(algorithm="Ring", protocol="LL128", n_channels=4), use_tuner_plugin=True, tag="tp"
    )["env"]
    assert env == {"LAGOM_TUNER_COMM_TAG": "tp"}


@pytest.mark.parametrize(
    "cfg, op, message",
    [
        (CommConfig(protocol="LL128"), None, "LL128 is never forced"),
        (CommConfig(algorithm="NVLS", protocol="LL"), None, "NVLS with the Simple protocol only"),
        (CommConfig(algorithm="Tree"), "all_gather", "Tree does not implement all_gather"),
        (CommConfig(algorithm="Ring"), "send", "send is point-to-point"),
        (CommConfig(algorithm="Ring"), "gather", "op must be one of"),
        (CommConfig(algorithm="Butterfly"), None, "algorithm 'Butterfly' is not one of"),
        (CommConfig(protocol="LL256"), None, "protocol 'LL256' is not one of"),
    ],
)
def test_algorithm_protocol_refusals(cfg, op, message):
    with pytest.raises(ValueError, match=message):
        nccl_options_for(cfg, op=op)


def test_per_communicator_algorithm_needs_nccl_224():
    with pytest.raises(ValueError, match="needs NCCL >= 2.24.*2.21.5: use the tuner plugin"):
        nccl_options_for(CommConfig(algorithm="Ring"), nccl_version=(2, 21, 5))
    assert nccl_options_for(CommConfig(algorithm="Ring"), nccl_version=(2, 21, 5), use_tuner_plugin=True)["env"] == {}


@pytest.mark.parametrize("tag", ["", "has space", "x" * 64, "semi;colon"])
def test_bad_tags_are_refused(tag):
    with pytest.raises(ValueError, match="tag must be 1-63 characters"):
        nccl_options_for(CommConfig(), tag=tag)


def test_unknown_config_attribute_is_refused():
    with pytest.raises(ValueError, match="no attribute 'cta_policy'"):
        build_options({"cta_policy": 1}, options_cls=make_options_cls(TORCH_25_FIELDS))


@pytest.mark.parametrize("var", sorted(PER_COMMUNICATOR_OVERRIDES))
def test_every_override_variable_is_refused(var):
    with pytest.raises(ValueError, match=rf"{var}='4' overrides {PER_COMMUNICATOR_OVERRIDES[var].split()[0]}"):
        check_env_conflicts({var: "4", "PATH": "/bin"}, use_tuner_plugin=False)


def test_algo_env_refused_only_with_tuner_plugin():
    env = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    check_env_conflicts(env, use_tuner_plugin=False)
    with pytest.raises(ValueError) as info:
        check_env_conflicts(env, use_tuner_plugin=True)
    assert "NCCL_ALGO='Ring'" in str(info.value) and "NCCL_PROTO='Simple'" in str(info.value)


def test_all_conflicts_reported_together_and_empty_counts_as_set():
    with pytest.raises(ValueError) as info:
        check_env_conflicts(
            {"NCCL_MAX_CTAS": "", "NCCL_CGA_CLUSTER_SIZE": "2", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"},
            use_tuner_plugin=False,
        )
    msg = str(info.value)
    assert "NCCL_MAX_CTAS=''" in msg and "NCCL_CGA_CLUSTER_SIZE='2'" in msg
    check_env_conflicts({"TORCH_NCCL_USE_COMM_NONBLOCKING": "0", "NCCL_DEBUG": "INFO"}, use_tuner_plugin=True)


def test_nonblocking_matters_only_where_torch_cannot_make_an_entry_blocking():
    # entries set NCCLConfig.blocking = 1, which torch's useNonblocking() honours before the variable
    check_env_conflicts({"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}, use_tuner_plugin=True)
    with pytest.raises(ValueError, match="TORCH_NCCL_USE_COMM_NONBLOCKING='1' creates communicators in a background"):
        check_env_conflicts({"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}, use_tuner_plugin=True, blocking_bound=False)


def test_only_variables_that_override_a_knob_the_entry_sets_conflict():
    env = {"NCCL_MAX_CTAS": "8", "NCCL_ALGO": "Ring"}
    check_env_conflicts(env, use_tuner_plugin=True, config=CommConfig(cga_cluster_size=2))
    with pytest.raises(ValueError, match="NCCL_MAX_CTAS='8'") as info:
        check_env_conflicts(env, use_tuner_plugin=True, config=CommConfig(n_channels=4))
    assert "NCCL_ALGO" not in str(info.value)


def test_scoped_env_restores_previous_values():
    environ = {"NCCL_ALGO": "Ring", "OTHER": "1"}
    with scoped_env({"NCCL_ALGO": "allreduce:Tree", "LAGOM_TUNER_COMM_TAG": "dp"}, environ):
        assert environ == {"NCCL_ALGO": "allreduce:Tree", "LAGOM_TUNER_COMM_TAG": "dp", "OTHER": "1"}
    assert environ == {"NCCL_ALGO": "Ring", "OTHER": "1"}
    with pytest.raises(KeyError):
        with scoped_env({"LAGOM_TUNER_COMM_TAG": "tp"}, environ):
            raise KeyError("creation failed")
    assert environ == {"NCCL_ALGO": "Ring", "OTHER": "1"}


def test_nccl_version_codes():
    assert nccl_version_tuple((2, 27, 5)) == (2, 27, 5)
    assert nccl_version_tuple(22105) == (2, 21, 5)
    assert nccl_version_tuple(2708) == (2, 7, 8)
    assert nccl_version_tuple(None) is None


def _torch_has_nccl():
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


@pytest.mark.skipif(_torch_has_nccl(), reason="this torch has NCCL; the refusal is for CPU builds")
def test_clean_refusal_without_nccl(monkeypatch):
    monkeypatch.delenv("NCCL_MAX_CTAS", raising=False)
    with pytest.raises(RuntimeError, match=r"^NCCL is not available: torch .* was built without NCCL"):
        create_nccl_pool_entry([0, 1], CommConfig(n_channels=4), tag="dp", use_tuner_plugin=False)
    with pytest.raises(RuntimeError, match="NCCL is not available"):
        nccl_config_fields()
    assert "LAGOM_TUNER_COMM_TAG" not in os.environ


def test_comm_tag_sanitises_and_keeps_long_descriptions_distinct():
    from lagom_megatron.nccl.pool import comm_tag

    assert comm_tag("LAGOM_POOL_DP_plugin_any_2") == "LAGOM_POOL_DP_plugin_any_2"
    assert comm_tag("pool dp=4;x") == "pool_dp_4_x"
    long_a, long_b = "LAGOM_POOL_DP_CP_" + "a" * 60, "LAGOM_POOL_DP_CP_" + "a" * 59 + "b"
    assert len(comm_tag(long_a)) == 63 and comm_tag(long_a) != comm_tag(long_b)
    nccl_options_for(CommConfig(), tag=comm_tag(long_a))  # accepted by the tag check


def test_backend_keys_per_mechanism():
    from lagom_megatron.nccl.pool import NcclPoolBackend

    tuner = NcclPoolBackend(use_tuner_plugin=True)
    env = NcclPoolBackend(use_tuner_plugin=False)
    assert tuner.name == env.name == "nccl"
    assert tuner.entry_key(CommConfig()) is None and env.entry_key(CommConfig()) is None
    cfg = CommConfig(n_channels=4, protocol="Simple", chunk_size=131072)
    assert tuner.entry_key(cfg) == ("plugin", "any", "any", "any", "env-table")
    assert tuner.entry_key(CommConfig(n_channels=8, cga_cluster_size=2)) == ("plugin", "any", "2", "any", "env-table")
    assert env.entry_key(cfg) == ("env", "4", "any", "Simple", "any", "any")
    assert env.entry_key(CommConfig(chunk_size=131072)) is None, "chunk size needs the plugin"
    assert tuner.entry_key(CommConfig(chunk_size=131072)) == ("plugin", "any", "any", "any", "env-table")
    with pytest.raises(ValueError, match="LL128 is never forced"):
        env.entry_key(CommConfig(protocol="LL128"))
    assert tuner.entry_key(CommConfig(protocol="LL128")) == ("plugin", "any", "any", "any", "env-table")


def test_plugin_backend_probes_per_communicator_and_plans_per_table():
    from lagom_megatron.nccl.pool import NcclPoolBackend

    backend = NcclPoolBackend(use_tuner_plugin=True)
    probe = CommConfig(n_channels=4, protocol="Simple")
    backend.plugin_active = False  # warm-up probes: no plan table exists yet
    assert backend.entry_key(probe) == ("env", "4", "any", "Simple", "any", "any")
    backend.plugin_active = True
    backend.tuner_table, backend.table_id = "run/tuner_table.rank0.csv", "46323ebface1"
    first = backend.entry_key(probe)
    backend.table_id = "b97327b5e29a"
    assert first == ("plugin", "any", "any", "any", "46323ebface1") != backend.entry_key(probe), (
        "a new table must get new communicators: the plugin reads it only at creation"
    )


def test_backend_mode_never_follows_the_variable_text(monkeypatch):
    """The launch sets NCCL_TUNER_PLUGIN on every rank (plugin_launch.launch_env), so its text says
    nothing about whether NCCL loaded the plugin: the backend stays in communicator mode until the
    agreed capabilities say ``tuner``."""
    from lagom_megatron.nccl.pool import NcclPoolBackend

    monkeypatch.setenv("NCCL_TUNER_PLUGIN", "/opt/libnccl-tuner-lagom.so")
    backend = NcclPoolBackend()
    assert backend.use_tuner_plugin is False and backend.plugin_active is False
    assert backend.entry_key(CommConfig(algorithm="Ring", n_channels=4))[0] == "env"
    assert NcclPoolBackend(use_tuner_plugin=True).entry_key(CommConfig(algorithm="Ring", n_channels=4))[0] == "plugin"


@pytest.mark.skipif(_torch_has_nccl(), reason="this torch has NCCL; the refusal is for CPU builds")
def test_backend_create_group_refuses_without_nccl():
    from lagom_megatron.nccl.pool import NcclPoolBackend

    with pytest.raises(RuntimeError, match="^NCCL is not available"):
        NcclPoolBackend(use_tuner_plugin=False).create_group((0, 1), CommConfig(n_channels=2), "LAGOM_POOL_DP_env_2")


def test_entry_tags_extend_the_group_name():
    from lagom_megatron.nccl.pool import NcclPoolBackend, pool_entry_tag

    backend = NcclPoolBackend(use_tuner_plugin=True)
    # CommPool's description: LAGOM_POOL_<GROUP>_<key parts joined by _>
    assert backend.tag_for("LAGOM_POOL_DP_CP_plugin_any_2") == "dp_cp/plugin_any_2"
    assert backend.tag_for("LAGOM_POOL_TP_env_4_Ring_Simple_any_any") == "tp/env_4_Ring_Simple_any_any"
    assert backend.tag_for("LAGOM_POOL_DP_plugin_any_any", group="dp") == "dp/plugin_any_any"
    assert backend.tag_for("something else") == "something_else"
    assert pool_entry_tag("ep", "x" * 80).startswith("ep/") and len(pool_entry_tag("ep", "x" * 80)) == 63


def test_comm_tag_scope_sets_and_restores():
    from lagom_megatron.nccl.pool import comm_tag_scope

    environ = {}
    with comm_tag_scope("dp", environ):
        assert environ == {"LAGOM_TUNER_COMM_TAG": "dp"}
    assert environ == {}
    with pytest.raises(ValueError, match="tag must be"):
        with comm_tag_scope("d p", environ):
            pass


def test_plugin_entries_get_cta_bounds_so_planned_channels_are_not_capped():
    from lagom_megatron.nccl.pool import NcclPoolBackend

    backend = NcclPoolBackend(use_tuner_plugin=True)
    backend.cta_bound = 64  # the plan's largest channel count
    entry = backend._entry_config(CommConfig(n_channels=16, protocol="LL128", chunk_size=262144))
    assert entry == CommConfig(n_channels=64)
    opts = nccl_options_for(entry, use_tuner_plugin=True)["config"]
    # NCCL caps the plugin's nChannels at comm->nChannels, which min = max = 64 sets (connect.cc:496-503)
    assert (opts["min_ctas"], opts["max_ctas"]) == (64, 64)
    assert backend.entry_key(CommConfig(n_channels=16)) == ("plugin", "any", "any", "64", "env-table")


def test_entry_memory_estimate_follows_nccl_buffer_constants():
    from lagom_megatron.nccl.pool import NcclPoolBackend, estimate_entry_bytes

    # LL 8*512*8*16 + LL128 120*640*8*8 + Simple 4 MiB per channel (init.cc:810-824)
    assert estimate_entry_bytes(1) == 524288 + 4915200 + 4194304 == 9633792
    assert estimate_entry_bytes(16) == 16 * 9633792
    # NVLS: 2 x 128 KiB x 8 steps per channel and head (nvls.cc:425-430): 64 channels x 8 heads = 1 GiB
    assert estimate_entry_bytes(64, nvls_heads=8) - estimate_entry_bytes(64) == 2**30
    assert estimate_entry_bytes(None) == 32 * 9633792
    b = NcclPoolBackend(use_tuner_plugin=False)
    assert b.estimate_bytes(CommConfig(n_channels=8, protocol="Simple")) == 8 * 9633792


def test_preflight_refuses_what_would_have_crashed_creation():
    from lagom_megatron.nccl.pool import entry_options

    # NCCL 2.21: a per-communicator protocol (the Simple probe) is refused before any new_group
    with pytest.raises(ValueError, match="needs NCCL >= 2.24"):
        entry_options(
            CommConfig(protocol="Simple", n_channels=16),
            tag="dp/x",
            use_tuner_plugin=False,
            op="all_reduce",
            nccl_version=(2, 21, 5),
            environ={},
        )
    with pytest.raises(ValueError, match="NCCL_MIN_CTAS='2'"):
        entry_options(
            CommConfig(n_channels=16),
            tag="dp/x",
            use_tuner_plugin=False,
            op="all_reduce",
            nccl_version=(2, 27, 5),
            environ={"NCCL_MIN_CTAS": "2"},
        )
    got = entry_options(
        CommConfig(n_channels=16),
        tag="dp/x",
        use_tuner_plugin=False,
        op="all_reduce",
        nccl_version=(2, 27, 5),
        environ={"NCCL_ALGO": "Ring", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"},
    )
    assert got["config"]["min_ctas"] == 16 and got["env"] == {"LAGOM_TUNER_COMM_TAG": "dp/x"}


def test_first_use_check_reads_the_plugin_status_in_process():
    from lagom_megatron.nccl.plugin_status import PluginStatus
    from lagom_megatron.nccl.pool import NcclPoolBackend

    status = {
        "now": PluginStatus(
            path="/x/libnccl-tuner-lagom.so", abi_version=6, init_count=1, row_hits=(), table_loaded=False
        )
    }
    backend = NcclPoolBackend(use_tuner_plugin=True, status_reader=lambda: status["now"])
    backend.preflight(CommConfig(cga_cluster_size=2))  # remembers the init count before creation
    status["now"] = PluginStatus(
        path="/x/libnccl-tuner-lagom.so", abi_version=6, init_count=2, row_hits=(), table_loaded=False
    )
    with pytest.raises(RuntimeError, match="did not load the plan table"):
        backend.verify()  # the table was unreadable on this rank
    backend.preflight(CommConfig(cga_cluster_size=2))
    with pytest.raises(RuntimeError, match="did not initialise lagom's plugin for the new entries"):
        backend.verify()  # no new communicator went through the plugin
    status["now"] = None
    with pytest.raises(RuntimeError, match="not loaded by NCCL in this process"):
        backend.verify()
    status["now"] = PluginStatus(
        path="/x/libnccl-tuner-lagom.so", abi_version=6, init_count=3, row_hits=(0, 2), table_loaded=True
    )
    backend.verify()
    # an earlier plan's table is still "loaded", but this table failed to load in the new entries
    backend.preflight(CommConfig(cga_cluster_size=2))
    status["now"] = PluginStatus(
        path="/x/libnccl-tuner-lagom.so",
        abi_version=6,
        init_count=4,
        row_hits=(0, 2),
        table_loaded=True,
        table_failures=1,
    )
    with pytest.raises(RuntimeError, match=r"did not load the plan table .*\(1 failed load"):
        backend.verify()
    NcclPoolBackend(use_tuner_plugin=False, status_reader=lambda: None).verify()  # nothing to check without the plugin


def _fake_nccl(monkeypatch, calls):
    """Stand-ins for (torch, ProcessGroupNCCL, torch.distributed) as ``create_nccl_pool_entry`` calls them."""
    import types

    from lagom_megatron.nccl import pool as pool_mod

    options_cls = make_options_cls(TORCH_28_FIELDS)
    torch_ = types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 0, synchronize=lambda d: None),
        device=lambda kind, i=None: f"{kind}:{i}",
        zeros=lambda n, device=None: [0.0] * n,
    )

    def new_group(ranks, backend, pg_options, timeout=None, group_desc=None, device_id=None):
        calls.append(
            {
                "ranks": ranks,
                "opts": pg_options,
                "env_algo": os.environ.get("NCCL_ALGO"),
                "table": os.environ.get("LAGOM_TUNER_CONFIG"),
                "tag": os.environ.get("LAGOM_TUNER_COMM_TAG"),
            }
        )
        return "entry"

    dist_ = types.SimpleNamespace(
        is_initialized=lambda: True, new_group=new_group, get_rank=lambda: 0, all_reduce=lambda t, group=None: None
    )
    pg = types.SimpleNamespace(Options=options_cls)
    monkeypatch.setattr(pool_mod, "nccl_module_parts", lambda: (torch_, pg, dist_))
    monkeypatch.setattr(pool_mod, "runtime_nccl_version", lambda: (2, 27, 5))
    # no lagom library mapped in this process (another test may have loaded one): names go through the environment
    monkeypatch.setattr(pool_mod, "_set_next_comm", lambda tag, table: False)
    return options_cls


def test_entry_inherits_its_groups_options_and_its_own_knobs_win(monkeypatch):
    from lagom_megatron.nccl.pool import create_nccl_pool_entry, parent_options

    calls = []
    options_cls = _fake_nccl(monkeypatch, calls)
    parent_opts = options_cls(is_high_priority_stream=True)
    # Megatron's --nccl-communicator-config-path for this group: CTAs 4..8, CGA 2, SHARP on
    parent_opts.config.min_ctas, parent_opts.config.max_ctas = 4, 8
    parent_opts.config.cga_cluster_size, parent_opts.config.collnet_enable, parent_opts.config.net_name = 2, 1, "IB"

    class Parent:
        def _get_backend(self, device):
            return type("B", (), {"options": parent_opts})()

    inherited = parent_options(Parent())
    assert inherited == {
        "is_high_priority_stream": True,
        "config": {"min_ctas": 4, "max_ctas": 8, "cga_cluster_size": 2, "collnet_enable": 1, "net_name": "IB"},
    }
    create_nccl_pool_entry(
        [1, 0],
        CommConfig(n_channels=16, algorithm="Ring"),
        tag="dp/x",
        use_tuner_plugin=False,
        op="all_reduce",
        inherited=inherited,
    )
    (call,) = calls
    cfg = call["opts"].config
    assert call["opts"].is_high_priority_stream is True and call["ranks"] == [0, 1]
    assert (cfg.min_ctas, cfg.max_ctas, cfg.nvls_ctas) == (16, 16, 16)  # the entry's channels win
    assert (cfg.cga_cluster_size, cfg.collnet_enable, cfg.net_name, cfg.blocking) == (2, 1, "IB", 1)
    assert call["env_algo"] == "allreduce:Ring" and "NCCL_ALGO" not in os.environ  # set around creation only
    assert parent_options(object()) is None  # a group without an NCCL backend (gloo): nothing to inherit


def test_every_entry_is_created_with_an_explicit_table(monkeypatch):
    """A pool entry never reads the table of the process environment (a user's LAGOM_TUNER_CONFIG,
    or NCCL_TUNER_CONFIG_FILE, which the plugin reads only when LAGOM_TUNER_CONFIG is unset): probe
    entries and communicator-mode entries get ``none`` (no table, no fallback; the C harness case
    ``explicit_no_table``), plugin entries of a plan get the plan's table, and the user's values are
    back after creation."""
    from lagom_megatron.nccl.options import TUNER_NO_TABLE
    from lagom_megatron.nccl.pool import NcclPoolBackend

    calls = []
    _fake_nccl(monkeypatch, calls)
    monkeypatch.setenv("LAGOM_TUNER_CONFIG", "/runs/user_plan.csv")
    monkeypatch.setenv("NCCL_TUNER_CONFIG_FILE", "/runs/example_plugin.csv")
    backend = NcclPoolBackend(use_tuner_plugin=True, tuner_table="/runs/tuner_table.rank0.csv")
    backend.plugin_active = False  # the warm-up probes
    backend.create_group((0, 1), CommConfig(n_channels=8), "LAGOM_POOL_DP_env_8_any_any_any_any", group="dp")
    backend.plugin_active = True  # the plan
    backend.cta_bounds = {"dp": 8}
    backend.create_group((0, 1), CommConfig(n_channels=8, protocol="LL"), "LAGOM_POOL_DP_plugin_x", group="dp")
    NcclPoolBackend(use_tuner_plugin=False).create_group(
        (0, 1), CommConfig(n_channels=4), "LAGOM_POOL_TP_env_4", group="tp"
    )
    assert (
        [c["table"] for c in calls]
        == [TUNER_NO_TABLE, "/runs/tuner_table.rank0.csv", TUNER_NO_TABLE]
        == ["none", "/runs/tuner_table.rank0.csv", "none"]
    )
    assert [c["tag"] for c in calls] == ["dp/env_8_any_any_any_any", "dp/plugin_x", "tp/env_4"]
    assert os.environ["LAGOM_TUNER_CONFIG"] == "/runs/user_plan.csv"
    assert os.environ["NCCL_TUNER_CONFIG_FILE"] == "/runs/example_plugin.csv"


def test_the_plugin_takes_the_tag_and_table_in_process_not_from_the_environment(monkeypatch):
    """With lagom's plugin mapped (NCCL loaded it for its first communicator), the entry's tag and plan table go
    through ``lagomSetNextComm`` and the environment holds neither while NCCL creates the communicator (N11:
    ``setenv`` races with ``getenv`` in torch's and NCCL's threads); they are cleared after, also on a failure."""
    calls, named = [], []
    _fake_nccl(monkeypatch, calls)
    monkeypatch.delenv("LAGOM_TUNER_CONFIG", raising=False)
    monkeypatch.delenv("LAGOM_TUNER_COMM_TAG", raising=False)
    plugin = lambda tag, table: named.append((tag, table)) or True  # noqa: E731
    create_nccl_pool_entry(
        [0, 1],
        CommConfig(n_channels=8),
        tag="dp/e1",
        use_tuner_plugin=True,
        tuner_table="/runs/plan.csv",
        next_comm=plugin,
    )
    assert named == [("dp/e1", "/runs/plan.csv"), (None, None)]
    assert (calls[0]["tag"], calls[0]["table"]) == (None, None), "nothing was set in the environment"

    from lagom_megatron.nccl import pool as pool_mod

    def refused(**kwargs):
        raise RuntimeError("NCCL error: unhandled system error")

    torch_, pg, _ = pool_mod.nccl_module_parts()
    monkeypatch.setattr(pool_mod, "nccl_module_parts", lambda: (torch_, pg, _Dist(refused)))
    named.clear()
    with pytest.raises(RuntimeError, match="unhandled system error"):
        create_nccl_pool_entry([0, 1], CommConfig(n_channels=8), tag="dp/e2", use_tuner_plugin=True, next_comm=plugin)
    assert named == [("dp/e2", "none"), (None, None)]


class _Dist:
    def __init__(self, new_group):
        self.new_group = new_group

    def is_initialized(self):
        return True
