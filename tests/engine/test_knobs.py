"""The knob space (``engine.knobs``): configs, value sets, and the ``KnobRules`` contract the
applying layers implement."""

from __future__ import annotations

import inspect

import pytest

from lagom_megatron.engine.knobs import (
    DEFAULT,
    KNOB_ORDER,
    CommConfig,
    KnobRules,
    chunk_domain,
    invalid_value,
    max_channels,
)
from lagom_megatron.megatron.pool.gloo import GlooRules
from lagom_megatron.nccl.rules import NcclRules


def test_comm_config_round_trip_and_unknown_field():
    cfg = CommConfig(algorithm="Ring", protocol="Simple", n_channels=4, chunk_size=131072)
    assert CommConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict() == {
        "algorithm": "Ring",
        "protocol": "Simple",
        "n_channels": 4,
        "chunk_size": 131072,
    }
    assert DEFAULT.is_default() and not cfg.is_default() and DEFAULT.to_dict() == {}
    with pytest.raises(ValueError, match=r"unknown CommConfig field\(s\) \['threads'\]"):
        CommConfig.from_dict({"threads": 4})


def test_channel_limit_and_chunk_grids(h100, a100, gloo):
    assert (max_channels(h100), max_channels(a100), max_channels(gloo)) == (64, 32, 16)  # NCCL 2.25 raised 32 -> 64
    assert (
        chunk_domain("Simple")[-1] == 524288 and chunk_domain("LL128")[-1] == 576000 and chunk_domain("LL")[-1] == 32768
    )
    assert (
        str(invalid_value("n_threads", 480, [64, 512], "NCCL_NTHREADS"))
        == "n_threads 480 is not allowed (NCCL_NTHREADS); allowed: [64, 512]"
    )


@pytest.mark.parametrize("rules_cls, cluster", [(NcclRules, "h100"), (GlooRules, "gloo")])
def test_both_applying_layers_implement_the_knob_rules_contract(rules_cls, cluster, request):
    rules = rules_cls(request.getfixturevalue(cluster))
    for name in (
        "scope",
        "domains",
        "site_domains",
        "for_sites",
        "probe_configs",
        "applicable",
        "validate",
        "process_env",
    ):
        want = inspect.signature(getattr(KnobRules, name))
        got = inspect.signature(getattr(rules_cls, name))
        assert list(got.parameters) == list(want.parameters), f"{rules_cls.__name__}.{name}{got} differs from {want}"
    assert {rules.cluster.name, rules.backend, rules.mechanism} and set(rules.domains(op="all_reduce")) == set(
        KNOB_ORDER
    )
