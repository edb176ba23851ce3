"""``--lagom`` in a Megatron-LM checkout's ``pretrain_gpt.py`` (called by what ``patches/`` adds). ``train``
(``megatron/training/training.py``) has no callbacks but looks ``train_step`` up as a module global each iteration
(same leading parameters core_v0.16 to main 0.20): lagom wraps it. Cluster: ``$LAGOM_CLUSTER``, else the local GPU."""

from __future__ import annotations

import argparse
import atexit
import inspect
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

ArgsProvider = Callable[[Any], Any]


def chain_extra_args_providers(*providers: ArgsProvider | None) -> ArgsProvider:
    """One ``extra_args_provider`` (``parser -> parser``) applying several in turn; None entries are skipped."""
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
    """lagom's callbacks around ``train_step`` (entry: core_v0.18+ ``parse_args``, core_v0.16/0.17 ``pretrain``)."""

    def __init__(self) -> None:
        self.active = False
        self.iteration = 0
        self.callbacks: list[Any] = []
        self._original: Callable | None = None
        self._module: Any = None
        self._set_up = False
        self._parser: argparse.ArgumentParser | None = None

    def print_help_if_asked(
        self, extra_args_provider: ArgsProvider | None = None, argv: list[str] | None = None
    ) -> None:
        """Answers ``--help`` with Megatron-LM's and lagom's flags, then SystemExit(0); runs before the pre-parse
        of ``maybe_wrap_for_inprocess_restart`` (``inprocess_restart.py:128`` @core_v0.16.1, :133 @core_v0.18.2)."""
        argv = sys.argv[1:] if argv is None else argv
        if not any(a in ("-h", "--help") for a in argv):
            return
        from megatron.training.arguments import parse_args

        try:
            parse_args(extra_args_provider=self.chained_provider(extra_args_provider))
        except ValueError as exc:  # a bare % in Megatron-LM's help (core_v0.18.2+): lagom's flags alone
            from lagom_megatron.training.arguments import add_lagom_args

            parser = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]), add_help=False)
            add_lagom_args(parser)
            print(f"Megatron-LM's --help fails on this checkout ({exc}); lagom's flags:\n", file=sys.stderr)
            print(parser.format_help())
        raise SystemExit(0)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, then :meth:`finish` (also on an exception or ``sys.exit``)."""
        try:
            return fn(*args, **kwargs)
        finally:
            self.finish()

    def chained_provider(self, extra_args_provider: ArgsProvider | None) -> ArgsProvider:
        """``extra_args_provider``, then lagom's flags; keeps the parser, whose defaults the doctor reads."""
        from lagom_megatron.training.arguments import add_lagom_args

        def keep(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            self._parser = parser
            return parser

        return chain_extra_args_providers(extra_args_provider, add_lagom_args, keep)

    def parser_defaults(self, args: Any) -> dict[str, Any]:
        """The defaults of Megatron-LM's parser for ``args``' names (empty before it was built)."""
        parser = self._parser
        return {} if parser is None else {name: parser.get_default(name) for name in vars(args)}

    def parse_args(
        self, parse_fn: Callable[..., Any], *args: Any, extra_args_provider: ArgsProvider | None = None, **kwargs: Any
    ) -> Any:
        """core_v0.18+: ``parse_fn`` with lagom's flags chained, then ``start`` (SystemExit(1) on doctor errors)."""
        cpu_mode()
        parsed = parse_fn(*args, extra_args_provider=self.chained_provider(extra_args_provider), **kwargs)
        self.start(parsed)
        return parsed

    def pretrain(
        self,
        pretrain_fn: Callable[..., Any],
        *args: Any,
        extra_args_provider: ArgsProvider | None = None,
        **kwargs: Any,
    ) -> Any:
        """core_v0.16/0.17: pre-parse, ``start`` (SystemExit(1) on doctor errors), ``pretrain_fn``, ``finish``."""
        from megatron.training.arguments import parse_args

        provider = self.chained_provider(extra_args_provider)
        cpu_mode()
        self.start(parse_args(extra_args_provider=provider), reparsed=True)
        try:
            return pretrain_fn(*args, extra_args_provider=provider, **kwargs)
        finally:
            self.finish()

    def start(
        self, args: Any, *, callbacks: list[Any] | None = None, cluster: Any = None, reparsed: bool = False
    ) -> LagomHooks:
        """Checks the versions (a warning without ``--lagom``), then with ``--lagom`` the run, and wraps ``train_step``;
        SystemExit(1): doctor errors; SystemExit(2): untested versions with ``--lagom``, an output folder in use, a
        ``--lagom``-only option without ``--lagom``, or a reused plan's registration this launch cannot make
        (``plan_registration``; ``reparsed``: ``pretrain`` parses the command line again); RuntimeError: already
        started."""
        if self.active:
            raise RuntimeError("lagom hooks are already installed around train_step")
        from lagom_megatron.megatron.hooks.versions import UntestedVersionError, check_versions

        lagom = bool(getattr(args, "lagom", False))
        allow = getattr(args, "lagom_allow_untested_versions", False)
        try:  # without --lagom only the CPU shims are lagom's: a warning, as the user did not ask for lagom
            for warning in check_versions(allow_untested=allow, refuse=lagom):
                _rank0_print(f"lagom: warning: {warning}")
        except UntestedVersionError as exc:
            _rank0_print(f"lagom: error: {exc}")
            raise SystemExit(2) from exc
        if not lagom:
            from lagom_megatron.preflight.lagom_flags import lagom_flag_problems

            problems = lagom_flag_problems(vars(args))
            if problems:
                _rank0_print(f"lagom: error: {problems[0].what}")
                raise SystemExit(2)
            return self
        from lagom_megatron.launch.doctor import detect_cluster, preflight

        preflight(
            args,
            os.environ,
            detect_cluster() if cluster is None else cluster,
            log=_rank0_print,
            megatron_lm=True,
            defaults=self.parser_defaults(args),
        )
        if int(os.environ.get("RANK", "0")) == 0:  # one writer per output folder, as our pretrain_gpt.py
            from lagom_megatron.preflight.files import hold_run_locks

            try:
                hold_run_locks(vars(args), os.environ)
            except ValueError as exc:
                _rank0_print(f"lagom: error: {exc}")
                raise SystemExit(2) from exc
        found = plan_registration(args, reparsed=reparsed)
        if found is not None and found.missing is not None:
            _rank0_print(f"lagom: error: {found.refusal()}")
            raise SystemExit(2)
        if found is not None and found.turns_on:
            _rank0_print(found.applied_line())
        enable_tuner_plugin(args)
        if callbacks is None:
            from lagom_megatron.megatron.control.controller import LagomController

            callbacks = [LagomController.from_args(args)]
        self.callbacks = list(callbacks)
        import megatron.training.training as training

        self._module = training
        self._original = training.train_step
        training.train_step = self._wrap(training.train_step)
        self.active = True
        # --exit-* exit in train(), past finish() (training.py:3030 @core_v0.16.1, :3821 @core_v0.18.2, :5084 @main)
        atexit.register(self.finish)
        _rank0_print(
            f"lagom: hooks around Megatron-LM's train_step | callbacks "
            f"{', '.join(type(c).__name__ for c in self.callbacks)}"
        )
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
            args=args,
            model=model,
            optimizer=bound["optimizer"],
            ddp_config=getattr(model[0], "ddp_config", None),
            pg_collection=bound.get("pg_collection"),
            forward_backward_func=bound["forward_backward_func"],
            data_iterator=bound["data_iterator"],
        )
        self._set_up = True
        self._call("on_setup", ctx)

    def _call(self, name: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, name, None)
            if fn is not None:
                fn(*args)

    def remove(self) -> None:
        """Restores Megatron-LM's ``train_step``; idempotent."""
        if self._module is not None and self._original is not None:
            self._module.train_step = self._original
        self._module = self._original = None
        self.active = False

    def finish(self) -> None:
        """Calls the callbacks' ``on_train_end`` and removes the wrapper, once (also registered with :mod:`atexit`)."""
        if self.active and self._set_up:
            self._call("on_train_end")
        self.remove()
        atexit.unregister(self.finish)


