"""``lagom doctor``: pre-flight checks (``preflight/``) of a preset or a ``pretrain_gpt.py`` command line; this machine
is checked only when it can be one of the cluster's nodes."""

from __future__ import annotations

import argparse
import json
import os

from lagom_megatron.cli.options import int_range
from lagom_megatron.engine.cluster import MAX_GPUS_PER_NODE, MAX_WORLD_SIZE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the options; after ``--``: a ``pretrain_gpt.py`` command line."""
    parser.add_argument("--preset", help="preset name (configs/presets/) or path")
    parser.add_argument(
        "--cluster",
        help="target cluster name (configs/clusters/) or path; default as training "
        "chooses it: --lagom-cluster in the line, $LAGOM_CLUSTER, the preset's "
        "cluster, else this machine (cpu-gloo without CUDA, else its GPU)",
    )
    parser.add_argument(
        "--world-size",
        type=int_range(1, MAX_WORLD_SIZE),
        help="ranks in the job; default as training counts them: $WORLD_SIZE, else the preset's, else TP x PP x CP",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int_range(1, MAX_GPUS_PER_NODE),
        help="default: the preset's SLURM shape, else the cluster's, else $LOCAL_WORLD_SIZE",
    )
    parser.add_argument(
        "--megatron-lm",
        action="store_true",
        help="the line after -- is for a Megatron-LM checkout's pretrain_gpt.py: check the "
        "layout and what that release fails on (--eval-interval, fused kernels without APEX, "
        "packages), not our parser's flags (default: parse it with scripts/pretrain_gpt.py's "
        "parser, so unknown flags and invalid values are errors)",
    )
    parser.add_argument(
        "--megatron-lm-release",
        metavar="TAG",
        help="with --megatron-lm: the Megatron-LM release, e.g. core_v0.16.1 (core_v0.16-0.19 and main's 0.20 "
        "are known; a newer one is checked with main's rules); default: that of the importable megatron-core",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument(
        "--no-preset-env",
        action="store_true",
        help="check the environment as it is (the launch scripts have exported the "
        "preset's env and the plan's env file already)",
    )
    parser.add_argument(
        "argv", nargs=argparse.REMAINDER, help="-- followed by pretrain_gpt.py arguments (Megatron-LM flag names)"
    )


def run(args: argparse.Namespace) -> int:
    """Prints the findings; 0 without errors, 1 with some. ValueError: no input, unknown preset or cluster."""
    import sys

    from lagom_megatron.launch.doctor import check_command_line, engine_line, errors, plugin_abi_line, run_doctor
    from lagom_megatron.launch.megatron_args import argv_to_args, megatron_lm_line
    from lagom_megatron.preflight.check import env_count
    from lagom_megatron.preflight.cluster import choose_cluster, cluster_field, mismatch, this_machine

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if args.preset:
        argv = ["--preset", args.preset, *argv]
    if not argv:
        raise ValueError("give --preset NAME and/or a pretrain_gpt.py command line after --")
    parsed = argv_to_args(argv)
    preset = parsed.pop("_preset", None)
    if args.megatron_lm and preset is not None:  # the line the SLURM launch runs for a Megatron-LM checkout
        parsed = argv_to_args(megatron_lm_line(preset, argv))
    world_size = args.world_size
    gpus_per_node = args.gpus_per_node
    environ = dict(os.environ)
    if world_size is None:  # as training counts the job: WORLD_SIZE first (read strictly: abc or 0 is refused)
        world_size = env_count(environ, "WORLD_SIZE", MAX_WORLD_SIZE, "--world-size")
    preset_env: dict[str, str] = {}
    if preset is not None:
        preset_env = dict(preset.env)
        if not args.no_preset_env:
            environ.update(preset.env)
        if world_size is None:
            world_size = preset.world_size
        if gpus_per_node is None and preset.slurm is not None:
            gpus_per_node = preset.slurm.gpus_per_node
    machine = this_machine()
    target = choose_cluster(
        preset,
        environ,
        args.cluster or parsed.get("lagom_cluster"),
        "--cluster" if args.cluster else "--lagom-cluster",
        machine,
    )
    away = mismatch(target, machine) is not None
    if gpus_per_node is None:
        env_count(environ, "LOCAL_WORLD_SIZE", MAX_GPUS_PER_NODE, "--gpus-per-node")  # the rules read it later
    local = not away  # --cluster or --lagom-cluster: one target, one verdict, this machine checked when it is a node
    first = f"lagom doctor: checking {target.describe()}: {target.reason()}"
    if away:
        first += (
            f"; this machine ({machine.describe()}) is not one of its nodes, so the command line, "
            "layout and environment are checked for its nodes but not this machine's files, port and "
            "libraries (training checks those on each node before it starts)"
        )
    print(first, file=sys.stderr if args.json else sys.stdout)
    cluster = target.cluster
    if args.megatron_lm:
        from lagom_megatron.megatron.hooks.versions import installed_megatron_core
        from lagom_megatron.preflight.megatron_lm import choose_release, megatron_lm_traps

        installed = installed_megatron_core()
        release, traps = choose_release(args.megatron_lm_release, installed.version if installed else None)
        if release is not None:
            on_gpu = cluster_field(cluster, "backend") != "gloo"
            traps += megatron_lm_traps(parsed, release, local=local, on_gpu=on_gpu)
        findings = traps + run_doctor(
            parsed,
            environ,
            cluster,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            preset_env=preset_env,
            local=local,
            megatron_lm=True,
        )
    elif args.megatron_lm_release:
        raise ValueError("--megatron-lm-release needs --megatron-lm")
    else:
        findings = check_command_line(
            argv, world_size, environ, cluster, gpus_per_node=gpus_per_node, preset_env=preset_env, local=local
        )
    n_err = len(errors(findings))
    if args.json:
        print(
            json.dumps(
                [{"level": f.level, "rule": f.rule, "what": f.what, "why": f.why, "fix": f.fix} for f in findings],
                indent=1,
            )
        )
    else:
        for f in findings:
            print(f)
        for line in (engine_line(environ, cluster), plugin_abi_line(environ, cluster)):
            if line:
                print(line)
        name = f"preset {preset.name}" if preset is not None else "command line"
        print(f"lagom doctor: {name}: {n_err} error(s), {len(findings) - n_err} warning(s)")
    return 1 if n_err else 0
