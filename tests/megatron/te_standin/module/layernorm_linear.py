"""Stand-in of TE v2.18 ``module/layernorm_linear.py``: ``LayerNormLinear`` / ``_LayerNormLinear``."""

import torch

from ..distributed import gather_along_first_dim
from .linear import Linear, linear_backward


class _LayerNormLinear(torch.autograd.Function):
    """LayerNorm then ``x W^T``; backward communicates as ``layernorm_linear.py:764-768,881-885``."""

    @staticmethod
    def forward(ctx, weight, inp, args):
        ln_out = torch.nn.functional.layer_norm(inp.detach(), inp.shape[-1:])
        if args["parallel_mode"] == "column" and args["sequence_parallel"]:
            total, _ = gather_along_first_dim(ln_out, args["tp_group"])
        else:
            total = ln_out
        if ctx is not None:
            ctx.save_for_backward(ln_out, weight)
            ctx.tp_group, ctx.tp_size = args["tp_group"], args["tp_size"]
            ctx.parallel_mode, ctx.sequence_parallel = args["parallel_mode"], args["sequence_parallel"]
        return total @ weight.t()

    @staticmethod
    def backward(ctx, grad_output):
        ln_out, weight = ctx.saved_tensors
        dgrad, wgrad = linear_backward(ctx, grad_output, ln_out, weight)
        return wgrad, dgrad, None  # (the layer norm's own gradient is left out of the stand-in)


class LayerNormLinear(Linear):
    """``transformer_engine.pytorch.LayerNormLinear``."""

    def forward(self, inp):
        return _LayerNormLinear.apply(self.weight, inp, self._args())
