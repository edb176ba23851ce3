"""``--lagom`` in a Megatron-LM checkout's ``pretrain_gpt.py`` (the code ``patches/`` adds calls this).

Megatron-LM's training loop (``megatron/training/training.py::train``) has no callbacks, so this
module drives lagom's controller from around one function: ``train_step``, which ``train`` looks
up as a module global once per iteration, with the same leading parameters from core_v0.16 to
core_v0.19 (``forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
forward_backward_func``; later releases add ``pg_collection``). The wrapper calls the same
callbacks our own ``pretrain`` calls (``lagom_megatron.training.loop``):
``on_setup(TrainingContext)`` before the first step, ``on_iteration_start`` /
``on_iteration_end`` around each step, ``on_train_end`` from ``finish()``. The patch of
``train_step`` is the only one; ``remove()`` restores it.

What the patches add to ``pretrain_gpt.py``'s ``__main__`` block::

    from lagom_megatron.launch.megatron_lm import LagomHooks

    lagom = LagomHooks()
    # core_v0.18 and later: parse first, then pretrain(full_config, ...)
    args = lagom.parse_args(parse_and_validate_args, extra_args_provider=<as before>, ...)
    ...
    lagom.finish()
    # core_v0.16 / core_v0.17: pretrain parses the arguments itself
    lagom.pretrain(pretrain, <pretrain's arguments as before, extra_args_provider included>)

Both chain lagom's flags (``training.arguments.add_lagom_args``) after the provider that
``pretrain_gpt.py`` already passes (ModelOpt's when installed), then, when ``--lagom`` is set,
run ``lagom doctor`` (stopping on errors, before any process group exists) and install the
``train_step`` wrapper. For core_v0.16/0.17 the arguments are pre-parsed with Megatron-LM's own
``parse_args`` and the same provider so that the doctor runs before ``pretrain`` starts. Without
``--lagom`` nothing is installed.

The cluster for the doctor and the cost model is ``$LAGOM_CLUSTER`` (the SLURM scripts export the
preset's), else what torch reports about the local GPU.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import math
import os
import sys
import time
from typing import Any, Callable

ArgsProvider = Callable[[Any], Any]


def chain_extra_args_providers(*providers: ArgsProvider | None) -> ArgsProvider:
    """One ``extra_args_provider`` that applies several in turn (None entries are skipped).

    Megatron-LM accepts a single provider, a function ``parser -> parser``; each provider here
    gets the parser the previous one returned (or the same parser when it returns None).
    """
    chain = [p for p in providers if p is not None]

    def provider(parser):
        for p in chain:
            parser = p(parser) or parser
        return parser

    return provider


def _rank0_print(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


class LagomHooks:
    """lagom's callbacks driven from Megatron-LM's ``train_step`` (module docstring).

    Attributes:
        active: True while the ``train_step`` wrapper is installed.
        iteration: training steps seen (1-based after the first step).
        callbacks: the objects driven (default: one ``LagomController``).
    """

    def __init__(self) -> None:
        self.active = False
        self.iteration = 0
        self.callbacks: list[Any] = []
        self._original: Callable | None = None
        self._module: Any = None
        self._set_up = False

    def print_help_if_asked(self, extra_args_provider: ArgsProvider | None = None,
                            argv: list[str] | None = None) -> None:
        """Answers ``-h`` / ``--help`` with Megatron-LM's help and lagom's flags, then exits 0.

        The patches call this before ``inprocess_restart.maybe_wrap_for_inprocess_restart``, whose
        own pre-parse (``parse_args(ignore_unknown_args=True)``, Megatron-LM
        ``megatron/training/inprocess_restart.py:128`` in core_v0.16.1, ``:133`` in core_v0.18.2) would print
        Megatron-LM's help without lagom's flags and exit. Megatron-LM's ``parse_args`` is called
        with the chained provider, so argparse prints every flag and exits. Where Megatron-LM's own
        help cannot be formatted (core_v0.18.2 and later: a help string of its own with a bare
        ``%`` makes argparse raise ``ValueError``), lagom's flags are printed alone, with a note.

        Args:
            extra_args_provider: the provider pretrain_gpt.py passes (ModelOpt's or None).
            argv: the arguments (default ``sys.argv[1:]``).

        Raises:
            SystemExit: code 0 after printing, only when help was asked for.
        """
        argv = sys.argv[1:] if argv is None else argv
        if not any(a in ("-h", "--help") for a in argv):
            return
        from megatron.training.arguments import parse_args

        try:
            parse_args(extra_args_provider=self.chained_provider(extra_args_provider))
        except ValueError as exc:  # Megatron-LM's help text itself fails to format
            from lagom_megatron.training.arguments import add_lagom_args

            parser = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]), add_help=False)
            add_lagom_args(parser)
            print(f"Megatron-LM's --help fails on this checkout ({exc}); lagom's flags:\n", file=sys.stderr)
            print(parser.format_help())
        raise SystemExit(0)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, then :meth:`finish`, also when ``fn`` raises or calls ``sys.exit``."""
        try:
            return fn(*args, **kwargs)
        finally:
            self.finish()

    @staticmethod
    def chained_provider(extra_args_provider: ArgsProvider | None) -> ArgsProvider:
        """``extra_args_provider`` followed by ``training.arguments.add_lagom_args``."""
        from lagom_megatron.training.arguments import add_lagom_args

        return chain_extra_args_providers(extra_args_provider, add_lagom_args)

    def parse_args(self, parse_fn: Callable[..., Any], *args: Any,
                   extra_args_provider: ArgsProvider | None = None, **kwargs: Any) -> Any:
        """core_v0.18+: ``parse_fn(*args, extra_args_provider=<chained>, **kwargs)``, then ``start``.

        Args:
            parse_fn: Megatron-LM's ``parse_and_validate_args``.
            extra_args_provider: the provider pretrain_gpt.py passes (ModelOpt's or None).

        Returns:
            The parsed arguments, as ``parse_fn`` returns them.

        Raises:
            SystemExit: ``lagom doctor`` found errors (code 1).
        """
        cpu_mode()
        parsed = parse_fn(*args, extra_args_provider=self.chained_provider(extra_args_provider), **kwargs)
        self.start(parsed)
        return parsed

    def pretrain(self, pretrain_fn: Callable[..., Any], *args: Any,
                 extra_args_provider: ArgsProvider | None = None, **kwargs: Any) -> Any:
        """core_v0.16/0.17: pre-parse, ``start``, ``pretrain_fn(...)`` with the chained provider, ``finish``.

        The pre-parse uses Megatron-LM's ``megatron.training.arguments.parse_args`` with the same
        provider (``pretrain`` parses again itself; parsing has no side effects).

        Returns:
            What ``pretrain_fn`` returns.

        Raises:
            SystemExit: ``lagom doctor`` found errors (code 1), before ``pretrain_fn`` runs.
        """
        from megatron.training.arguments import parse_args

        provider = self.chained_provider(extra_args_provider)
        cpu_mode()
        self.start(parse_args(extra_args_provider=provider))
        try:
            return pretrain_fn(*args, extra_args_provider=provider, **kwargs)
        finally:
            self.finish()

    def start(self, args: Any, *, callbacks: list[Any] | None = None, cluster: Any = None) -> "LagomHooks":
        """Checks the run and installs the ``train_step`` wrapper when ``args.lagom`` is set.

        Args:
            args: Megatron-LM's parsed arguments.
            callbacks: callback objects to drive; default ``[LagomController.from_args(args)]``.
            cluster: for the doctor; default ``lagom_megatron.launch.doctor.detect_cluster()``.

        Returns:
            self.

        Raises:
            SystemExit: ``lagom doctor`` found errors (printed on rank 0), with code 1; another run
                writes one of this run's output folders, with code 2; without
                ``--lagom``, an option only ``--lagom`` reads was given a value other than its default
                (``training.lagom_flags.lagom_flag_problems``), with code 2.
            RuntimeError: already started.
        """
        if self.active:
            raise RuntimeError("lagom hooks are already installed around train_step")
        if not getattr(args, "lagom", False):
            from lagom_megatron.training.lagom_flags import lagom_flag_problems

            problems = lagom_flag_problems(vars(args))  # e.g. --lagom-plan alone: refused, not ignored
            if problems:
                _rank0_print(f"lagom: error: {problems[0].what}")
                raise SystemExit(2)
            return self
        from lagom_megatron.megatron.versions import UntestedVersionError, check_versions

        try:
            for warning in check_versions(allow_untested=getattr(args, "lagom_allow_untested_versions", False)):
                _rank0_print(f"lagom: warning: {warning}")
        except UntestedVersionError as exc:
            _rank0_print(f"lagom: error: {exc}")
            raise SystemExit(2) from exc
        from lagom_megatron.launch.doctor import detect_cluster, preflight

        preflight(args, os.environ, detect_cluster() if cluster is None else cluster, log=_rank0_print)
        if int(os.environ.get("RANK", "0")) == 0:  # one writer per output folder, as our pretrain_gpt.py
            from lagom_megatron.training.preflight_files import hold_run_locks

            try:
                hold_run_locks(vars(args), os.environ)
            except ValueError as exc:
                _rank0_print(f"lagom: error: {exc}")
                raise SystemExit(2) from exc
        enable_tuner_plugin(args)
        if callbacks is None:
            from lagom_megatron.megatron.controller import LagomController

            callbacks = [LagomController.from_args(args)]
        self.callbacks = list(callbacks)
        import megatron.training.training as training

        self._module = training
        self._original = training.train_step
        training.train_step = self._wrap(training.train_step)
        self.active = True
        # Megatron-LM's --exit-interval, --exit-duration-in-mins and --exit-signal-handler end in
        # sys.exit() inside train() (megatron/training/training.py:3030 in core_v0.16.1, :3821 in core_v0.18.2,
        # :5084 in main),
        # past the patch's finish(): finish at interpreter exit too (it runs once).
        atexit.register(self.finish)
        _rank0_print(f"lagom: hooks around Megatron-LM's train_step | callbacks "
                     f"{', '.join(type(c).__name__ for c in self.callbacks)}")
        return self

    def _wrap(self, train_step: Callable) -> Callable:
        signature = inspect.signature(train_step)

        def lagom_train_step(*args, **kwargs):
            if not self._set_up:
                self._on_setup(signature.bind(*args, **kwargs).arguments)
            self.iteration += 1
            self._call("on_iteration_start", self.iteration)
            t0 = time.perf_counter()
            out = train_step(*args, **kwargs)
            _synchronize()
            elapsed = time.perf_counter() - t0
            self._call("on_iteration_end", self.iteration, elapsed, _loss_of(out))
            return out

        lagom_train_step.__wrapped__ = train_step  # type: ignore[attr-defined]
        return lagom_train_step

    def _on_setup(self, bound: dict[str, Any]) -> None:
        from megatron.training import get_args

        from lagom_megatron.training.loop import TrainingContext

        args = get_args()
        if getattr(args, "num_microbatches", None) is None:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            args.num_microbatches = get_num_microbatches()
        model = bound["model"]
        model = model if isinstance(model, list) else [model]
        ctx = TrainingContext(
            args=args, model=model, optimizer=bound["optimizer"],
            ddp_config=getattr(model[0], "ddp_config", None), pg_collection=bound.get("pg_collection"),
            forward_backward_func=bound["forward_backward_func"], data_iterator=bound["data_iterator"],
        )
        self._set_up = True
        self._call("on_setup", ctx)

    def _call(self, name: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, name, None)
            if fn is not None:
                fn(*args)

    def remove(self) -> None:
        """Restores Megatron-LM's ``train_step``; safe to call twice."""
        if self._module is not None and self._original is not None:
            self._module.train_step = self._original
        self._module = self._original = None
        self.active = False

    def finish(self) -> None:
        """Ends training for the callbacks (``on_train_end``) and removes the wrapper; a second call
        does nothing (``start`` also registers it with :mod:`atexit` for Megatron-LM's ``sys.exit``)."""
        if self.active and self._set_up:
            self._call("on_train_end")
        self.remove()
        atexit.unregister(self.finish)


def cpu_mode() -> bool:
    """Installs the CPU shims of a Megatron-LM checkout (``launch.megatron_lm_cpu.apply``) when CUDA is
    absent; the patches' entry points call it before Megatron-LM parses (``validate_args`` asks for the
    GPU architecture). Returns True when they are installed."""
    from lagom_megatron.launch import megatron_lm_cpu

    return megatron_lm_cpu.apply()


def enable_tuner_plugin(args: Any, environ: Any = None) -> str | None:
    """Turns lagom's NCCL tuner plugin on in this process, as ``scripts/pretrain_gpt.py`` does
    (``training/loop.py``), for a run started with plain ``torchrun`` (the SLURM scripts export the
    variables already, and a variable the user set is kept).

    NCCL reads ``NCCL_TUNER_PLUGIN`` once per process, when the first communicator is created
    (``nccl/plugin_launch.py``); ``start`` runs before ``pretrain`` calls ``initialize_megatron`` ->
    ``torch.distributed.init_process_group`` (Megatron-LM core_v0.16.1 ``training.py:768``,
    ``initialize.py:355``), so every rank sets it in time. Without it NCCL loads no tuner and lagom
    falls back to communicator mode (no chunk size, no LL128, one communicator per configuration).

    Args:
        args: Megatron-LM's parsed arguments (``distributed_backend``, default "nccl").
        environ: the environment to update (default ``os.environ``).

    Returns:
        The line logged on rank 0 when the plugin cannot be used (None when it was enabled, was
        already set, or the run has no NCCL: no CUDA, or ``--distributed-backend gloo``).
    """
    import torch

    if getattr(args, "distributed_backend", "nccl") != "nccl" or not torch.cuda.is_available():
        return None
    import torch.distributed as dist

    from lagom_megatron.nccl.plugin_launch import enable_in_process

    if dist.is_available() and dist.is_initialized():
        note = ("lagom: warning: torch.distributed was initialised before lagom's hooks; NCCL may have "
                "loaded its tuner already, so the plugin may not be in use (communicator mode)")
    else:
        note = enable_in_process(environ, nccl_version=".".join(map(str, torch.cuda.nccl.version())))
    if note:
        _rank0_print(note)
    return note


def _loss_of(out: Any) -> float:
    """The 'lm loss' of ``train_step``'s loss dict (last pipeline stage only), else NaN."""
    loss_dict = out[0] if isinstance(out, tuple) and out else None
    if isinstance(loss_dict, dict) and "lm loss" in loss_dict:
        value = loss_dict["lm loss"]
        if isinstance(value, (tuple, list)):  # (sum, count) in some releases
            value = value[0] / max(float(value[1]), 1.0)
        return float(value)
    return math.nan


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
