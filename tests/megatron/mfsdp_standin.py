"""Stand-in of Megatron-FSDP's HSDP pipelines as megatron-core 0.17.1 / 0.18.2 lay them out.

``megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py`` of 0.17.1 (line
numbers; 0.18.2 and the ``megatron-fsdp`` 0.6.1 package have the same code): with hybrid FSDP and
a sharded outer level (``outer_dp_sharding_strategy != "no_shard"``) every ``ParameterGroup`` has
its model buffers on the whole data-parallel group (DP-Outer x DP-Shard) and *helper* buffers on
the inner DP-Shard group, ``hfsdp_helper_wbuf`` / ``hfsdp_helper_wtbuf`` / ``hfsdp_helper_gbuf``
(``:1335-1345,2322-2348``; 0.16.1 called them ``hsdp_wbuf`` / ``hsdp_gbuf`` and had no transposed
one). The pipelines read the group of each collective from ``get_fsdp_buffer``, which returns the
helpers (``AllGatherPipeline.get_fsdp_buffer`` ``:4190-4204``, ``GradReducePipeline.get_fsdp_buffer``
``:3559-3564``). The methods lagom hooks keep the real signatures and their collective calls:

* ``all_gather_params`` (``:3921-4107``): the manager on ``get_fsdp_buffer(buckets[0])`` (no
  ``bwd``, ``:4085``), ``async_bucket_gather(bucket_id, bwd)`` per bucket inside (``:4093``), the
  manager kept as each bucket's event (``:4097-4103``); no prefetch, no outer gather.
* ``async_bucket_gather`` (``:4206-4250``): ``all_gather_into_tensor(output_tensor=, input_tensor=,
  group=wbuf.data_parallel_group, async_op=True)`` with ``wbuf = get_fsdp_buffer(bucket_id, bwd)``.
* ``_bucket_group_gradient_reduce`` (``:3566-3815``): ``_coalescing_manager(dp_group)`` with the
  first bucket's helper group, one ``reduce_scatter_tensor(output=, input=, op=, group=)`` per
  bucket on its helper's group, then, for ``outer_fsdp_group_grad_reduce``, a second manager on the
  outer group with one reduce-scatter of the helper's shard per bucket (``:3693-3760``).

Buffers hold plain CPU tensors; CUDA streams and events are left out (gloo orders on the host).
"""

from types import SimpleNamespace

import torch
from torch.distributed import _coalescing_manager  # as param_and_grad_buffer.py:32


class DataParallelBuffer:
    """A bucket's buffer on ``data_parallel_group``: this rank's shard and the unsharded bucket."""

    def __init__(self, group, shard):
        self.data_parallel_group = group
        self.data = shard
        self.bucket = SimpleNamespace(data=torch.zeros(shard.numel() * group.size()))

    def fetch_bucket(self, **_):
        return self.bucket

    def get_shard_from_local_buffer(self):
        return self.data

    def get_shard_from_bucket(self, bucket):
        n = self.data.numel()
        return bucket.data[self.data_parallel_group.rank() * n :][:n]


class ParameterGroup:
    """The attributes of ``ParameterGroup`` (``:1330-1346``) that the pipelines and lagom read."""

    def __init__(self, unit, *, full, inner, seed, transpose=False):
        shard = torch.arange(4, dtype=torch.float32) + 10 * seed + 100 * torch.distributed.get_rank()
        self.fsdp_unit_id, self.is_expert_param, self.params = unit, False, [torch.nn.Parameter(shard.clone())]
        self.model_weight_buffer = DataParallelBuffer(full, shard.clone())
        self.main_grad_buffer = DataParallelBuffer(full, shard.clone())
        self.hfsdp_helper_wbuf = DataParallelBuffer(inner, shard.clone())
        self.hfsdp_helper_gbuf = DataParallelBuffer(inner, shard.clone())
        self.transpose_weight_buffer = DataParallelBuffer(full, -shard) if transpose else None
        self.hfsdp_helper_wtbuf = DataParallelBuffer(inner, -shard) if transpose else None


class ParamAndGradBuffer:
    """``parameter_groups`` (one bucket per group), ``param_to_param_group``, the HSDP config."""

    def __init__(self, groups, outer):
        self.parameter_groups = groups
        self.param_to_param_group = {g.params[0]: i for i, g in enumerate(groups)}
        self.bucket_to_bucket_group = {i: [i] for i in range(len(groups))}
        self.ddp_config = SimpleNamespace(
            data_parallel_sharding_strategy="optim_grads_params", outer_dp_sharding_strategy="optim"
        )
        self.dist_index = SimpleNamespace(get_outer_fsdp_group=lambda **_: outer)