LATE_FOR_FSDP = (
    "Megatron-LM derived Megatron-FSDP's buffer settings from --use-nccl-ub when it validated the arguments "
    "(megatron/training/arguments.py:1149-1154 @core_v0.19.0), before lagom's hook ran"
)


def plan_registration(args: Any, *, reparsed: bool, on_gpu: bool | None = None, **checks: Any) -> Any:
    """``--lagom``: what the plan this run will reuse registers (``preflight.registration``), and ``nccl_ub`` on
    when lagom turns it on. The hook runs before Megatron-LM's ``pretrain`` builds the model: core_v0.18+ in
    ``parse_and_validate_args``, whose ``args`` are the global ones (``arguments.py:111`` @core_v0.19.0) that
    ``pretrain_cfg_container_from_args`` (``argument_utils.py:560``) and ``get_model`` (``training.py:1847``, by
    field name :1985-1987) read into the DDP config, before ``setup_model_and_optimizer`` (``training.py:1228``);
    core_v0.16/0.17 (``reparsed``) before ``pretrain``, whose ``initialize_megatron`` parses the command line again
    (``initialize.py:64-66`` @core_v0.16.1, ``training.py:768``, model at :903): there ``--use-nccl-ub`` joins
    ``sys.argv``. Megatron-FSDP's settings are derived in validation, already done on core_v0.18+: refused there
    with the flag as the way out."""
    from lagom_megatron.preflight import registration

    late = LATE_FOR_FSDP if getattr(args, "use_megatron_fsdp", False) and not reparsed else None
    found = registration.plan_registration(args, on_gpu=on_gpu, late_flag=late, **checks)
    if found is not None and found.turns_on and reparsed and registration.REGISTRATION_FLAG not in sys.argv:
        sys.argv.append(registration.REGISTRATION_FLAG)
    return found


def cpu_mode() -> bool:
    """Installs the ``megatron_lm_cpu`` shims without CUDA (before parsing: ``validate_args`` asks the GPU arch)."""
    from lagom_megatron.launch import megatron_lm_cpu

    return megatron_lm_cpu.apply()


def enable_tuner_plugin(args: Any, environ: Any = None) -> str | None:
    """Sets ``NCCL_TUNER_PLUGIN`` (a user's kept) before the first communicator (``training.py:768``,
    ``initialize.py:355`` @core_v0.16.1); returns the rank-0 note when it cannot (communicator mode then)."""
    import torch

    if getattr(args, "distributed_backend", "nccl") != "nccl" or not torch.cuda.is_available():
        return None
    import torch.distributed as dist

    from lagom_megatron.nccl.plugin_launch import enable_in_process

    if dist.is_available() and dist.is_initialized():
        note = (
            "lagom: warning: torch.distributed was initialised before lagom's hooks; NCCL may have "
            "loaded its tuner already, so the plugin may not be in use (communicator mode)"
        )
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
