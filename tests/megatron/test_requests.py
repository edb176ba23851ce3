"""Posted requests timed as one overlapped call, the PP=2 WORLD half, and the router's P2P paths (no processes)."""

import math

import pytest

torch = pytest.importorskip("torch")

from lagom_megatron.engine.knobs import CommConfig  # noqa: E402
from lagom_megatron.megatron.hooks import router_p2p as requests  # noqa: E402
from lagom_megatron.megatron.hooks.profiler import Profiler  # noqa: E402
from lagom_megatron.megatron.hooks.router import SiteRouter  # noqa: E402
from lagom_megatron.megatron.hooks.sites import GroupInfo, GroupNames, SiteRegistry  # noqa: E402
from tests.megatron.fakes import Clock  # noqa: E402
from tests.megatron.fakes import FakeWork as Req  # noqa: E402


def test_serialized_posted_requests_give_compute_time_and_each_proxy_waits_only_its_own():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True, serialize=True)
    reqs = {"send_next": Req(clock, 0.002), "recv_prev": Req(clock, 0.003)}
    out = requests.time_requests(prof, "pp.send_recv", reqs, 0.0)
    assert set(out) == {"send_next", "recv_prev"}  # keys kept for the schedule's pops
    assert clock.t == 0.003  # serialized: both waited at posting (communication alone: 3 ms)
    clock.t = 0.010  # 7 ms of compute, then the schedule waits one request
    out["recv_prev"].wait()
    assert (
        reqs["recv_prev"].waits == 1 and reqs["send_next"].waits == 1
    )  # each request waited once (gloo P2P blocks on a second wait)
    t_comm, t_comp, t_region = prof.finish_iteration()["pp.send_recv"]
    assert t_comm == pytest.approx(3000) and t_comp == pytest.approx(7000) and t_region == pytest.approx(10000)


def test_overlapped_posted_requests_end_when_all_complete_and_region_spans_the_first_wait():
    clock = Clock()
    prof = Profiler(clock=clock)
    prof.start_iteration(timed=True)
    reqs = [Req(clock, 0.004), Req(clock, 0.006)]
    out = requests.time_requests(prof, "cp.ring_send_recv[chunk0.attn]", reqs, 0.001)
    clock.t = 0.005
    out[0].wait()  # first wait at 5 ms: the compute ran 4 ms; request 1 is still in flight
    assert reqs[1].waits == 0
    out[1].wait()  # completes at 6 ms
    t_comm, t_comp, t_region = prof.finish_iteration()["cp.ring_send_recv[chunk0.attn]"]
    assert t_comm == pytest.approx(5000) and math.isnan(t_comp) and t_region == pytest.approx(5000)


def test_untimed_or_empty_requests_are_returned_unchanged():
    prof = Profiler(clock=Clock())
    prof.start_iteration(timed=False)
    reqs = {"a": object()}
    assert requests.time_requests(prof, "s", reqs, 0.0) is reqs
    prof.start_iteration(timed=True)
    assert requests.time_requests(prof, "s", None, 0.0) is None
    assert requests.time_requests(prof, "s", {}, 0.0) == {}


class Group:
    def __init__(self, rank, size=2):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


@pytest.mark.parametrize("rank", [0, 1])
def test_split_world_direction_posts_megatrons_world_half_on_the_partner_entry(monkeypatch, rank):
    posted = []
    monkeypatch.setattr(
        requests.dist, "isend", lambda tensor, dst, group, tag: posted.append(("isend", dst, group, tag)) or "s"
    )
    monkeypatch.setattr(
        requests.dist, "irecv", lambda tensor, src, group, tag: posted.append(("irecv", src, group, tag)) or "r"
    )

    def orig(**kw):  # megatron's _p2p_ops: gets only the half that stays on the pipeline group
        posted.append(
            (
                "orig",
                tuple(
                    k
                    for k in ("tensor_send_next", "tensor_recv_prev", "tensor_send_prev", "tensor_recv_next")
                    if kw[k] is not None
                ),
            )
        )
        return {"own": "o"}

    t = torch.zeros(2)
    kwargs = dict(
        tensor_send_prev=t,
        tensor_recv_prev=t,
        tensor_send_next=t,
        tensor_recv_next=t,
        group=Group(rank),
        prev_pipeline_rank=1 - rank,
        next_pipeline_rank=1 - rank,
    )
    reqs = requests.split_world_direction(orig, kwargs, "WORLD_ENTRY")
    if rank == 0:  # even: sends stay on the pipeline group, receives go where Megatron uses WORLD
        assert posted == [
            ("orig", ("tensor_send_next", "tensor_send_prev")),
            ("irecv", 1, "WORLD_ENTRY", 1),
            ("irecv", 1, "WORLD_ENTRY", 2),
        ]
        assert reqs == {"own": "o", "recv_prev": "r", "recv_next": "r"}
    else:
        assert posted == [
            ("orig", ("tensor_recv_prev", "tensor_recv_next")),
            ("isend", 0, "WORLD_ENTRY", 1),
            ("isend", 0, "WORLD_ENTRY", 2),
        ]
        assert reqs == {"own": "o", "send_next": "s", "send_prev": "s"}


class Pool:
    def group_for(self, info, cfg):
        return ("entry", info.name) if cfg.n_channels else None


class Communicator:
    """Megatron's P2PCommunicator as the router sees it: ``pp_group``, ``config``."""

    def __init__(self, group):
        self.pp_group = group

        class Config:
            pipeline_dtype = torch.float32

        self.config = Config()


def test_router_p2p_times_unwaited_requests_as_overlapped_and_routes_the_world_half(monkeypatch):
    pp = object()
    names = GroupNames(local_world_size=2)
    names.alias(pp, GroupInfo(name="pp", ranks=(0, 1)))
    names.add_partner("pp", "pp_world", (0, 1))
    clock = Clock()
    registry = SiteRegistry(names, num_microbatches=1)
    router = SiteRouter(registry, Profiler(clock=clock), Pool(), clock=clock)
    monkeypatch.setattr("lagom_megatron.megatron.hooks.router_p2p.uses_world_half", lambda g: True)
    seen = {}

    def communicate(comm, **kwargs):
        seen["group"] = comm.pp_group
        seen["world"] = router._p2p_world
        return None, kwargs["tensor_send_next"], {"send_next": Req(clock, 0.002)}

    registry.start_iteration()
    router.profiler.start_iteration(timed=True, serialize=True)
    comm = Communicator(pp)
    router.set_assignment({"pp.send_recv": CommConfig(n_channels=3)})
    _, _, reqs = router.p2p(comm, communicate, {"tensor_send_next": torch.zeros(4), "wait_on_reqs": False})
    assert seen == {"group": ("entry", "pp"), "world": ("entry", "pp_world")}
    assert comm.pp_group is pp and router._p2p_world is None  # both restored after the call
    clock.t = 0.005
    reqs["send_next"].wait()
    t_comm, t_comp, _ = router.profiler.finish_iteration()["pp.send_recv"]
    assert t_comm == pytest.approx(2000) and t_comp == pytest.approx(3000)
    assert registry.records["pp.send_recv"].nbytes == 16
