"""NCCL's kernel time per site (``megatron.hooks.profiler.KernelTimes``): events on for an untimed iteration
only, a site timed when the records tell it apart (its calls are all the calls of that shape on its
communicator), none otherwise; one all-gather whatever the rank holds (a world of one here)."""

import ctypes
import functools
import shutil

import pytest

from lagom_megatron.engine.knobs import CommConfig
from lagom_megatron.engine.steps import Step
from lagom_megatron.megatron.hooks.profiler import KernelTimes, Profiler
from lagom_megatron.megatron.hooks.sites import GroupInfo, SiteRecord
from lagom_megatron.nccl.plugin import build_tuner
from lagom_megatron.nccl.plugin_status import parse_snapshot

DP = GroupInfo(name="dp", ranks=tuple(range(8)))
SNAPSHOT = """\
comm 0 hash=1 rank=0 nranks=8 nnodes=1 abi=6 tag=dp/e name=dp/e dropped=0 overflow=0
coll 0 func=ReduceScatter count=131072 dtype=ncclFloat32 algo=RING proto=SIMPLE channels=8 warps=16 calls=2 chunk=0 kernel_ns=5000 kernel_calls=2
coll 0 func=AllGather count=65536 dtype=ncclBfloat16 algo=RING proto=SIMPLE channels=8 warps=16 calls=4 chunk=0 kernel_ns=8000 kernel_calls=4
comm 1 hash=2 rank=0 nranks=8 nnodes=1 abi=6 tag=- name=MEGATRON_DP dropped=0 overflow=0
coll 1 func=AllReduce count=1024 dtype=ncclFloat32 algo=RING proto=LL channels=2 warps=8 calls=1 chunk=0 kernel_ns=700 kernel_calls=1
"""


class _Pool:
    entry, own = object(), type("G", (), {"group_desc": "MEGATRON_DP"})()

    def group_for(self, info, config):
        return self.entry

    def comm_key(self, group):
        return "dp/e" if group is self.entry else None

    def own_group(self, name):
        return self.own


def test_sites_told_apart_get_nccls_time_and_events_go_off():
    switches = []
    kt = KernelTimes(
        reader=lambda: parse_snapshot(SNAPSHOT),
        recorder=lambda on, reset=False, kernel_times=False: switches.append((on, reset, kernel_times)) or True,
    )
    kt.start()
    records = {
        "dp.rs[0]": SiteRecord(
            site_id="dp.rs[0]", op="reduce_scatter", nbytes=4 << 20, dtype="float32", group=DP, calls=2
        ),
        "dp.ag[0]": SiteRecord(
            site_id="dp.ag[0]", op="all_gather", nbytes=1 << 20, dtype="bfloat16", group=DP, calls=2
        ),
        "dp.ar[0]": SiteRecord(site_id="dp.ar[0]", op="all_reduce", nbytes=4096, dtype="float32", group=DP, calls=1),
    }
    cfg = CommConfig(n_channels=8)
    got = kt.finish(records, {"dp.rs[0]": cfg, "dp.ag[0]": cfg}, _Pool())
    # dp.ag[0] has 2 of the 4 all-gathers of its shape on the entry: another site shares it, no time
    assert got == {"dp.rs[0]": 5.0, "dp.ar[0]": 0.7}, got
    assert switches == [(True, True, True), (False, False, False)] and not kt.on


def test_without_the_profiler_half_no_site_gets_nccls_time():
    kt = KernelTimes(reader=lambda: None, recorder=lambda on, reset=False, kernel_times=False: False)
    kt.start()
    rec = SiteRecord(site_id="s", op="all_reduce", nbytes=4096, dtype="float32", group=DP, calls=1)
    assert kt.finish({"s": rec}, {}, _Pool()) == {}


class _TorchGroup:
    """Stand-in for torch's ``ProcessGroup``: ``group_name`` (the name c10d registers, ``"7"`` for the eighth group)
    and ``group_desc`` (Megatron passes one per group) are read-only properties there too."""

    group_name = property(lambda self: "7")
    group_desc = property(lambda self: "DATA_PARALLEL_GROUP")


def _own_group_record(name: str) -> str:
    return (
        f"comm 0 hash=9 rank=0 nranks=8 nnodes=1 abi=6 tag=- name={name} dropped=0 overflow=0\n"
        "coll 0 func=AllReduce count=1024 dtype=ncclFloat32 algo=RING proto=LL channels=2 warps=8 calls=1 "
        "chunk=0 kernel_ns=900 kernel_calls=1\n"
    )


class _OwnPool:
    def own_group(self, name):
        return _TorchGroup()


def test_megatrons_own_group_is_found_by_the_name_each_engine_gives_nccl():
    """nccl2 names every communicator after the process group's ``group_name``; the legacy class writes
    ``"<group_desc>:<group_name>"`` where it sets a name; a record under any other name is not this group's."""
    rec = SiteRecord(site_id="dp.ar[0]", op="all_reduce", nbytes=4096, dtype="float32", group=DP, calls=1)
    for name, want in (("7", {"dp.ar[0]": 0.9}), ("DATA_PARALLEL_GROUP:7", {"dp.ar[0]": 0.9}), ("8", {})):
        kt = KernelTimes(
            reader=lambda name=name: parse_snapshot(_own_group_record(name)),
            recorder=lambda on, reset=False, kernel_times=False: True,
        )
        kt.start()
        assert kt.finish({"dp.ar[0]": rec}, {}, _OwnPool()) == want, name


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
    a mask without KernelCh; only ``KernelTimes`` (for an untimed iteration) asks for it."""
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
    kt = KernelTimes()
    kt.start()
    assert kt.on and mask() & KERNEL_CH, "KernelTimes asks for the GPU timers"
    record(False)
    assert mask() == 0


TIMED = ("default", "serialized", "probe")
