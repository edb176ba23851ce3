"""gloo's knob rules (``megatron.gloo.GlooRules``) and the backend choice (``megatron.backends.rules_for``)."""

from __future__ import annotations

import pytest

from lagom_megatron.engine.knobs import KNOB_ORDER, CommConfig
from lagom_megatron.megatron.pool.comm_pool import rules_for
from lagom_megatron.megatron.pool.gloo import GlooRules
from lagom_megatron.nccl.rules import NcclRules


@pytest.mark.parametrize(
    "config, fragments",
    [
        (CommConfig(algorithm="Ring"), ["algorithm", "gloo"]),
        (CommConfig(n_threads=256), ["n_threads", "gloo"]),
        (CommConfig(n_channels=32), ["n_channels", "32", "1..16"]),
        (CommConfig(n_channels=0), ["n_channels", "0", "1..16"]),
        (CommConfig(chunk_size=1000), ["chunk_size", "1000", "4096"]),
    ],
)
def test_invalid_value_names_knob_value_and_allowed_set(gloo, config, fragments):
    with pytest.raises(ValueError) as info:
        GlooRules(gloo).validate(config, op="all_reduce")
    for fragment in fragments:
        assert fragment in str(info.value), f"got {info.value!r} but should mention {fragment!r}"


def test_scopes_domains_and_probes(gloo):
    rules = GlooRules(gloo)
    assert {k: rules.scope(k) for k in KNOB_ORDER} == {
        "n_channels": "communicator",
        "chunk_size": "call",
        "n_threads": None,
        "protocol": None,
        "algorithm": None,
        "cta_policy": None,
        "cga_cluster_size": None,
        "net_peer_channels": None,
        "high_priority_stream": None,
    }
    with pytest.raises(ValueError, match="knob must be one of"):
        rules.scope("threads")
    dom = rules.domains(op="all_gather", n_nodes=1, group_size=2)
    assert dom["n_channels"] == (1, 2, 4) and dom["chunk_size"] == (None, 262144, 1048576, 4194304)
    assert all(v == (None,) for k, v in dom.items() if k not in ("n_channels", "chunk_size"))
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send"):
        for k, values in rules.domains(op=op).items():
            for v in values:
                rules.validate(CommConfig(**{k: v}), op=op)
        for probe in rules.probe_configs():
            rules.validate(rules.applicable(probe, op=op), op=op)
    assert rules.applicable(CommConfig(n_channels=4, n_threads=256, algorithm="Ring"), op="send") == CommConfig(
        n_channels=4
    )


def test_rules_for_picks_the_backend(gloo, h100):
    assert isinstance(rules_for("gloo", gloo), GlooRules)
    assert rules_for("nccl", h100, "env") == NcclRules(h100, mechanism="env")
    assert rules_for("sim", h100).backend == "sim"
    with pytest.raises(ValueError, match="backend must be one of .*'mpi'"):
        rules_for("mpi", h100)
    with pytest.raises(ValueError, match="mechanism for backend 'gloo' must be one of \\['gloo'\\]; got 'tuner'"):
        rules_for("gloo", gloo, "tuner")
    with pytest.raises(ValueError, match="'h100-sxm-ib400' is a nccl cluster"):
        rules_for("gloo", h100)
    with pytest.raises(ValueError, match="'h100-sxm-ib400' is a nccl cluster"):
        GlooRules(h100)  # the rules check themselves, as NcclRules does, whoever builds them
    with pytest.raises(ValueError, match="got 'communicator'"):
        GlooRules(gloo, mechanism="communicator")
    assert (GlooRules(gloo).backend, GlooRules(gloo).mechanism) == ("gloo", "gloo")
