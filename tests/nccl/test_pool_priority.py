"""A plan's stream priority on NCCL pool entries: ``Options.is_high_priority_stream``, inheritance
from the site's group and the entry key (``nccl.pool``), with the stand-ins of ``test_pool``."""

from __future__ import annotations

from lagom_megatron.engine.knobs import CommConfig

from .test_pool import _fake_nccl


def test_a_plans_high_priority_stream_reaches_the_entrys_options(monkeypatch):
    """``high_priority_stream`` of a plan becomes ``Options(is_high_priority_stream=True)`` of the pool
    entry (torch's initNCCLComm takes the entry's NCCL stream from its pool at that priority) and
    wins over a normal-priority parent; without it the parent's priority is inherited. It is part
    of the entry's key in both mechanisms, so sites with and without it never share an entry."""
    from lagom_megatron.nccl.pool import NcclPoolBackend, create_nccl_pool_entry

    calls = []
    _fake_nccl(monkeypatch, calls)
    normal = {"is_high_priority_stream": False, "config": {}}
    create_nccl_pool_entry(
        [0, 1], CommConfig(high_priority_stream=True), tag="dp/x", use_tuner_plugin=True, inherited=normal
    )
    create_nccl_pool_entry(
        [0, 1],
        CommConfig(n_channels=4),
        tag="dp/y",
        use_tuner_plugin=True,
        inherited={"is_high_priority_stream": True, "config": {}},
    )
    create_nccl_pool_entry([0, 1], CommConfig(n_channels=4), tag="dp/z", use_tuner_plugin=True, inherited=normal)
    assert [c["opts"].is_high_priority_stream for c in calls] == [True, True, False]
    for plugin in (True, False):
        b = NcclPoolBackend(use_tuner_plugin=plugin)
        fast, plain = CommConfig(n_channels=4, high_priority_stream=True), CommConfig(n_channels=4)
        assert b.entry_key(fast, "dp") != b.entry_key(plain, "dp") and "hp" in b.entry_key(fast, "dp")
        assert b.entry_key(CommConfig(high_priority_stream=True), "dp") is not None  # needs its own entry
        assert b._entry_config(fast, "dp").high_priority_stream is True
