"""``lagom doctor``: the pre-flight checks of a training run, for a target cluster.

The checks themselves are ``lagom_megatron.training.preflight`` (``check_run``), the one
validation that ``scripts/pretrain_gpt.py`` also runs before any process group exists, so the
doctor and training reach the same verdict on the same input. This module adds what only a
doctor does: parsing a command line as the script would (``check_command_line``), a target
cluster other than this machine, and the entry point for a patched Megatron-LM checkout
(``preflight``).

Input: a ``Preset`` (or its name), an ``argparse.Namespace`` of Megatron-LM arguments, or a dict of
argparse destinations; the environment the ranks will see; and the cluster (a
``lagom_megatron.engine.cluster.ClusterSpec``, its name, or any object or dict with
``gpus_per_node``, ``sm_arch``, ``nccl_version``, ``backend``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from lagom_megatron.training.preflight import RULES, STOP, check_run, detect_cluster, resolve, run_rules
from lagom_megatron.training.preflight_env import BLACKWELL_SM_ARCH, rule_nccl_env
from lagom_megatron.training.preflight_types import Finding, Level, RunShape

__all__ = ["BLACKWELL_SM_ARCH", "RULES", "Finding", "Level", "RunShape", "resolve", "run_doctor", "errors",
           "preflight", "detect_cluster", "preflight_pretrain", "check_command_line", "plugin_abi_line"]


def run_doctor(args_or_preset: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
               world_size: int | None = None, gpus_per_node: int | None = None,
               preset_env: Mapping[str, str] | None = None, local: bool = False) -> list[Finding]:
    """Runs every rule of the shared pre-flight (``training.preflight.run_rules``).

    Args:
        args_or_preset: a ``Preset``, a preset name or path, an ``argparse.Namespace`` of
            Megatron-LM arguments, or a dict of argparse destinations.
        environ: the ranks' environment; None = ``os.environ``. A preset's ``env`` is laid over it.
        cluster: a ClusterSpec, its name, a dict/object with ``gpus_per_node``, ``sm_arch``,
            ``nccl_version``, ``backend``, or None (a preset's own cluster, else
            ``args.lagom_cluster`` when present, else unknown: backend "nccl", GPU taken as
            pre-Blackwell).
        world_size: ranks in the job, overriding the preset / ``WORLD_SIZE``.
        gpus_per_node: overriding the cluster / ``LOCAL_WORLD_SIZE``.
        preset_env: the preset's env section, when the caller resolved the preset itself.
        local: the run starts on this machine (folders, plan lock and port are checked).

    Returns:
        Findings, errors and warnings in rule order; empty = all clear.

    Raises:
        ValueError: unknown preset or cluster, or an unsupported input type.
    """
    return run_rules(resolve(args_or_preset, environ, cluster, world_size=world_size, gpus_per_node=gpus_per_node,
                             preset_env=preset_env, local=local))


def check_command_line(argv: list[str], world_size: int | None, environ: Mapping[str, str] | None = None,
                       cluster: Any = None, *, gpus_per_node: int | None = None,
                       preset_env: Mapping[str, str] | None = None, local: bool = False) -> list[Finding]:
    """The verdict of ``scripts/pretrain_gpt.py`` on a command line: its parser, then ``check_run``.

    ``training.arguments.parse_args`` then ``training.preflight.check_run(..., ours=True)``, the
    same calls the script makes, so an unknown flag, an invalid choice or a bad value is an error
    naming it. A line without a data source gets a warning and is checked as if it had
    ``--mock-data`` (the data flags are usually added at launch). ``world_size`` None or below 1
    is replaced by TP x PP x CP (the rules report a bad one given explicitly).

    Returns:
        The findings: ``command-line`` (argparse refused the line) and the ``nccl-env`` findings
        (they read only the environment and the cluster), or the ``data`` warning and the
        pre-flight's findings.
    """
    from lagom_megatron.training.arguments import parse_args

    try:
        ns = parse_args(argv, exit_on_error=False)
    except (ValueError, FileNotFoundError) as exc:
        line = Finding("error", "command-line", str(exc), STOP,
                       "fix the flag or value named (python scripts/pretrain_gpt.py --help lists them); "
                       "a Megatron-LM checkout's line is checked with lagom doctor --megatron-lm")
        # the NCCL variables need nothing of the line: still named, so that one run finds both
        shape = resolve({}, environ, cluster, world_size=world_size or 1, gpus_per_node=gpus_per_node,
                        preset_env=preset_env, local=local)
        return [line, *rule_nccl_env(shape)]
    out = []
    if not ns.mock_data and not ns.data_path:
        out.append(Finding(
            "warning", "data", "no training data: neither --mock-data nor --data-path is given",
            "pretrain_gpt.py stops without a data source; the rest of the line was checked as if "
            "--mock-data were given",
            "add --mock-data or --data-path PREFIX to the launch command",
        ))
        ns.mock_data = True
    if world_size is None:
        sizes = [getattr(ns, f, 1) for f in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                              "context_parallel_size")]
        world_size = sizes[0] * sizes[1] * sizes[2] if all(isinstance(v, int) and v >= 1 for v in sizes) else 1
    return out + check_run(ns, environ, cluster, world_size=world_size, gpus_per_node=gpus_per_node,
                           preset_env=preset_env, local=local, ours=True)


def plugin_abi_line(environ: Mapping[str, str], cluster: Any) -> str | None:
    """``lagom doctor: <line>`` saying which tuner and profiler ABI the cluster's NCCL will use with
    the library ``NCCL_TUNER_PLUGIN`` names (``nccl.plugin_check.plugin_abi_report``); None on gloo
    or when the variable names no loadable absolute path (the rules report that)."""
    from lagom_megatron.nccl.plugin_check import plugin_abi_report

    field = cluster.get if isinstance(cluster, dict) else (lambda k: getattr(cluster, k, None))
    if field("backend") == "gloo":
        return None
    version = field("nccl_version")
    line, _ = plugin_abi_report(environ, nccl_version=str(version) if version else None)
    return f"lagom doctor: {line}" if line else None


def errors(findings: list[Finding]) -> list[Finding]:
    """The findings of level "error"."""
    return [f for f in findings if f.level == "error"]


def preflight(args: Any, environ: Mapping[str, str] | None = None, cluster: Any = None, *,
              log: Callable[[str], None] = print) -> list[Finding]:
    """Runs the doctor for a training entry point and stops on errors.

    Prints every finding through ``log`` and a summary line.

    Returns:
        The findings (warnings only) when there is no error.

    Raises:
        SystemExit: with code 1 when there is at least one error (after printing them).
    """
    findings = run_doctor(args, environ, cluster, local=True)
    for f in findings:
        log(f"lagom doctor: {f}")
    n_err = len(errors(findings))
    if n_err:
        log(f"lagom doctor: {n_err} error(s), {len(findings) - n_err} warning(s); stopping before training")
        raise SystemExit(1)
    return findings


def preflight_pretrain(args: Any, environ: Mapping[str, str] | None = None) -> list[Finding]:
    """``preflight`` on a parsed namespace with ``detect_cluster``, printing on rank 0 only.

    Raises:
        SystemExit: code 1 when the doctor finds errors.
    """
    import os

    environ = os.environ if environ is None else environ

    def log(line: str) -> None:
        if environ.get("RANK", "0") == "0":
            print(line, flush=True)

    cluster = detect_cluster(getattr(args, "preset_name", None), environ)
    return preflight(args, environ, cluster, log=log)
