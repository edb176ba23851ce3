"""torch's two NCCL engines (``nccl.engine``): which one ``backend="nccl"`` builds, and lagom's calls on each.

The stand-ins carry the attributes torch 2.15.0 binds on each class (``dir()`` of
``torch._C._distributed_c10d.ProcessGroupNCCL`` / ``ProcessGroupNCCL2`` in the 2.15.0 wheel): both share
``Backend``'s (``options``, ``_enable_collectives_timing``, ``eager_connect_single_device``, ...) and
``_comm_ptr``, ``register_mem_pool``, ``deregister_mem_pool``, ``perform_nocolor_split``; only the legacy class has
``NCCLConfig``, the ``NCCL_CTA_POLICY_*`` constants, ``_group_start``/``_group_end``, ``comm_split_count``,
``get_runtime_nccl_version``, ``uid``. Both take the one ``ProcessGroupNCCL.Options`` class.
"""

from __future__ import annotations

import types

import pytest

from lagom_megatron.nccl import engine as eng
from lagom_megatron.nccl.pool import NcclPoolBackend, parent_options
from tests.nccl.test_pool import make_options_cls

OPTIONS = make_options_cls(("min_ctas", "max_ctas", "cga_cluster_size", "comm_name", "cta_policy"))


class _Backend:
    """``c10d::Backend``'s Python surface as both classes inherit it."""

    def __init__(self, options=None):
        self._options = options if options is not None else OPTIONS()
        self.calls = []

    @property
    def options(self):
        return self._options

    def _enable_collectives_timing(self):
        self.calls.append("timing")

    def eager_connect_single_device(self, device):
        self.calls.append(("eager", device))


class _BothClasses(_Backend):
    """What ``ProcessGroupNCCL`` and ``ProcessGroupNCCL2`` both bind beyond ``Backend`` (unrelated classes in torch)."""

    def _comm_ptr(self):
        return 0

    def register_mem_pool(self, pool, symm=False):
        self.calls.append(("register", pool, symm))

    def deregister_mem_pool(self, pool):
        self.calls.append(("deregister", pool))

    def perform_nocolor_split(self, device):
        self.calls.append(("nocolor", device))


class ProcessGroupNCCL2(_BothClasses):
    pass


class ProcessGroupNCCL(_BothClasses):
    NCCL_CTA_POLICY_DEFAULT, NCCL_CTA_POLICY_EFFICIENCY, NCCL_CTA_POLICY_ZERO = 0, 1, 2

    def comm_split_count(self):
        return 0

    def _group_start(self):
        pass

    def _group_end(self):
        pass


class _Group:
    """torch's ``ProcessGroup`` as lagom reads it: ``_get_backend(device)``, ``group_name``, ``group_desc``."""

    def __init__(self, backend, name="3", desc="DATA_PARALLEL_GROUP"):
        self.backend, self._name, self._desc = backend, name, desc

    group_name = property(lambda self: self._name)
    group_desc = property(lambda self: self._desc)

    def _get_backend(self, device):
        return self.backend


