"""Site ids: structural tags of DDP bucket groups, per-micro-batch folding of call streams."""

import pytest

from lagom_megatron.megatron.hooks.sites import GroupInfo, GroupNames, SiteRegistry, tensor_nbytes


def _registry(num_microbatches: int) -> SiteRegistry:
    return SiteRegistry(GroupNames(local_world_size=8), num_microbatches=num_microbatches)


TP = GroupInfo(name="tp", ranks=(0, 1))


def test_stream_ids_fold_per_microbatch():
    reg = _registry(num_microbatches=2)
    # iteration 0 (never timed) counts the calls: 6 calls / 2 micro-batches = period 3
    reg.start_iteration()
    first = [reg.stream_site_id(TP, "sp_all_gather")[0] for _ in range(6)]
    assert first == [f"tp.sp_all_gather[{i}]" for i in range(6)]
    reg.finish_iteration()
    for _ in range(2):  # the same ids on every later iteration
        reg.start_iteration()
        got = [reg.stream_site_id(TP, "sp_all_gather") for _ in range(6)]
        assert [g[0] for g in got] == [f"tp.sp_all_gather[{i % 3}]" for i in range(6)]
        assert all(calls == 2 for _, calls in got)
        reg.finish_iteration()


def test_stream_not_per_microbatch_and_uneven_counts():
    reg = _registry(num_microbatches=4)
    reg.start_iteration()
    for _ in range(3):
        reg.stream_site_id(TP, "finalize_all_reduce", per_microbatch=False)
    for _ in range(6):  # 6 calls do not divide into 4 micro-batches: no folding
        reg.stream_site_id(TP, "dgrad_all_reduce")
    reg.finish_iteration()
    reg.start_iteration()
    assert [reg.stream_site_id(TP, "finalize_all_reduce", per_microbatch=False)[0] for _ in range(3)] == [
        "tp.finalize_all_reduce[0]",
        "tp.finalize_all_reduce[1]",
        "tp.finalize_all_reduce[2]",
    ]
    assert [reg.stream_site_id(TP, "dgrad_all_reduce")[0] for _ in range(6)] == [
        f"tp.dgrad_all_reduce[{i}]" for i in range(6)
    ]


class _Chunk:
    def __init__(self, n, n_expert=0):
        self.bucket_groups = [object() for _ in range(n)]
        self.expert_parallel_bucket_groups = [object() for _ in range(n_expert)]


def test_bucket_tags_are_structural():
    reg = _registry(1)
    chunks = [_Chunk(3), _Chunk(2, n_expert=1)]
    assert reg.bind_model(chunks) == 6
    assert reg.bucket_tag(chunks[0].bucket_groups[2]) == "chunk0.bucket2"
    assert reg.bucket_tag(chunks[1].bucket_groups[1]) == "chunk1.bucket1"
    assert reg.bucket_tag(chunks[1].expert_parallel_bucket_groups[0]) == "chunk1.expert_bucket0"
    assert reg.bucket_tag(object()) is None


def test_records_and_sites():
    reg = _registry(2)
    reg.start_iteration()
    for nbytes in (100, 400, 200):
        reg.record("tp.sp_all_gather[0]", op="all_gather", nbytes=nbytes, dtype="float32", group=TP)
    (site,) = reg.sites()
    assert (site.site_id, site.op, site.nbytes, site.group, site.group_size, site.calls_per_iter) == (
        "tp.sp_all_gather[0]",
        "all_gather",
        400,
        "tp",
        2,
        3,
    )
    reg.start_iteration()
    assert reg.sites() == []


def test_tensor_nbytes_and_bad_microbatches():
    torch = pytest.importorskip("torch")
    assert tensor_nbytes(torch.zeros(3, 5, dtype=torch.float16)) == 30
    assert tensor_nbytes([torch.zeros(4), torch.zeros(2, dtype=torch.float64)]) == 32
    with pytest.raises(ValueError, match="num_microbatches must be >= 1; got 0"):
        _registry(0)


def test_stage_local_ids_under_pipeline_parallelism():
    reg = SiteRegistry(GroupNames(local_world_size=8), num_microbatches=1, pp_stage=1)
    chunk = _Chunk(1)
    reg.bind_model([chunk])
    assert reg.bucket_tag(chunk.bucket_groups[0]) == "stage1.chunk0.bucket0"
    reg.start_iteration()
    assert reg.stream_site_id(TP, "sp_all_gather")[0] == "tp.sp_all_gather[stage1.0]"
    embd = GroupInfo(name="embd", ranks=(0, 3))  # spans stages: both ends must agree on the id
    assert reg.stream_site_id(embd, "finalize_all_reduce", per_microbatch=False)[0] == "embd.finalize_all_reduce[0]"


