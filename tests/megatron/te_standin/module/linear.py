"""Stand-in of TE v2.18 ``module/linear.py``: ``Linear`` and its autograd function ``_Linear``."""

import torch

from ..distributed import allreduce, gather_along_first_dim, reduce_scatter_along_first_dim


def linear_backward(ctx, grad_output, inputmat, weight):
    """The communication pattern of TE's ``_linear_backward`` (``linear.py:935-1070``)."""
    inputmat_total_work = dgrad_work = None
    quantizer = getattr(ctx, "input_quantizer", None)
    if ctx.parallel_mode == "column" and ctx.sequence_parallel:
        if quantizer is not None:  # the wgrad GEMM reads the column-wise data (linear.py:930-937)
            if quantizer.supports_only_rowwise_all_gather():
                quantizer.set_usage(rowwise=True, columnwise=False)
            else:
                quantizer.set_usage(rowwise=False, columnwise=True)
        inputmat_total, inputmat_total_work = gather_along_first_dim(
            inputmat, ctx.tp_group, async_op=True, quantizer=quantizer
        )
    else:
        inputmat_total = inputmat
    if ctx.parallel_mode == "row" and ctx.sequence_parallel:
        grad_output, _ = gather_along_first_dim(grad_output, ctx.tp_group)
    dgrad = grad_output @ weight
    if ctx.parallel_mode == "column" and ctx.tp_size > 1:
        if ctx.sequence_parallel:
            dgrad, dgrad_work = reduce_scatter_along_first_dim(dgrad, ctx.tp_group, async_op=True)
        else:
            dgrad, dgrad_work = allreduce(dgrad, ctx.tp_group, async_op=True)
    if inputmat_total_work is not None:
        inputmat_total_work.wait()
    if quantizer is not None and ctx.parallel_mode == "column" and ctx.sequence_parallel:
        inputmat_total = inputmat_total.dequantize()
    wgrad = grad_output.t() @ inputmat_total
    if dgrad_work is not None:
        dgrad_work.wait()
    return dgrad, wgrad


class _Linear(torch.autograd.Function):
    """``y = x W^T`` with TE's tensor/sequence-parallel communication (``linear.py:1316-1400``)."""

    @staticmethod
    def forward(ctx, weight, inp, args):
        quantizer = args.get("input_quantizer")
        if args["parallel_mode"] == "column" and args["sequence_parallel"]:
            if quantizer is not None:  # the forward GEMM reads the row-wise data, gathered synchronously
                quantizer.set_usage(rowwise=True, columnwise=False)
            inputmat_total, _ = gather_along_first_dim(inp, args["tp_group"], quantizer=quantizer)
            if quantizer is not None:
                inputmat_total = inputmat_total.dequantize()
        else:
            inputmat_total = inp
        out = inputmat_total @ weight.t()
        if args["parallel_mode"] == "row" and args["sequence_parallel"]:
            out, _ = reduce_scatter_along_first_dim(out, args["tp_group"])
        elif args["parallel_mode"] == "row" and args["tp_size"] > 1:
            out, _ = allreduce(out, args["tp_group"])
        if ctx is not None:
            ctx.save_for_backward(inp, weight)
            ctx.tp_group, ctx.tp_size = args["tp_group"], args["tp_size"]
            ctx.parallel_mode, ctx.sequence_parallel = args["parallel_mode"], args["sequence_parallel"]
            ctx.input_quantizer = quantizer
        return out

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        dgrad, wgrad = linear_backward(ctx, grad_output, inp, weight)
        return wgrad, dgrad, None


class Linear(torch.nn.Module):
    """``transformer_engine.pytorch.Linear``: ``tp_group`` set at construction, read at forward."""

    def __init__(
        self,
        in_features,
        out_features,
        *,
        tp_group=None,
        parallel_mode=None,
        sequence_parallel=False,
        input_quantizer=None,
    ):
        super().__init__()
        self.input_quantizer = input_quantizer  # an FP8 / FP4 recipe's quantizer of the input (TE ``quantizers``)
        self.tp_group = tp_group
        self.tp_size = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        self.parallel_mode, self.sequence_parallel = parallel_mode, sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))

    def _args(self):
        return {
            "tp_group": self.tp_group,
            "tp_size": self.tp_size,
            "parallel_mode": self.parallel_mode,
            "sequence_parallel": self.sequence_parallel,
            "input_quantizer": self.input_quantizer,
        }

    def forward(self, inp):
        if torch.is_grad_enabled():
            return _Linear.apply(self.weight, inp, self._args())
        return _Linear.forward(None, self.weight, inp, self._args())
