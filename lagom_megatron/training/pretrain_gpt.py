"""``pretrain_gpt.py``: pre-train a GPT with Megatron-Core, optionally tuned by lagom (docs/training.md)."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lagom_megatron.engine.cluster import MAX_WORLD_SIZE
from lagom_megatron.megatron.hooks.versions import UntestedVersionError, check_versions
from lagom_megatron.preflight.check import STOP, check_run, env_count
from lagom_megatron.preflight.cluster import choose_cluster, mismatch, this_machine
from lagom_megatron.preflight.files import hold_run_locks
from lagom_megatron.preflight.types import Finding
from lagom_megatron.training.argument_checks import check_installed, validate_args
from lagom_megatron.training.arguments import LAYOUT_FLAGS, UsageError, build_parser, parse_args


def _single_process_env() -> None:
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def _program() -> str:
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if started is not None and started.name == "pretrain_gpt.py" and started.parent.name == "scripts":
        return "scripts/pretrain_gpt.py"
    return "-m lagom_megatron.training.pretrain_gpt"


def _launch_hint(args) -> str:
    n = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if args.preset:  # the preset's world size, unless flags changed the layout so it no longer fits
        from lagom_megatron.config.presets import load_preset

        world_size = load_preset(args.preset).world_size
        n = world_size if world_size % n == 0 else n
    return f"; launch {n} processes with: torchrun --standalone --nproc-per-node {n} {_program()} ..."


REFUSAL_GRACE_S = 120.0
"""Seconds ranks > 0 wait before exiting on a refused input, so rank 0's error precedes torchrun's stop."""

REPEAT_LIMIT_S = 300.0
"""Seconds the copy of a refused run's line waits for torchrun's agent to exit; then it gives up, silent."""


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: its output is complete)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def repeat_after_exit(pid: int | str, line: str, limit_s: float | str = REPEAT_LIMIT_S) -> bool:
    """Writes ``line`` to stderr once process ``pid`` has exited (a pidfd, else polling); False: it still ran after
    ``limit_s`` seconds, nothing written."""
    import select
    import time

    pid, deadline = int(pid), time.monotonic() + float(limit_s)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    except (AttributeError, OSError):  # not Linux >= 5.3
        fd = -1
    if fd is not None and fd >= 0:
        with contextlib.closing(io.FileIO(fd)):
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
    elif fd == -1:
        while not _gone(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
    os.write(2, line.encode() + b"\n")
    return True


def _repeat_after_torchrun(line: str) -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID``, on its last restart: torch 2.13 ``elastic/agent/server/
    local_elastic_agent.py:426-428``), a process of its own session (the agent's ``os.killpg`` of a worker's
    session leaves it: ``subprocess_handler.py:66, 85``) repeats ``line`` once the agent, this rank's parent, has
    printed its ``ChildFailedError`` summary (``launcher/api.py:378-386``) and exited: the last line the user sees."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or env.get("TORCHELASTIC_RESTART_COUNT") != env.get(
        "TORCHELASTIC_MAX_RESTARTS"
    ):
        return
    import subprocess

    code = (
        "import sys; from lagom_megatron.training.pretrain_gpt import repeat_after_exit; "
        "repeat_after_exit(*sys.argv[1:])"
    )
    try:
        subprocess.Popen(
            [sys.executable, "-c", code, str(os.getppid()), line],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        pass  # the line was printed once already


def _refused(code: int, rank0: bool, line: str | None = None) -> int:
    if not rank0:
        import time

        time.sleep(REFUSAL_GRACE_S)
    elif line:
        _repeat_after_torchrun(line)
    return code


def preset_world_problem(args: Any, world_size: int) -> Finding | None:
    """A ``preset-world-size`` error (a warning with ``LAYOUT_FLAGS`` given) when the world is not the preset's."""
    want = getattr(args, "preset_world_size", None)
    if want is None or want == world_size:
        return None
    from lagom_megatron.config.presets import load_preset

    mp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    layout = (
        f"TP={args.tensor_model_parallel_size} x PP={args.pipeline_model_parallel_size} x "
        f"CP={args.context_parallel_size} x DP={world_size // mp}"
    )
    name = args.preset_name
    given = getattr(args, "layout_flags_given", ())
    processes = f"{world_size} process{'es' if world_size != 1 else ''}"
    ranks = f"this job has {processes} (WORLD_SIZE={world_size})"
    if given:
        return Finding(
            "warning",
            "preset-world-size",
            f"preset {name!r} is for world size {want} but {ranks}: training {layout}, the layout "
            f"{', '.join(given)} give{'s' if len(given) == 1 else ''}",
            "the command line names the layout itself",
            f"launch {want} processes for the preset's own layout",
        )
    slurm = load_preset(args.preset).slurm if getattr(args, "preset", None) else None
    if slurm is not None and slurm.nodes > 1:
        launch = (
            f"launch it on {slurm.nodes} nodes x {slurm.gpus_per_node} GPUs "
            f"(scripts/slurm/lagom_pretrain.sbatch --preset {name})"
        )
    else:
        launch = f"launch it with torchrun --nproc-per-node {want}"
    return Finding(
        "error",
        "preset-world-size",
        f"preset {name!r} is for world size {want} but {ranks}, which would train {layout} instead of "
        f"the preset's DP={want // mp}: {launch}, or give the layout on the command line "
        f"({', '.join(LAYOUT_FLAGS)}) to train another one on {processes}",
        STOP,
        launch,
    )


