"""NCCL knob rules: domains, scopes per mechanism and NCCL version, and validation against NCCL's
documented rules (``lagom_megatron.nccl.rules``)."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import ALGORITHMS_FOR_OP, N_THREADS, CommConfig, max_channels
from lagom_megatron.nccl.rules import (
    NcclRules,
    applicable,
    domains,
    knob_scope,
    probe_configs,
    process_env,
    tuner_abi,
    validate_config,
    validate_cta_range,
)

CLUSTERS = ("h100-sxm-ib400", "a100-ib100", "h200-sxm")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@pytest.mark.parametrize(
    "config, op, cluster, mechanism, fragments",
    [
        (CommConfig(algorithm="Foo"), "all_reduce", "h100-sxm-ib400", None, ["algorithm", "'Foo'", "Ring", "PAT"]),
        (CommConfig(protocol="LL64"), "all_reduce", "h100-sxm-ib400", None, ["protocol", "'LL64'", "LL128", "Simple"]),
        (
            CommConfig(algorithm="Tree"),
            "all_gather",
            "h100-sxm-ib400",
            None,
            ["algorithm", "'Tree'", "all_gather", "Ring"],
        ),
        (CommConfig(algorithm="NVLS"), "all_reduce", "a100-ib100", None, ["algorithm", "'NVLS'", "sm80"]),
        (
            CommConfig(protocol="LL128"),
            "all_reduce",
            "h100-sxm-ib400",
            "communicator",
            ["protocol", "'LL128'", "corrupt", "Simple"],
        ),
        (
            CommConfig(protocol="LL", algorithm="NVLS"),
            "all_reduce",
            "h100-sxm-ib400",
            None,
            ["protocol", "'LL'", "NVLS", "Simple"],
        ),
        (CommConfig(n_threads=480), "all_reduce", "h100-sxm-ib400", None, ["n_threads", "480", "64, 128, 256, 512"]),
        (CommConfig(n_channels=0), "all_reduce", "h100-sxm-ib400", None, ["n_channels", "0", "1..64"]),
        (CommConfig(n_channels=65), "all_reduce", "h100-sxm-ib400", None, ["n_channels", "65", "1..64"]),
        (CommConfig(n_channels=33), "all_reduce", "a100-ib100", None, ["n_channels", "33", "1..32", "2.21.5"]),
        (CommConfig(n_threads=256), "send", "h100-sxm-ib400", None, ["n_threads", "256", "NCCL_MAX_NTHREADS"]),
        (
            CommConfig(chunk_size=131072),
            "all_reduce",
            "a40-pcie-ib200",  # NCCL 2.27.5
            None,
            ["chunk_size", "131072", "2.30", "[None]"],
        ),
        (
            CommConfig(chunk_size=1000, protocol="Simple"),
            "all_reduce",
            "h200-sxm",
            None,
            ["chunk_size", "1000", "4096..524288"],
        ),
        (
            CommConfig(chunk_size=2**20, protocol="Simple"),
            "all_reduce",
            "h200-sxm",
            None,
            ["chunk_size", "1048576", "4096..524288"],
        ),
        (
            CommConfig(chunk_size=100_000, protocol="Simple"),
            "all_reduce",
            "h200-sxm",
            None,
            ["chunk_size", "100000", "powers of two"],
        ),
        (
            CommConfig(chunk_size=100_001, protocol="LL128"),
            "all_reduce",
            "h200-sxm",
            None,
            ["chunk_size", "100001", "multiples of 120"],
        ),
        (CommConfig(cta_policy="FAST"), "all_reduce", "h100-sxm-ib400", None, ["cta_policy", "'FAST'", "EFFICIENCY"]),
        (CommConfig(cga_cluster_size=9), "all_reduce", "h100-sxm-ib400", None, ["cga_cluster_size", "9", "0..8"]),
        (CommConfig(cga_cluster_size=2), "all_reduce", "a100-ib100", None, ["cga_cluster_size", "2", "sm90"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_value_names_knob_value_and_allowed_set(config, op, cluster, mechanism, fragments):
    with pytest.raises(ValueError) as info:
        validate_config(config, op=op, cluster=ClusterSpec.load(cluster), mechanism=mechanism or "tuner")
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"got {message!r} but should mention {fragment!r}"


def test_ll128_is_a_preference_through_the_tuner_plugin_only(h100):
    validate_config(CommConfig(protocol="LL128", algorithm="Ring"), op="all_reduce", cluster=h100, mechanism="tuner")
    assert "LL128" not in domains(cluster=h100, op="all_reduce", mechanism="communicator")["protocol"]


@pytest.mark.parametrize(
    "min_ctas, max_ctas, fragment",
    [
        (8, 4, "min_ctas (8) must be <= max_ctas (4)"),
        (4, None, "min_ctas is set but max_ctas is not"),
        (None, 4, "max_ctas is set but min_ctas is not"),
        (0, 4, "min_ctas 0"),
        (1, 65, "max_ctas 65"),
    ],
)
def test_cta_range_rules(h100, min_ctas, max_ctas, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate_cta_range(min_ctas, max_ctas, cluster=h100)


def test_cta_range_limit_follows_nccl_version(h100, a100):
    validate_cta_range(1, 64, cluster=h100)
    with pytest.raises(ValueError, match="1..32"):
        validate_cta_range(1, 64, cluster=a100)
    assert (max_channels(h100), max_channels(a100)) == (64, 32)


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("op", COLLECTIVES + ("send",))
@pytest.mark.parametrize("n_nodes", [1, 2])
def test_every_domain_value_validates(cluster, op, n_nodes):
    spec = ClusterSpec.load(cluster)
    group = 8 * n_nodes
    dom = domains(cluster=spec, op=op, n_nodes=n_nodes, group_size=group)
    for knob, values in dom.items():
        for value in values:
            protocol = None
            if knob == "chunk_size" and value is not None:
                protocol = "Simple"
            validate_config(
                CommConfig(**{knob: value, **({"protocol": protocol} if protocol else {})}),
                op=op,
                cluster=spec,
                n_nodes=n_nodes,
                group_size=group,
            )


def test_algorithm_domains_follow_op_and_hardware(h100, a100):
    ar_one = domains(cluster=h100, op="all_reduce", n_nodes=1, group_size=8)["algorithm"]
    ar_two = domains(cluster=h100, op="all_reduce", n_nodes=2, group_size=16)["algorithm"]
    assert ar_one == ("Ring", "Tree", "NVLS")
    # NVLS across nodes needs CollNet (NCCL 2.30 src/enqueue.cc:2008); this cluster has no SHARP
    assert ar_two == ("Ring", "Tree", "NVLSTree")
    import dataclasses

    sharp = dataclasses.replace(h100, collnet=True)
    assert "NVLS" in domains(cluster=sharp, op="all_reduce", n_nodes=2, group_size=16)["algorithm"]
    # PAT reduce-scatter is skipped by NCCL with AVG (enqueue.cc:2010-2012): never offered
    assert domains(cluster=h100, op="reduce_scatter", n_nodes=4, group_size=4)["algorithm"] == ("Ring",)
    assert "NVLS" not in domains(cluster=a100, op="all_reduce")["algorithm"]
    assert domains(cluster=h100, op="all_gather", n_nodes=4, group_size=4)["algorithm"] == ("Ring", "PAT")
    assert set(domains(cluster=h100, op="all_gather")["algorithm"]) <= set(ALGORITHMS_FOR_OP["all_gather"])
    assert domains(cluster=h100, op="send")["algorithm"] == (None,)
    assert domains(cluster=h100, op="all_reduce")["n_threads"] == N_THREADS


def test_scopes_per_mechanism_and_nccl_version():
    v227, v230, v221 = (2, 27, 5), (2, 30, 7), (2, 21, 5)
    assert knob_scope("chunk_size", mechanism="tuner", nccl_version=v230) == "call"
    assert knob_scope("chunk_size", mechanism="tuner", nccl_version=v227) is None
    assert knob_scope("n_channels", mechanism="tuner", nccl_version=v227) == "call"
    assert knob_scope("n_channels", mechanism="tuner", nccl_version=v221) == "communicator"
    assert knob_scope("n_channels", mechanism="communicator", nccl_version=v227) == "communicator"
    assert knob_scope("n_channels", mechanism="env", nccl_version=v227) == "process"
    assert knob_scope("n_threads", mechanism="tuner", nccl_version=v230) == "process"
    assert knob_scope("cta_policy", mechanism="tuner", nccl_version=v227) == "communicator"
    assert knob_scope("cta_policy", mechanism="tuner", nccl_version=v221) is None
    versions = ((2, 18, 0), (2, 21, 5), (2, 22, 3), (2, 27, 5), (2, 28, 3), (2, 30, 7), (2, 32, 3), (2, 32, 6))
    # 2.32.3's library still names tuner v6 as its newest; 2.32.6 looks up ncclTunerPlugin_v7 first
    assert [tuner_abi(v) for v in versions] == [0, 2, 3, 4, 5, 6, 6, 7]
    with pytest.raises(ValueError, match="mechanism .* must be one of"):
        knob_scope("n_channels", mechanism="gloo")


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_probe_configs_are_valid_for_every_op(cluster):
    spec = ClusterSpec.load(cluster)
    probes = probe_configs(spec)
    assert 4 <= len(probes) <= 5
    assert len(set(probes)) == len(probes)
    # a pool entry can make its stream high-priority (ProcessGroupNCCL.Options): one probe at NCCL's
    # own config on such a stream; the env mechanism makes no process groups
    assert CommConfig(high_priority_stream=True) in probes
    assert CommConfig(high_priority_stream=True) not in probe_configs(spec, mechanism="env")
    for op in COLLECTIVES + ("send", "recv", "all_to_all"):
        for probe in probes:
            validate_config(applicable(probe, op=op), op=op, cluster=spec)
    assert (spec.nccl >= (2, 30, 0)) == any(p.chunk_size for p in probes)


def test_nccl_rules_bind_mechanism_and_cluster(h100, gloo):
    rules = NcclRules(h100, mechanism="communicator")
    assert (rules.backend, rules.mechanism, rules.scope("n_channels")) == ("nccl", "communicator", "communicator")
    assert rules.domains(op="all_reduce") == domains(cluster=h100, op="all_reduce", mechanism="communicator")
    assert rules.probe_configs() == probe_configs(h100)
    assert rules.applicable(CommConfig(algorithm="Tree", n_channels=2), op="all_gather") == CommConfig(n_channels=2)
    with pytest.raises(ValueError, match="LL128"):
        rules.validate(CommConfig(protocol="LL128"), op="all_reduce")
    assert NcclRules(h100, backend="sim").backend == "sim"
    with pytest.raises(ValueError, match="mechanism for backend 'nccl' must be one of .*'magic'"):
        NcclRules(h100, mechanism="magic")
    with pytest.raises(ValueError, match="'cpu-gloo' is a gloo cluster"):
        NcclRules(gloo)
    with pytest.raises(ValueError, match="backends .*'mpi'"):
        NcclRules(h100, backend="mpi")


def test_process_scope_knobs_become_launch_variables(h100):
    """NCCL_NTHREADS only when a site left NCCL's 512; a process-wide channel cap as a two-ended range."""
    assert process_env({"n_threads": [512]}) == {}
    assert process_env({"n_threads": [256, 512]}) == {"NCCL_NTHREADS": "512"}
    assert process_env({"n_threads": [128, 256]}) == {"NCCL_NTHREADS": "256"}
    assert process_env({"n_channels": [4, 16]}) == {"NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "16"}
    assert NcclRules(h100).process_env({"n_threads": [64]}) == {"NCCL_NTHREADS": "64"}
