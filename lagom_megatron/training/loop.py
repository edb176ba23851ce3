"""The training loop of ``scripts/pretrain_gpt.py``. Callbacks may define ``on_setup(ctx)``, ``on_iteration_start(i)``,
``on_iteration_end(i, elapsed_s, loss)`` (1-based, mean lm loss, same on every rank) and ``on_train_end()``."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def num_floating_point_operations(args: argparse.Namespace, batch_size: int) -> float:
    """Forward + backward FLOPs of one iteration of ``batch_size`` sequences (Megatron-LM's count)."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    heads = args.num_attention_heads
    kv = getattr(args, "kv_channels", None) or h // heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) and args.num_query_groups else heads
    fwd_bwd, fma = 3, 2
    ffn_factor = 3 if getattr(args, "swiglu", False) else 2
    num_experts = getattr(args, "num_experts", None)
    if num_experts is None:
        dense_layers, moe_layers, routed_to = layers, 0, 0
    else:  # every layer is a MoE layer (our script has no --moe-layer-freq: Megatron's default 1)
        dense_layers, moe_layers, routed_to = 0, layers, args.moe_router_topk
    ffn = args.ffn_hidden_size
    moe_ffn = getattr(args, "moe_ffn_hidden_size", None) or ffn
    q_size, kv_size = kv * heads, kv * groups
    self_attn = (
        fwd_bwd
        * fma
        * (
            h * (q_size + 2 * kv_size)  # QKV projection
            + q_size * s / 2 * 2  # QK^T and (QK^T)V, half of the causal mask
            + q_size * h  # output projection
        )
    )
    mlp = fwd_bwd * fma * h * (ffn * ffn_factor * dense_layers + moe_ffn * routed_to * ffn_factor * moe_layers)
    logits = fwd_bwd * fma * h * args.padded_vocab_size
    return float(batch_size * s * (mlp + self_attn * layers + logits))


def throughput_tflops_per_gpu(flops_per_iteration: float, seconds_per_iteration: float, world_size: int) -> float:
    """TFLOP/s per GPU (Megatron-LM's ``throughput per GPU (TFLOP/s/GPU)``); 0 for a zero time."""
    if seconds_per_iteration <= 0:
        return 0.0
    return flops_per_iteration / (seconds_per_iteration * 1e12 * world_size)


@dataclass
class TrainingContext:
    """What a callback's ``on_setup`` gets: this rank's training objects."""

    args: argparse.Namespace
    model: list
    """One DDP wrapper per virtual pipeline stage."""
    optimizer: Any
    ddp_config: Any
    pg_collection: Any
    forward_backward_func: Callable
    data_iterator: Any


@dataclass
class TrainingResult:
    """What :func:`pretrain` returns, the same on every rank."""

    losses: list[float] = field(default_factory=list)
    """Mean lm loss per iteration over micro-batches and DP ranks."""
    iteration_times_s: list[float] = field(default_factory=list)
    learning_rates: list[float] = field(default_factory=list)


def _log(message: str, *, rank: int, world_size: int) -> None:
    """Prints on the last rank (which holds the loss under pipeline parallelism)."""
    if rank == world_size - 1:
        sys.stdout.write(message + "\n")  # one write: lines from other ranks cannot split it
        sys.stdout.flush()


def format_iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    lr: float,
    global_batch_size: int,
    loss: float,
    tokens_per_s: float,
    grad_norm: float | None,
    tflops_per_gpu: float | None,
    loss_scale: float,
    skipped_iters: int,
    nan_iters: int,
) -> str:
    """Megatron-LM's ``training_log`` line (core_v0.16.1 ``training.py:2031-2085``; throughput: :2043) + tokens/s."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    line = (
        f" [{stamp}] iteration {iteration:8d}/{train_iters:8d} |"
        f" consumed samples: {consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        + (f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f} |" if tflops_per_gpu is not None else "")
        + f" learning rate: {lr:.6E} |"
        f" global batch size: {global_batch_size:5d} |"
        f" lm loss: {loss:.6E} |"
        f" loss scale: {loss_scale:.1f} |"
    )
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += (
        f" number of skipped iterations: {skipped_iters:3d} |"
        f" number of nan iterations: {nan_iters:3d} |"
        f" tokens per second: {tokens_per_s:.1f} |"
    )
    return line


def _lagom_callback(args: argparse.Namespace):
    if not args.lagom:
        return None
    from lagom_megatron.megatron.control.controller import LagomController

    return LagomController.from_args(args)


def _call(callbacks: list, name: str, *a) -> None:
    for cb in callbacks:
        fn = getattr(cb, name, None)
        if fn is not None:
            fn(*a)


def _forward_step(data_iterator, model):
    """(output, loss fn); last stage: per-token loss (mbs, seq), fn -> (mean over unmasked tokens, {"lm loss"})."""
    batch = next(data_iterator)
    loss_mask = batch["loss_mask"].float()
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss = (output_tensor.float().reshape(-1) * loss_mask.reshape(-1)).sum() / loss_mask.sum()
        # clone: the schedule divides the returned loss in place by the number of micro-batches.
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def _on_device(batches, device):
    for batch in batches:
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def pretrain(args: argparse.Namespace, callbacks: list | None = None) -> TrainingResult:
    """Trains from validated arguments under torchrun; ValueError: a value checked only after set-up."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from lagom_megatron.training import cpu_shims, data
    from lagom_megatron.training import model as model_mod
    from lagom_megatron.training.arguments import build_parser
    from lagom_megatron.training.parity_flags import inactive_flags

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    log = lambda msg: _log(msg, rank=rank, world_size=world_size)  # noqa: E731
    on_gpu = torch.cuda.is_available()
    use_te = model_mod.use_transformer_engine(args)
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        cpu_shims.apply()
        device = torch.device("cpu")
    callbacks = list(callbacks or [])
    backend = args.distributed_backend if on_gpu else "gloo"
    if backend == "nccl" and getattr(args, "lagom", False):  # before the first communicator: NCCL loads its tuner once
        from lagom_megatron.nccl.plugin_launch import enable_in_process

        note = enable_in_process(nccl_version=".".join(map(str, torch.cuda.nccl.version())))
        if note:
            log(note)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
    )
    try:
        if getattr(args, "lagom", False):
            from lagom_megatron.megatron.consensus import all_gather
            from lagom_megatron.preflight.registration import registration_disagreement

            problem = registration_disagreement(all_gather(bool(getattr(args, "nccl_ub", False))))
            if problem:
                raise SystemExit(f"pretrain_gpt.py: error: {problem}")
        comm_config = args.nccl_communicator_config_path if on_gpu else None
        if args.nccl_communicator_config_path and not on_gpu:
            log("note: --nccl-communicator-config-path ignored on CPU (gloo has no NCCL options)")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            nccl_communicator_config_path=comm_config,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            high_priority_stream_groups=model_mod.high_priority_stream_groups(args) if on_gpu else None,
        )
        init_num_microbatches_calculator(
            rank, None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size
        )
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)

        log(
            f"pretrain_gpt: preset={args.preset_name} world_size={world_size} "
            f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
            f"VPP={args.virtual_pipeline_model_parallel_size} DP={args.data_parallel_size} "
            f"micro-batches={args.num_microbatches} backend={backend} "
            f"layers={'transformer_engine' if use_te else 'local'} "
            f"overlap_grad_reduce={args.overlap_grad_reduce} overlap_param_gather={args.overlap_param_gather} "
            f"use_distributed_optimizer={args.use_distributed_optimizer} ddp_bucket_size={args.ddp_bucket_size}"
        )
        log(
            f"pretrain_gpt: lagom={args.lagom} lagom_warmup_iters={args.lagom_warmup_iters} "
            f"lagom_verify_iters={args.lagom_verify_iters} "
            f"lagom_verify_max_iters={getattr(args, 'lagom_verify_max_iters', None)} lagom_method={args.lagom_method} "
            f"lagom_plan={args.lagom_plan} lagom_report={args.lagom_report} "
            f"lagom_cluster={getattr(args, 'lagom_cluster', None)}"
        )
        inactive = inactive_flags(args, build_parser(), on_gpu=on_gpu)
        if inactive:
            log(f"pretrain_gpt: accepted without effect here: {', '.join(inactive)}")

        config = model_mod.transformer_config(args, on_gpu=on_gpu)
        ddp_cfg = model_mod.ddp_config(args, on_gpu=on_gpu)
        chunks = model_mod.build_model(args, config, ddp_cfg, use_te=use_te)
        n_params = sum(p.numel() for c in chunks for p in c.parameters())
        log(
            f"pretrain_gpt: parameters on the last rank: {n_params:,} "
            f"(vocabulary {args.orig_vocab_size} padded to {args.padded_vocab_size})"
        )

        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            fp16=args.fp16,
            params_dtype=dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_param_gather=args.overlap_param_gather,
        )
        optimizer = get_megatron_optimizer(opt_config, chunks)
        config.grad_scale_func = optimizer.scale_loss
        gbs = args.global_batch_size
        # Megatron-LM counts LR steps in samples when --train-iters is given
        scheduler = OptimizerParamScheduler(
            optimizer,
            init_lr=args.lr_warmup_init,
            max_lr=args.lr,
            min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters * gbs,
            lr_decay_steps=args.lr_decay_iters * gbs,
            lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay,
            end_wd=args.weight_decay,
            wd_incr_steps=args.train_iters * gbs,
            wd_incr_style="constant",
            wsd_decay_steps=args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None,
            lr_wsd_decay_style=args.lr_wsd_decay_style,
        )

        tokenizer = data.build_tokenizer(args)
        dataset, valid = data.build_datasets(args, tokenizer, validation_samples(args))
        dp_rank = parallel_state.get_data_parallel_rank()

        def make_iterator(split, iters):
            return _on_device(
                data.microbatch_iterator(
                    split,
                    train_iters=iters,
                    global_batch_size=gbs,
                    micro_batch_size=args.micro_batch_size,
                    data_parallel_size=args.data_parallel_size,
                    data_parallel_rank=dp_rank,
                ),
                device,
            )

        def iterators(split, iters):
            return [make_iterator(split, iters) for _ in chunks] if len(chunks) > 1 else make_iterator(split, iters)

        data_iterator = iterators(dataset, args.train_iters)
        forward_backward = get_forward_backward_func()
        try:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        except Exception:  # older Megatron-Core without the collection
            pg_collection = None

        cb = _lagom_callback(args)
        if cb is not None:
            callbacks.append(cb)
        ctx = TrainingContext(
            args=args,
            model=chunks,
            optimizer=optimizer,
            ddp_config=ddp_cfg,
            pg_collection=pg_collection,
            forward_backward_func=forward_backward,
            data_iterator=data_iterator,
        )
        _call(callbacks, "on_setup", ctx)

        evaluate = None
        if valid is not None:
            evaluate = Evaluator(args, ctx, iterators(valid, validation_samples(args) // gbs), _forward_step, log)
        elif validation_samples(args):
            log(f"pretrain_gpt: note: --split {args.split} gives the validation split no documents; no evaluation")
        try:
            result = _train_loop(args, ctx, scheduler, callbacks, log, evaluate)
        except BaseException:
            # callbacks still close (a later pretrain() must not find lagom's patches); the training error propagates
            try:
                _call(callbacks, "on_train_end")
            except Exception:  # noqa: BLE001
                pass
            raise
        _call(callbacks, "on_train_end")
        return result
    finally:
        destroy_num_microbatches_calculator()
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_loop(args, ctx: TrainingContext, scheduler, callbacks: list, log, evaluate=None) -> TrainingResult:
    """Megatron-LM's ``train``: ``train_step`` iterations, logging, evaluation and early exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    gbs = args.global_batch_size
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    last_rank = dist.get_world_size() - 1
    result = TrainingResult()
    window_loss, window_time, window_n, window_skipped, window_nan = 0.0, 0.0, 0, 0, 0
    flops = num_floating_point_operations(args, gbs)
    world_size = dist.get_world_size()
    started = time.time()
    iteration = 0
    for iteration in range(1, 0 if args.skip_train else args.train_iters + 1):
        _call(callbacks, "on_iteration_start", iteration)
        t0 = time.perf_counter()
        for chunk in ctx.model:
            chunk.zero_grad_buffer()
        ctx.optimizer.zero_grad()
        losses = ctx.forward_backward_func(
            forward_step_func=_forward_step,
            data_iterator=ctx.data_iterator,
            model=ctx.model,
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        update_successful, grad_norm, _ = ctx.optimizer.step()
        if update_successful:
            scheduler.step(increment=gbs)
        lr = ctx.optimizer.param_groups[0]["lr"]  # after the step, as Megatron-LM's training_log reports it
        # mean over micro-batches and DP on the last stage, broadcast: callbacks see one number everywhere
        loss = torch.zeros(1, dtype=torch.float64)
        if last_stage:
            loss[0] = sum(float(x["lm loss"]) for x in losses) / len(losses)
            loss_dev = loss.to(torch.cuda.current_device()) if torch.cuda.is_available() else loss
            dist.all_reduce(loss_dev, group=dp_group)
            loss = loss_dev.cpu() / dist.get_world_size(group=dp_group)
        loss_dev = loss.to(torch.cuda.current_device()) if torch.cuda.is_available() else loss
        dist.broadcast(loss_dev, src=last_rank)
        loss_value = float(loss_dev.cpu()[0])
        elapsed = time.perf_counter() - t0
        # a skipped update is counted, as nan too when its loss is not finite (training_log, core_v0.16.1)
        window_skipped += int(not update_successful)
        window_nan += int(not update_successful and not math.isfinite(loss_value))
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"iteration {iteration}: lm loss is {loss_value}")
        result.losses.append(loss_value)
        result.iteration_times_s.append(elapsed)
        result.learning_rates.append(lr)
        window_loss += loss_value
        window_time += elapsed
        window_n += 1
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            log(
                format_iteration_line(
                    iteration=iteration,
                    train_iters=args.train_iters,
                    consumed_samples=iteration * gbs,
                    elapsed_ms=1000.0 * window_time / window_n,
                    lr=lr,
                    global_batch_size=gbs,
                    loss=window_loss / window_n,
                    tokens_per_s=window_n * gbs * args.seq_length / window_time,
                    grad_norm=float(grad_norm) if grad_norm is not None else None,
                    tflops_per_gpu=(
                        throughput_tflops_per_gpu(flops, window_time / window_n, world_size)
                        if args.log_throughput
                        else None
                    ),
                    loss_scale=float(ctx.optimizer.get_loss_scale()),
                    skipped_iters=window_skipped,
                    nan_iters=window_nan,
                )
            )
            window_loss, window_time, window_n, window_skipped, window_nan = 0.0, 0.0, 0, 0, 0
        _call(callbacks, "on_iteration_end", iteration, elapsed, loss_value)
        if evaluate is not None and iteration % args.eval_interval == 0:
            evaluate(f"iteration {iteration}")
        if _should_exit(args, iteration, started):
            log(f"pretrain_gpt: exiting after iteration {iteration} (--exit-interval / --exit-duration-in-mins)")
            break
    if evaluate is not None:
        evaluate(f"iteration {iteration} on validation set")
    sys.stdout.flush()
    return result


def _should_exit(args, iteration: int, started: float) -> bool:
    """Megatron-LM's exit conditions after an iteration (core_v0.16.1 ``training.py`` ``train``); all ranks agree."""
    import torch.distributed as dist

    if args.exit_interval and iteration % args.exit_interval == 0:
        return True
    if not args.exit_duration_in_mins:
        return False
    late = torch.tensor([float((time.time() - started) / 60.0 > args.exit_duration_in_mins)])
    if torch.cuda.is_available():
        late = late.cuda()
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


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
    """One evaluation of ``--eval-iters`` iterations per call (``batches``: an iterator, or one per chunk)."""

    def __init__(
        self,
        args: Any,
        ctx: Any,
        batches: Iterator | list[Iterator],
        forward_step: Callable,
        log: Callable[[str], None],
    ) -> None:
        self.args, self.ctx, self.batches, self.forward_step, self.log = args, ctx, batches, forward_step, log

    def __call__(self, prefix: str) -> float:
        """Evaluates and logs Megatron-LM's validation lines; returns the loss on every rank."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        for chunk in self.ctx.model:
            chunk.eval()
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for _ in range(self.args.eval_iters):
                    losses = self.ctx.forward_backward_func(
                        forward_step_func=self.forward_step,
                        data_iterator=self.batches,
                        model=self.ctx.model,
                        num_microbatches=self.args.num_microbatches,
                        seq_length=self.args.seq_length,
                        micro_batch_size=self.args.micro_batch_size,
                        forward_only=True,
                    )
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