@pytest.fixture
def torch_classes(monkeypatch):
    """``torch.distributed`` as torch 2.15 exports both classes (a CPU torch may export neither)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "ProcessGroupNCCL", ProcessGroupNCCL, raising=False)
    monkeypatch.setattr(dist, "ProcessGroupNCCL2", ProcessGroupNCCL2, raising=False)
    monkeypatch.delattr(dist, "ProcessGroupNCCLLazy", raising=False)


@pytest.mark.parametrize(
    "version, value, want",
    [
        ("2.15.0+cu132", None, eng.NCCL2),
        ("2.15.0a0+nv25.10", None, eng.NCCL2),  # an NGC build of 2.15
        ("2.15.0", "0", eng.LEGACY),
        ("2.15.0", "false", eng.NCCL2),  # torch compares with "0" exactly
        ("2.16.0", None, eng.NCCL2),
        ("2.14.1", None, eng.LEGACY),
        ("2.14.1", "1", eng.NCCL2),
        ("2.14.1", "true", eng.LEGACY),  # ... and with "1" exactly on 2.14
        ("2.13.0+cpu", "1", eng.LEGACY),  # no nccl2 before 2.14
    ],
)
def test_predicted_engine_follows_torchs_registration_rule(version, value, want):
    env = {} if value is None else {eng.ENGINE_ENV: value}
    choice = eng.predicted_engine(version, env)
    assert choice.engine == want
    line = choice.describe()
    assert line.startswith("NCCL engine: ") and version in line and eng.ENGINE_ENV in line


def test_the_installed_torchs_registrar_agrees_with_the_prediction(monkeypatch):
    """Runs this torch's own ``_register_builtin_nccl_backend`` (the "nccl" entry point) under each value of the
    variable and compares the creator it registers with ``predicted_engine``."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    registrar = getattr(c10d, "_register_builtin_nccl_backend", None)
    if registrar is None or not hasattr(c10d, "_create_nccl2_process_group"):
        pytest.skip(f"torch {torch.__version__} has no nccl2 engine (torch 2.14+)")
    saved = set(getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", ()))
    seen = {}
    monkeypatch.setattr(c10d.Backend, "register_backend", lambda name, fn, **kw: seen.update(creator=fn))
    try:
        for value in (None, "0", "1", "false"):
            if value is None:
                monkeypatch.delenv(eng.ENGINE_ENV, raising=False)
            else:
                monkeypatch.setenv(eng.ENGINE_ENV, value)
            registrar()
            built = eng.NCCL2 if seen["creator"] is c10d._create_nccl2_process_group else eng.LEGACY
            assert built == eng.predicted_engine(torch.__version__).engine, value
    finally:
        if hasattr(c10d, "_FR_SELF_RECORDING_BACKENDS"):
            c10d._FR_SELF_RECORDING_BACKENDS.clear()
            c10d._FR_SELF_RECORDING_BACKENDS.update(saved)


@pytest.mark.parametrize("cls, want", [(ProcessGroupNCCL, eng.LEGACY), (ProcessGroupNCCL2, eng.NCCL2)])
def test_each_class_is_told_apart_and_has_every_call_lagom_makes(torch_classes, cls, want):
    backend = cls()
    group = _Group(backend)
    assert eng.backend_engine(backend) == want and eng.runtime_engine(group) == want
    assert eng.missing_calls(backend) == ()
    lines = eng.engine_lines(group)
    assert lines == [
        f"lagom: NCCL engine {'nccl2 (ProcessGroupNCCL2)' if want == eng.NCCL2 else 'legacy ProcessGroupNCCL'}"
        f" ({eng.ENGINE_ENV}{'=0 gives the legacy class' if want == eng.NCCL2 else ' picks the engine'})"
    ]


@pytest.mark.parametrize("cls", [ProcessGroupNCCL, ProcessGroupNCCL2])
def test_pool_calls_work_on_both_classes(monkeypatch, torch_classes, cls):
    """``parent_options`` reads the group's ``options`` and ``register_memory`` passes ``symm`` on either class."""
    import torch

    from lagom_megatron.nccl import pool as pool_mod

    opts = OPTIONS(is_high_priority_stream=True)
    opts.config.min_ctas, opts.config.max_ctas = 2, 8
    backend = cls(opts)
    pg = types.SimpleNamespace(Options=OPTIONS)
    monkeypatch.setattr(pool_mod, "nccl_module_parts", lambda: (torch, pg, None))
    assert parent_options(_Group(backend)) == {
        "is_high_priority_stream": True,
        "config": {"min_ctas": 2, "max_ctas": 8},
    }
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    NcclPoolBackend(use_tuner_plugin=True).register_memory(_Group(backend), [("pool-a", True), ("pool-b", False)])
    assert [c for c in backend.calls if c[0] == "register"] == [
        ("register", "pool-a", True),
        ("register", "pool-b", False),
    ]


def test_a_backend_without_a_call_gets_one_warning_naming_the_variable(monkeypatch):
    """A torch whose nccl2 class binds no ``register_mem_pool``: one warning, naming the call and the variable."""
    import torch.distributed as dist

    class Bare(_Backend):
        pass

    monkeypatch.setattr(dist, "ProcessGroupNCCL2", Bare, raising=False)
    backend = Bare()
    assert eng.missing_calls(backend) == ("register_mem_pool",)
    info, warning = eng.engine_lines(_Group(backend))
    assert "nccl2" in info and "WARNING" not in info
    assert "WARNING" in warning and "register_mem_pool" in warning and f"{eng.ENGINE_ENV}=0" in warning


def test_no_cuda_backend_means_no_engine_and_no_lines():
    class GlooOnly:
        def _get_backend(self, device):
            raise RuntimeError("no backend for cuda")

    assert eng.runtime_engine(GlooOnly()) is None and eng.engine_lines(GlooOnly()) == []


def test_the_doctor_names_the_engine_the_run_will_get(monkeypatch):
    from lagom_megatron.launch import doctor
    from lagom_megatron.megatron.hooks import versions

    def torch_at(version):
        monkeypatch.setattr(versions, "installed_torch", lambda: versions.InstalledVersion("torch", version, "", False))

    gpu, gloo = {"backend": "nccl"}, {"backend": "gloo"}
    torch_at("2.15.0+cu132")
    assert doctor.engine_line({}, gpu) == (
        "lagom doctor: NCCL engine: nccl2 (ProcessGroupNCCL2): the default of torch 2.15.0+cu132; "
        "TORCH_DIST_USE_NCCL2=0 gives the legacy ProcessGroupNCCL"
    )
    assert "legacy ProcessGroupNCCL: torch 2.15.0+cu132 with TORCH_DIST_USE_NCCL2=0" in doctor.engine_line(
        {"TORCH_DIST_USE_NCCL2": "0"}, gpu
    )
    assert doctor.engine_line({}, gloo) is None
    torch_at("2.14.1")
    assert "legacy ProcessGroupNCCL" in doctor.engine_line({}, gpu)
