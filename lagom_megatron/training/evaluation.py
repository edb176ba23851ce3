"""Validation-split evaluation as Megatron-LM core_v0.16.1 ``megatron/training/training.py`` ``evaluate``
(lines 3035-3190) and ``evaluate_and_print_results`` (3253-3284); the loss is the mean of micro-batch mean token
losses (Megatron-LM weights by token count: equal when no token is masked)."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch


def validation_samples(args: Any) -> int:
    """Samples the validation split needs (Megatron-LM's ``get_train_valid_test_num_samples``)."""
    if not args.eval_interval or not args.eval_iters:
        return 0
    return (args.train_iters // args.eval_interval + 1) * args.eval_iters * args.global_batch_size


def format_validation_lines(prefix: str, loss: float) -> list[str]:
    """Megatron-LM's three lines for one evaluation: dashes, loss and perplexity, dashes."""
    line = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20.0, loss)):.6E} | "
    dashes = "-" * (len(line) + 1)
    return [dashes, line, dashes]


class Evaluator:
    """Runs one evaluation of ``--eval-iters`` iterations per call; ``batches``: this rank's validation micro-batches
    (one iterator, or one per model chunk)."""

    def __init__(self, args: Any, ctx: Any, batches: Iterator | list[Iterator], forward_step: Callable,
                 log: Callable[[str], None]) -> None:
        self.args, self.ctx, self.batches, self.forward_step, self.log = args, ctx, batches, forward_step, log

    def __call__(self, prefix: str) -> float:
        """Evaluates and logs Megatron-LM's validation line; returns the loss, broadcast from the last stage."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        for chunk in self.ctx.model:
            chunk.eval()
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for _ in range(self.args.eval_iters):
                    losses = self.ctx.forward_backward_func(
                        forward_step_func=self.forward_step, data_iterator=self.batches, model=self.ctx.model,
                        num_microbatches=self.args.num_microbatches, seq_length=self.args.seq_length,
                        micro_batch_size=self.args.micro_batch_size, forward_only=True)
                    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                        total += sum(float(x["lm loss"]) for x in losses)
                        count += len(losses)
        finally:
            for chunk in self.ctx.model:
                chunk.train()
        loss = torch.tensor([total / max(count, 1)], dtype=torch.float64)
        on_gpu = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        loss = loss.to(device)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            dist.all_reduce(loss, group=dp_group)
            loss /= dist.get_world_size(group=dp_group)
        dist.broadcast(loss, src=dist.get_world_size() - 1)
        value = float(loss.cpu()[0])
        for line in format_validation_lines(prefix, value):
            self.log(line)
        return value