class AllGatherPipeline:
    def __init__(self, buffer):
        self.buffer = buffer
        self.param_gather_event_map = {}

    def get_fsdp_buffer(self, bucket_id, bwd=False):
        param_group = self.buffer.parameter_groups[bucket_id]
        if self.buffer.ddp_config.outer_dp_sharding_strategy != "no_shard":
            if bwd and param_group.transpose_weight_buffer is not None:
                return param_group.hfsdp_helper_wtbuf
            return param_group.hfsdp_helper_wbuf
        if bwd and param_group.transpose_weight_buffer is not None:
            return param_group.transpose_weight_buffer
        return param_group.model_weight_buffer

    def all_gather_params(
        self,
        params,
        prefetch=False,
        prefetch_order=None,
        suggested_AG_prefetch_size=None,
        async_param_gather=True,
        outer_fsdp_group_param_gather=False,
        bwd=False,
    ):
        ag_buckets = sorted({self.buffer.param_to_param_group[p] for p in params})
        for buckets in (
            [b for b in ag_buckets if self.buffer.bucket_to_bucket_group[b][0] == g]
            for g in sorted({self.buffer.bucket_to_bucket_group[b][0] for b in ag_buckets})
        ):
            dp_group = self.get_fsdp_buffer(buckets[0]).data_parallel_group
            with _coalescing_manager(dp_group, async_ops=async_param_gather) as coalescing_event:
                for bucket_id in buckets:
                    self.async_bucket_gather(bucket_id, bwd)
            for bucket_id in buckets:
                self.param_gather_event_map[(bucket_id, bwd)] = coalescing_event

    def async_bucket_gather(self, bucket_id, bwd):
        wbuf = self.get_fsdp_buffer(bucket_id, bwd)
        bucket = wbuf.fetch_bucket(set_param_data=True)
        self.param_gather_event_map[(bucket_id, bwd)] = torch.distributed.all_gather_into_tensor(
            output_tensor=bucket.data,
            input_tensor=wbuf.get_shard_from_local_buffer(),
            group=wbuf.data_parallel_group,
            async_op=True,
        )

    def wait_bucket_ready(self, bucket_id, bwd):
        self.param_gather_event_map.pop((bucket_id, bwd)).wait()
        return self.get_fsdp_buffer(bucket_id, bwd).bucket.data.clone()


class GradReducePipeline:
    def __init__(self, buffer):
        self.buffer = buffer

    def get_fsdp_buffer(self, bucket_id):
        param_group = self.buffer.parameter_groups[bucket_id]
        if self.buffer.ddp_config.outer_dp_sharding_strategy != "no_shard":
            return param_group.hfsdp_helper_gbuf
        return param_group.main_grad_buffer

    def _bucket_group_gradient_reduce(self, bucket_group, async_op=False, outer_fsdp_group_grad_reduce=False):
        dp_group = self.get_fsdp_buffer(bucket_group[0]).data_parallel_group
        with _coalescing_manager(dp_group):
            reduced = []
            for bucket_id in bucket_group:
                gbuf = self.get_fsdp_buffer(bucket_id)
                unreduced = gbuf.fetch_bucket().data
                unreduced.copy_(
                    torch.arange(unreduced.numel(), dtype=torch.float32) * (bucket_id + 1)
                    + torch.distributed.get_rank()
                )
                grad_shard = torch.empty_like(gbuf.get_shard_from_bucket(gbuf.bucket))
                torch.distributed.reduce_scatter_tensor(
                    output=grad_shard,
                    input=unreduced,
                    op=torch.distributed.ReduceOp.SUM,
                    group=gbuf.data_parallel_group,
                )
                reduced.append((gbuf.data, grad_shard))
        for local, grad_shard in reduced:  # after the manager: its reduce-scatters have run
            local.copy_(grad_shard)
        if outer_fsdp_group_grad_reduce:
            outer = self.buffer.dist_index.get_outer_fsdp_group()
            with _coalescing_manager(outer):
                for bucket_id in bucket_group:
                    shard = self.get_fsdp_buffer(bucket_id).data
                    out = torch.empty(shard.numel() // outer.size())
                    torch.distributed.reduce_scatter_tensor(
                        output=out, input=shard.clone(), op=torch.distributed.ReduceOp.SUM, group=outer
                    )
                    reduced.append((self.buffer.parameter_groups[bucket_id].main_grad_buffer.data[: out.numel()], out))
            for local, grad_shard in reduced[len(bucket_group) :]:
                local.copy_(grad_shard)
        return True