def test_iteration_without_records_keeps_the_stream_ids():
    reg = _registry(num_microbatches=2)
    reg.start_iteration()
    for _ in range(4):
        reg.stream_site_id(TP, "sp_all_gather")
    reg.record("tp.sp_all_gather[0]", op="all_gather", nbytes=8, dtype="float32", group=TP)
    reg.finish_iteration()
    reg.start_iteration(record=False)  # an applied plan: ids still advance, nothing is recorded
    assert not reg.recording and reg.records == {}
    assert [reg.stream_site_id(TP, "sp_all_gather")[0] for _ in range(4)] == [
        f"tp.sp_all_gather[{i % 2}]" for i in range(4)
    ]
    reg.start_iteration()
    assert reg.recording


class _ParamGroup:
    """The two attributes ``fsdp_bucket_tags`` reads of a Megatron-FSDP ``ParameterGroup``."""

    def __init__(self, unit, expert=False):
        self.fsdp_unit_id, self.is_expert_param = unit, expert


@pytest.mark.parametrize("preset", ["gpt3-2.7b-a40x8-fsdp", "llama2-7b-a40x16-fsdp"])
def test_megatron_fsdp_site_ids_are_the_simulators(preset):
    """The shipped A40 FSDP presets run Megatron-FSDP: every FSDP site the simulator names is the
    id the router gives that unit's bucket group, so a simulated plan names real sites."""
    import types

    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.sim.backend import SimulatedCluster

    sim = SimulatedCluster(load_preset(preset), seed=0)
    layers = sim.workload.layers_per_chunk
    # as _get_parameter_groups builds them: the embedding's bucket, two per layer (dtype split), the rest
    groups = [_ParamGroup(None)] + [_ParamGroup(u) for u in range(layers) for _ in range(2)] + [_ParamGroup(None)]
    buffer = types.SimpleNamespace(parameter_groups=groups)
    reg = _registry(1)
    assert reg.fsdp_bucket_tags(buffer) is None  # not bound: not a site
    reg.bind_model([types.SimpleNamespace(param_and_grad_buffer=buffer)])
    tags = reg.fsdp_bucket_tags(buffer)
    assert tags[0] == "chunk0.root_bucket0" and tags[-1] == "chunk0.root_bucket1"
    assert tags[1] == tags[2] == f"chunk0.bucket{layers - 1}" and tags[-2] == "chunk0.bucket0"
    real = {f"dp.{op}[{t}]" for t in tags for op in ("param_all_gather", "grad_reduce_scatter")}
    simulated = {s.site_id for s in sim.sites if s.site_id.startswith("dp.")}
    assert len(simulated) == 2 * layers and simulated <= real
    assert sorted(real - simulated) == [
        "dp.grad_reduce_scatter[chunk0.root_bucket0]",
        "dp.grad_reduce_scatter[chunk0.root_bucket1]",
        "dp.param_all_gather[chunk0.root_bucket0]",
        "dp.param_all_gather[chunk0.root_bucket1]",
    ]


def test_grad_all_to_all_follows_megatrons_module_function(monkeypatch):
    """Any bucket group's ``__init__`` with fp32 accumulation rebinds the module global every group then calls
    (core_v0.16.1 ``param_and_grad_buffer.py:163-165``, ``:443``), so the module's value decides, not one config."""
    pytest.importorskip("megatron.core")
    import types

    from megatron.core.distributed import param_and_grad_buffer as pgb

    from lagom_megatron.megatron.hooks.sites import FP32_ALL_TO_ALL, grad_all_to_all

    bg = object.__new__(pgb._ParamAndGradBucketGroup)
    assert callable(getattr(pgb, FP32_ALL_TO_ALL))  # the name megatron-core imports it by
    assert not grad_all_to_all(bg)
    monkeypatch.setattr(pgb, "dist_reduce_scatter_func", pgb.reduce_scatter_with_fp32_accumulation)
    assert grad_all_to_all(bg)
    assert not grad_all_to_all(types.SimpleNamespace(ddp_config=None))  # not a megatron-core bucket group