def pretrain_preflight(
    args: Any, environ: Mapping[str, str] | None = None, *, log: Callable[[str], None] | None = None
) -> int:
    """Pre-flight before any process group: 0 = start, 2 = stop (``--lagom``: folders locked); sets lagom_cluster."""
    environ = os.environ if environ is None else environ
    rank0 = environ.get("RANK", "0") == "0"

    def say(line: str) -> None:
        if rank0:
            (log or (lambda s: print(s, flush=True)))(line)

    def refused(findings: list[Finding]) -> bool:
        bad = [f for f in findings if f.level == "error"]
        if bad:  # the first error; lagom doctor prints all of them
            more = f" (and {len(bad) - 1} more error(s): lagom doctor lists them)" if len(bad) > 1 else ""
            say(f"pretrain_gpt.py: error: {bad[0].what}{more}")
        return bool(bad)

    try:
        world_size = env_count(environ, "WORLD_SIZE", MAX_WORLD_SIZE, "the job's world size") or 1
        # the arguments alone first: no torch import (seconds) for a line that cannot start anyway; the refused
        # flags wait for the machine, which adds what its layers cannot run (every refusal in one run)
        if refused(
            check_run(
                args,
                environ,
                None,
                world_size=world_size,
                local=True,
                machine=False,
                validate=functools.partial(validate_args, refuse=False),
            )
        ):
            return 2
        preset_world = preset_world_problem(args, world_size)
        if preset_world is not None:
            if refused([preset_world]):
                return 2
            say(f"pretrain_gpt.py: warning: {preset_world.what}")
        machine = this_machine()
        target = choose_cluster(
            getattr(args, "preset", None),  # the name or path as given: a file's stem names no shipped preset
            environ,
            getattr(args, "lagom_cluster", None),
            "--lagom-cluster",
            machine,
        )
        problem = mismatch(target, machine)
        if problem:
            say(f"pretrain_gpt.py: error: {problem}")
            return 2
        findings = check_run(
            args,
            environ,
            target.cluster,
            world_size=world_size,
            local=True,
            validate=functools.partial(validate_args, on_gpu=machine.cuda),
            installed=check_installed,
        )
        if not isinstance(target.cluster, Mapping):  # lagom's cost model starts from the same cluster
            args.lagom_cluster = target.name
    except ValueError as exc:
        say(f"pretrain_gpt.py: error: {exc}")
        return 2
    if refused(findings):
        return 2
    if getattr(args, "lagom", False):
        for f in findings:
            say(f"lagom doctor: {f}")
        if rank0:
            try:
                hold_run_locks(vars(args), environ)
            except ValueError as exc:
                say(f"pretrain_gpt.py: error: {exc}")
                return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parses, checks and trains as one rank of a torchrun job: 0 trained, 2 refused input, 130 Ctrl-C."""
    rank0 = os.environ.get("RANK", "0") == "0"
    error: list[str] = []  # rank 0's refusal, repeated after torchrun's summary

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if line.startswith("pretrain_gpt.py: error:"):
            error[:] = [line]

    try:
        if rank0:
            try:
                args = parse_args(argv, exit_on_error=False)
            except UsageError:
                build_parser().print_usage(sys.stderr)
                raise
        else:  # the same check, silent: one copy of the usage error, not one per rank
            with contextlib.redirect_stdout(io.StringIO()):
                args = parse_args(argv, exit_on_error=False)
        for warning in check_versions(allow_untested=args.lagom_allow_untested_versions):
            if rank0:
                print(f"pretrain_gpt.py: warning: {warning}", file=sys.stderr, flush=True)
    except (ValueError, FileNotFoundError, UntestedVersionError) as exc:
        if rank0:
            say(f"pretrain_gpt.py: error: {exc}")
        return _refused(2, rank0, error[0] if error else None)

    def hint(message: str) -> str:
        if "WORLD_SIZE" not in os.environ and message.startswith(
            "pretrain_gpt.py: error: world size 1 is not divisible"
        ):
            return message + _launch_hint(args)
        return message

    code = pretrain_preflight(args, log=lambda line: say(hint(line)))
    if code:
        return _refused(code, rank0, error[0] if error else None)
    args = validate_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    from lagom_megatron.preflight.registration import plan_registration

    registration = plan_registration(args)  # every rank reads the plan: each builds its own DDP buffers
    if registration is not None and registration.missing is not None:
        if rank0:
            say(f"pretrain_gpt.py: error: {registration.refusal()}")
        return _refused(2, rank0, error[0] if error else None)
    if registration is not None and registration.turns_on and rank0:
        print(registration.applied_line(), flush=True)
    _single_process_env()
    from lagom_megatron.training.loop import pretrain

    try:
        pretrain(args)
    except KeyboardInterrupt:  # torchrun passes SIGINT to every rank: one line, not a traceback per rank
        if rank0:  # lagom's report is written by then (training.loop closes its callbacks)
            print("pretrain_gpt.py: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
