"""Knob domains, scopes and validation against NCCL's documented rules."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.engine.knobs import (
    ALGORITHMS_FOR_OP, N_THREADS, CommConfig, applicable, domains, knob_scope, max_channels, probe_configs,
    tuner_abi, validate_config, validate_cta_range, validate_env,
)

CLUSTERS = ("h100-sxm-ib400", "a100-ib100", "h200-sxm", "cpu-gloo")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@pytest.mark.parametrize(
    "config, op, cluster, mechanism, fragments",
    [
        (CommConfig(algorithm="Foo"), "all_reduce", "h100-sxm-ib400", None, ["algorithm", "'Foo'", "Ring", "PAT"]),
        (CommConfig(protocol="LL64"), "all_reduce", "h100-sxm-ib400", None, ["protocol", "'LL64'", "LL128", "Simple"]),
        (CommConfig(algorithm="Tree"), "all_gather", "h100-sxm-ib400", None, ["algorithm", "'Tree'", "all_gather", "Ring"]),
        (CommConfig(algorithm="NVLS"), "all_reduce", "a100-ib100", None, ["algorithm", "'NVLS'", "sm80"]),
        (CommConfig(protocol="LL128"), "all_reduce", "h100-sxm-ib400", "communicator", ["protocol", "'LL128'", "corrupt", "Simple"]),
        (CommConfig(protocol="LL", algorithm="NVLS"), "all_reduce", "h100-sxm-ib400", None, ["protocol", "'LL'", "NVLS", "Simple"]),
        (CommConfig(n_threads=480), "all_reduce", "h100-sxm-ib400", None, ["n_threads", "480", "64, 128, 256, 512"]),
        (CommConfig(n_channels=0), "all_reduce", "h100-sxm-ib400", None, ["n_channels", "0", "1..64"]),
        (CommConfig(n_channels=65), "all_reduce", "h100-sxm-ib400", None, ["n_channels", "65", "1..64"]),
        (CommConfig(n_channels=33), "all_reduce", "a100-ib100", None, ["n_channels", "33", "1..32", "2.21.5"]),
        (CommConfig(n_channels=4), "send", "h100-sxm-ib400", None, ["n_channels", "4", "nccl#1598"]),
        (CommConfig(chunk_size=131072), "all_reduce", "h100-sxm-ib400", None, ["chunk_size", "131072", "2.30", "[None]"]),
        (CommConfig(chunk_size=1000, protocol="Simple"), "all_reduce", "h200-sxm", None, ["chunk_size", "1000", "4096..524288"]),
        (CommConfig(chunk_size=2**20, protocol="Simple"), "all_reduce", "h200-sxm", None, ["chunk_size", "1048576", "4096..524288"]),
        (CommConfig(chunk_size=100_000, protocol="Simple"), "all_reduce", "h200-sxm", None, ["chunk_size", "100000", "powers of two"]),
        (CommConfig(chunk_size=100_001, protocol="LL128"), "all_reduce", "h200-sxm", None, ["chunk_size", "100001", "multiples of 120"]),
        (CommConfig(cta_policy="FAST"), "all_reduce", "h100-sxm-ib400", None, ["cta_policy", "'FAST'", "EFFICIENCY"]),
        (CommConfig(cga_cluster_size=9), "all_reduce", "h100-sxm-ib400", None, ["cga_cluster_size", "9", "0..8"]),
        (CommConfig(cga_cluster_size=2), "all_reduce", "a100-ib100", None, ["cga_cluster_size", "2", "sm90"]),
        (CommConfig(algorithm="Ring"), "all_reduce", "cpu-gloo", None, ["algorithm", "gloo"]),
        (CommConfig(n_channels=32), "all_reduce", "cpu-gloo", None, ["n_channels", "32", "1..16"]),
        (CommConfig(chunk_size=1000), "all_reduce", "cpu-gloo", None, ["chunk_size", "1000", "4096"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_invalid_value_names_knob_value_and_allowed_set(config, op, cluster, mechanism, fragments):
    with pytest.raises(ValueError) as info:
        validate_config(config, op=op, cluster=ClusterSpec.load(cluster), mechanism=mechanism)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"got {message!r} but should mention {fragment!r}"


def test_ll128_is_a_preference_through_the_tuner_plugin_only(h100):
    validate_config(CommConfig(protocol="LL128", algorithm="Ring"), op="all_reduce", cluster=h100, mechanism="tuner")
    assert "LL128" not in domains(backend="nccl", cluster=h100, op="all_reduce", mechanism="communicator")["protocol"]


@pytest.mark.parametrize("min_ctas, max_ctas, fragment", [
    (8, 4, "min_ctas (8) must be <= max_ctas (4)"),
    (4, None, "min_ctas is set but max_ctas is not"),
    (None, 4, "max_ctas is set but min_ctas is not"),
    (0, 4, "min_ctas 0"),
    (1, 65, "max_ctas 65"),
])
def test_cta_range_rules(h100, min_ctas, max_ctas, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate_cta_range(min_ctas, max_ctas, cluster=h100)


def test_cta_range_limit_follows_nccl_version(h100, a100):
    validate_cta_range(1, 64, cluster=h100)
    with pytest.raises(ValueError, match="1..32"):
        validate_cta_range(1, 64, cluster=a100)
    assert (max_channels(h100), max_channels(a100)) == (64, 32)


@pytest.mark.parametrize("env, fragment", [
    ({"NCCL_PROTO": "LL128"}, "LL128"),
    ({"NCCL_PROTO": "LL,LL128,Simple"}, "LL128"),
    ({"NCCL_ALGO": "NVLS"}, "Ring"),
    ({"NCCL_ALGO": "CollNetDirect,Tree"}, "Ring"),
    ({"NCCL_ALGO": "ring,foo"}, "'foo'"),
    ({"NCCL_NTHREADS": "480"}, "480"),
    ({"NCCL_BUFFSIZE": "1000000"}, "powers of two"),
])
def test_env_rules_reject(env, fragment):
    with pytest.raises(ValueError, match=fragment):
        validate_env(env)


def test_env_rules_accept_exclusions_and_per_function_lists():
    validate_env({"NCCL_PROTO": "^LL128", "NCCL_ALGO": "allreduce:nvls,ring;allgather:ring", "NCCL_NTHREADS": "256",
                  "NCCL_BUFFSIZE": "4194304"})
    validate_env({"NCCL_ALGO": "Ring,Tree"})


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("op", COLLECTIVES + ("send",))
@pytest.mark.parametrize("n_nodes", [1, 2])
def test_every_domain_value_validates(cluster, op, n_nodes):
    spec = ClusterSpec.load(cluster)
    group = 8 * n_nodes
    dom = domains(backend=spec.backend, cluster=spec, op=op, n_nodes=n_nodes, group_size=group)
    for knob, values in dom.items():
        for value in values:
            protocol = None
            if knob == "chunk_size" and spec.backend == "nccl" and value is not None:
                protocol = "Simple"
            validate_config(CommConfig(**{knob: value, **({"protocol": protocol} if protocol else {})}),
                            op=op, cluster=spec, n_nodes=n_nodes, group_size=group)


def test_algorithm_domains_follow_op_and_hardware(h100, a100):
    ar_one = domains(backend="nccl", cluster=h100, op="all_reduce", n_nodes=1, group_size=8)["algorithm"]
    ar_two = domains(backend="nccl", cluster=h100, op="all_reduce", n_nodes=2, group_size=16)["algorithm"]
    assert ar_one == ("Ring", "Tree", "NVLS")
    assert ar_two == ("Ring", "Tree", "NVLS", "NVLSTree")
    assert "NVLS" not in domains(backend="nccl", cluster=a100, op="all_reduce")["algorithm"]
    assert domains(backend="nccl", cluster=h100, op="all_gather", n_nodes=4, group_size=4)["algorithm"] == ("Ring", "PAT")
    assert set(domains(backend="nccl", cluster=h100, op="all_gather")["algorithm"]) <= set(ALGORITHMS_FOR_OP["all_gather"])
    assert domains(backend="nccl", cluster=h100, op="send")["algorithm"] == (None,)
    assert domains(backend="nccl", cluster=h100, op="all_reduce")["n_threads"] == N_THREADS


def test_scopes_per_mechanism_and_nccl_version():
    v227, v230, v221 = (2, 27, 5), (2, 30, 7), (2, 21, 5)
    assert knob_scope("chunk_size", backend="nccl", mechanism="tuner", nccl_version=v230) == "call"
    assert knob_scope("chunk_size", backend="nccl", mechanism="tuner", nccl_version=v227) is None
    assert knob_scope("n_channels", backend="nccl", mechanism="tuner", nccl_version=v227) == "call"
    assert knob_scope("n_channels", backend="nccl", mechanism="tuner", nccl_version=v221) == "communicator"
    assert knob_scope("n_channels", backend="nccl", mechanism="communicator", nccl_version=v227) == "communicator"
    assert knob_scope("n_channels", backend="nccl", mechanism="env", nccl_version=v227) == "process"
    assert knob_scope("n_threads", backend="nccl", mechanism="tuner", nccl_version=v230) == "process"
    assert knob_scope("cta_policy", backend="nccl", mechanism="tuner", nccl_version=v227) == "communicator"
    assert knob_scope("cta_policy", backend="nccl", mechanism="tuner", nccl_version=v221) is None
    assert knob_scope("n_channels", backend="gloo") == "communicator"
    assert knob_scope("chunk_size", backend="gloo") == "call"
    assert knob_scope("algorithm", backend="gloo") is None
    assert [tuner_abi(v) for v in ((2, 18, 0), (2, 21, 5), (2, 22, 3), (2, 27, 5), (2, 28, 3), (2, 30, 7))] == [0, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="mechanism .* must be one of"):
        knob_scope("n_channels", backend="gloo", mechanism="tuner")


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_probe_configs_are_valid_for_every_op(cluster):
    spec = ClusterSpec.load(cluster)
    backend = spec.backend
    probes = probe_configs(backend, spec)
    assert 3 <= len(probes) <= 4
    assert len(set(probes)) == len(probes)
    for op in COLLECTIVES + ("send", "recv", "all_to_all"):
        for probe in probes:
            validate_config(applicable(probe, op=op, backend=backend), op=op, cluster=spec)
    assert (spec.nccl >= (2, 30, 0)) == any(p.chunk_size for p in probes) or backend == "gloo"
