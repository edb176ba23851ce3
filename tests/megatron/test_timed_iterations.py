"""The activation mask lagom's profiler half hands NCCL during timed iterations: never KernelCh.

NCCL's KernelCh events add a profiler proxy op per channel of every task and, at a communicator's first such task,
2 x MAXCHANNELS blocking proxy connections in the enqueue (v2.30.7 ``src/enqueue.cc:567-573``,
``src/plugin/profiler.cc:753-776``); production (mask 0) never runs them, so no timed iteration may."""

import ctypes
import functools
import shutil

import pytest

from lagom_megatron.engine.steps import Step
from lagom_megatron.megatron.hooks.profiler import Profiler
from lagom_megatron.nccl.plugin import build_tuner

KERNEL_CH, COLL = 1 << 6, 1 << 1
"""``ncclProfileKernelCh``, ``ncclProfileColl`` (NVIDIA/nccl v2.30.7 ``src/include/plugin/nccl_profiler.h:13-18``)."""


class _ProfilerV6(ctypes.Structure):
    """``ncclProfiler_v6_t``'s name and init, as NCCL reads them (``src/plugin/profiler.cc:73-88``)."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        (
            "init",
            ctypes.CFUNCTYPE(
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_int),
                ctypes.c_char_p,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_void_p,
            ),
        ),
    ]


NCCL_MASK = ctypes.c_int(-1)
"""NCCL's process-wide activation mask (a static in ``src/plugin/profiler.cc``): alive as long as the library."""


@pytest.fixture(scope="module")
def nccl_mask(tmp_path_factory):
    """lagom's library loaded here, its profiler initialised for one communicator as NCCL does (init with the
    mask's address, ``src/plugin/profiler.cc:280``); yields a reader of the mask NCCL's next task would copy."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the plugin is built with it")
    lib_path = str(build_tuner(tmp_path_factory.mktemp("mask")))
    lib = ctypes.CDLL(lib_path)
    ctx = ctypes.c_void_p()
    _ProfilerV6.in_dll(lib, "ncclProfiler_v6").init(
        ctypes.byref(ctx), 0x77, ctypes.byref(NCCL_MASK), b"ep", 1, 8, 0, None
    )
    yield lib_path, lambda: NCCL_MASK.value
    lib.lagomProfilerSetActive(0)


def test_kernel_ch_is_off_in_every_timed_iteration(nccl_mask, monkeypatch):
    """The timed steps (default, serialized, probe; verify-plan, whose plan the observed check records) hand NCCL
    a mask without KernelCh: its per-channel proxy ops and first-call proxy connections are not what production runs."""
    from lagom_megatron.megatron.control.controller import LagomController
    from lagom_megatron.megatron.control.observed import ObservedCheck
    from lagom_megatron.nccl import plugin_status

    path, mask = nccl_mask
    record = functools.partial(plugin_status.set_recording, library=path)
    monkeypatch.setattr(plugin_status, "set_recording", record)
    assert record(False) and mask() == 0

    class _Tuner:
        done = False

        def __init__(self):
            self.steps = iter([Step(iteration=i, kind=k, assignment={}) for i, k in enumerate(TIMED, 1)])

        def start_iteration(self, iteration):
            return next(self.steps)

    ctl = LagomController()
    ctl.mode, ctl.backend, ctl.tuner, ctl.profiler = "tune", "nccl", _Tuner(), Profiler()
    ctl.registry = type("R", (), {"start_iteration": lambda self, record: None})()
    ctl.router = type("Router", (), {"set_assignment": lambda self, a: None})()
    for i in range(len(TIMED)):
        ctl.on_iteration_start(i + 1)
        assert ctl.profiler.timed and not mask() & KERNEL_CH, (TIMED[i], mask())
    check = ObservedCheck("nccl", state_reader=lambda: ("lagom", ""))
    assert check.arm() is None
    assert mask() & COLL and not mask() & KERNEL_CH, mask()
    assert record(True, reset=True) and not mask() & KERNEL_CH, "recording asks for what ran, never the GPU timers"
    record(False)
    assert mask() == 0


TIMED = ("default", "serialized", "probe")
