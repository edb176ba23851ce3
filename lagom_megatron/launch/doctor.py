"""``lagom doctor``: ``preflight.check.check_run`` (also run by ``scripts/pretrain_gpt.py``) for a target cluster."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lagom_megatron.preflight.check import RULES, STOP, check_run, detect_cluster, resolve, run_rules
from lagom_megatron.preflight.cluster import cluster_field
from lagom_megatron.preflight.environment import rule_nccl_env
from lagom_megatron.preflight.types import Finding
from lagom_megatron.training.argument_checks import check_installed, validate_args
from lagom_megatron.training.arguments import parse_args
from lagom_megatron.training.pretrain_gpt import preset_world_problem

__all__ = [
    "RULES",
    "Finding",
    "run_doctor",
    "errors",
    "preflight",
    "detect_cluster",
    "preflight_pretrain",
    "check_command_line",
    "plugin_abi_line",
]


def run_doctor(
    args_or_preset: Any,
    environ: Mapping[str, str] | None = None,
    cluster: Any = None,
    *,
    world_size: int | None = None,
    gpus_per_node: int | None = None,
    preset_env: Mapping[str, str] | None = None,
    local: bool = False,
    megatron_lm: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """``preflight.check.run_rules``; ``cluster``: a ClusterSpec, its name, an object with its fields, or None (the
    preset's, else ``args.lagom_cluster``); ``local``: also folders, lock, port; ``megatron_lm``: a Megatron-LM line;
    ``defaults``: its parser's defaults. ValueError: unknown or bad input."""
    return run_rules(
        resolve(
            args_or_preset,
            environ,
            cluster,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            preset_env=preset_env,
            local=local,
            megatron_lm=megatron_lm,
            defaults=defaults,
        )
    )


def check_command_line(
    argv: list[str],
    world_size: int | None,
    environ: Mapping[str, str] | None = None,
    cluster: Any = None,
    *,
    gpus_per_node: int | None = None,
    preset_env: Mapping[str, str] | None = None,
    local: bool = False,
) -> list[Finding]:
    """``scripts/pretrain_gpt.py``'s verdict on a line (no data: as ``--mock-data``; world_size None: TP x PP x CP)."""
    try:
        ns = parse_args(argv, exit_on_error=False)
    except (ValueError, FileNotFoundError) as exc:
        line = Finding(
            "error",
            "command-line",
            str(exc),
            STOP,
            "fix the flag or value named (python scripts/pretrain_gpt.py --help lists them); "
            "a Megatron-LM checkout's line is checked with lagom doctor --megatron-lm",
        )
        # the NCCL variables need nothing of the line: still checked, so one run names both
        shape = resolve(
            {},
            environ,
            cluster,
            world_size=world_size or 1,
            gpus_per_node=gpus_per_node,
            preset_env=preset_env,
            local=local,
        )
        return [line, *rule_nccl_env(shape)]
    out = []
    if not ns.mock_data and not ns.data_path:
        out.append(
            Finding(
                "warning",
                "data",
                "no training data: neither --mock-data nor --data-path is given",
                "pretrain_gpt.py stops without a data source; the rest of the line was checked as if "
                "--mock-data were given",
                "add --mock-data or --data-path PREFIX to the launch command",
            )
        )
        ns.mock_data = True
    if world_size is None:
        sizes = [
            getattr(ns, f, 1)
            for f in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        ]
        world_size = sizes[0] * sizes[1] * sizes[2] if all(isinstance(v, int) and v >= 1 for v in sizes) else 1
    preset_world = preset_world_problem(ns, world_size)  # training's verdict on the preset's world size
    if preset_world is not None:
        out.append(preset_world)
    return out + check_run(
        ns,
        environ,
        cluster,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        preset_env=preset_env,
        local=local,
        validate=validate_args,
        installed=check_installed,
    )


def plugin_abi_line(environ: Mapping[str, str], cluster: Any) -> str | None:
    """``lagom doctor: <line>`` naming the plugin ABIs NCCL will use; None on gloo or without a loadable path."""
    from lagom_megatron.nccl.plugin_launch import plugin_abi_report

    if cluster_field(cluster, "backend") == "gloo":
        return None
    version = cluster_field(cluster, "nccl_version")
    line = plugin_abi_report(environ, nccl_version=str(version) if version else None)
    return f"lagom doctor: {line}" if line else None


def engine_line(environ: Mapping[str, str], cluster: Any) -> str | None:
    """``lagom doctor: NCCL engine: ...``: the class ``backend="nccl"`` will build with the torch Python imports here
    and ``environ`` (``nccl.engine.predicted_engine``); None on gloo or without torch."""
    from lagom_megatron.megatron.hooks.versions import installed_torch
    from lagom_megatron.nccl.engine import predicted_engine

    torch = installed_torch()
    if cluster_field(cluster, "backend") == "gloo" or torch is None:
        return None
    return f"lagom doctor: {predicted_engine(torch.version, environ).describe()}"


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


def preflight(
    args: Any,
    environ: Mapping[str, str] | None = None,
    cluster: Any = None,
    *,
    log: Callable[[str], None] = print,
    megatron_lm: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """Logs the doctor's findings for a training entry point (``megatron_lm``: Megatron-LM's, whose parser has
    ``defaults``); returns them, or raises SystemExit(1) on errors."""
    findings = run_doctor(args, environ, cluster, local=True, megatron_lm=megatron_lm, defaults=defaults)
    for f in findings:
        log(f"lagom doctor: {f}")
    n_err = len(errors(findings))
    if n_err:
        log(f"lagom doctor: {n_err} error(s), {len(findings) - n_err} warning(s); stopping before training")
        raise SystemExit(1)
    return findings


def preflight_pretrain(args: Any, environ: Mapping[str, str] | None = None) -> list[Finding]:
    """``preflight`` with ``detect_cluster``, printing on rank 0 only; SystemExit(1) on errors."""
    import os

    environ = os.environ if environ is None else environ

    def log(line: str) -> None:
        if environ.get("RANK", "0") == "0":
            print(line, flush=True)

    cluster = detect_cluster(getattr(args, "preset", None), environ)
    return preflight(args, environ, cluster, log=log)
