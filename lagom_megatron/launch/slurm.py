"""Shell variables for the SLURM launch scripts, computed from a preset.
Prints ``shlex``-quoted lines for ``eval`` in ``scripts/slurm/*.sbatch``: the preset's ``env``, ``LAGOM_CLUSTER``,
the tuner plugin's variables (built under ``$LAGOM_TUNER_DIR``, seen by every node) and ``LAGOM_*`` values."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from lagom_megatron.config.presets import Preset, load_preset
from lagom_megatron.engine.cluster import ClusterSpec
from lagom_megatron.launch.megatron_args import megatron_lm_line
from lagom_megatron.nccl.plugin_launch import launch_env

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top(text: str) -> list[str]:
    """Splits on commas outside brackets; ValueError on unbalanced or nested brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _range_values(body: str) -> list[str]:
    out = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"'[{body}]' holds {item!r}, not a number or a range LOW-HIGH")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """The host names of a SLURM host-list expression, in order; ValueError naming it and the fault."""
    if not text or not text.strip():
        raise ValueError("empty host list")
    hosts: list[str] = []
    try:
        for part in _split_top(text.strip()):
            if not part:
                raise ValueError("an empty entry between commas")
            names = [""]
            for piece in re.split(r"(\[[^\]]*\])", part):
                values = _range_values(piece[1:-1]) if piece.startswith("[") else [piece]
                names = [n + v for n in names for v in values]
            hosts += names
    except ValueError as exc:
        raise ValueError(f"host list {text!r}: {exc}") from None
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` as one count per node, ``"8(x2),4"`` -> ``[8, 8, 4]``; ValueError on a bad entry."""
    counts: list[int] = []
    for entry in text.strip().split(","):
        m = _TASKS.match(entry.strip())
        if not m or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r}: entry {entry!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def check_allocation(environ: Mapping[str, str], *, nodes: int, tasks_per_node: int, name: str) -> None:
    """Every node of the allocation runs ``tasks_per_node``; ValueError naming the variable, value and need."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        hosts = expand_hostlist(nodelist)
        if len(hosts) != nodes:
            raise ValueError(
                f"SLURM_JOB_NODELIST={nodelist!r} names {len(hosts)} nodes but preset {name!r} needs "
                f"{nodes}; submit with --nodes={nodes}"
            )
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names a node twice")
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    if tasks:
        counts = parse_tasks_per_node(tasks)
        if nodelist and len(counts) != len(expand_hostlist(nodelist)):
            raise ValueError(
                f"SLURM_TASKS_PER_NODE={tasks!r} gives {len(counts)} nodes, SLURM_JOB_NODELIST "
                f"{len(expand_hostlist(nodelist))}"
            )
        if any(c != tasks_per_node for c in counts):
            raise ValueError(
                f"SLURM_TASKS_PER_NODE={tasks!r}: the launch needs {tasks_per_node} task(s) on every "
                f"node ({'one torchrun per node' if tasks_per_node == 1 else 'one task per GPU'}); "
                f"submit with --ntasks-per-node={tasks_per_node}"
            )


FINGERPRINT_FROM_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "micro_batch_size",
    "global_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)
"""Fields of ``megatron.fingerprint.run_fingerprint`` the launch line decides (besides world size, backend, cluster)."""
PARALLEL_DEFAULTS = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
}


def plan_for_another_run(preset: Preset, plan: str, cluster: ClusterSpec, extra: Sequence[str]) -> str | None:
    """Why this launch would not reuse ``plan`` (fingerprint fields it states, then ``run_files.plan_problem``)."""
    from lagom_megatron.config.plan_files import load_plan
    from lagom_megatron.launch.megatron_args import argv_to_args
    from lagom_megatron.megatron.outputs.run_files import plan_problem

    saved = load_plan(plan)
    args = {
        **PARALLEL_DEFAULTS,
        **preset.to_args(),
        **argv_to_args(extra),
    }
    want = {k: args.get(k) for k in FINGERPRINT_FROM_ARGS if args.get(k) is not None}
    want.update(world_size=preset.world_size, backend=cluster.backend, cluster=cluster.name)
    if saved.backend != cluster.backend and "backend" not in saved.fingerprint:
        want["plan backend"] = cluster.backend
    have = {**saved.fingerprint, "plan backend": saved.backend}
    diff = [f"{k} {have[k]!r} (this run: {v!r})" for k, v in want.items() if k in have and have[k] != v]
    problem = plan_problem(saved, cluster) if not diff else None
    if not diff and problem is None:
        return None
    what = "; ".join(diff) if diff else problem
    return (
        f"--plan {plan} is not a plan of this run (preset {preset.name!r} on cluster {cluster.name!r}): {what}; "
        "the run would move it aside and search anew: give this run's plan, or a path that does not exist yet"
    )


DEFAULT_MASTER_PORT = 29500
"""torchrun's default, used outside a SLURM job."""


def master_port(environ: Mapping[str, str]) -> int:
    """Rendezvous port per job: 20000 + SLURM_JOB_ID mod 40000 (below the ephemeral range), else 29500."""
    job = environ.get("SLURM_JOB_ID", "")
    return 20000 + int(job) % 40000 if job.isdigit() else DEFAULT_MASTER_PORT


def plan_env_file(plan: str | None) -> Path | None:
    """The env file ``nccl.env_file`` wrote beside a plan (``p.json`` -> ``p.env``, else ``p.json.env``), or None."""
    if not plan:
        return None
    p = Path(plan)
    for candidate in (p.with_suffix(".env"), Path(str(p) + ".env")):
        if candidate.is_file():
            return candidate
    return None


def sbatch_options(preset: Preset, layout: str) -> list[str]:
    """``sbatch`` options for ``layout`` "per-node" (torchrun per node) or "per-gpu"; ValueError without ``slurm``."""
    slurm = _slurm(preset)
    tasks = 1 if layout == "per-node" else slurm.gpus_per_node
    opts = [
        f"--job-name=lagom-{preset.name}",
        f"--nodes={slurm.nodes}",
        f"--ntasks-per-node={tasks}",
        f"--gpus-per-node={slurm.gpus_per_node}",
        f"--time={slurm.time}",
        "--exclusive",
    ]
    if slurm.partition:
        opts.append(f"--partition={slurm.partition}")
    if slurm.account:
        opts.append(f"--account={slurm.account}")
    return opts


def _slurm(preset: Preset):
    if preset.slurm is None:
        raise ValueError(
            f"preset {preset.name!r} has no slurm section (nodes, gpus_per_node); "
            "it cannot be launched with the SLURM scripts"
        )
    return preset.slurm


def train_command(
    preset: Preset, *, root: str, plan: str | None, megatron_lm: str | None, extra: Sequence[str]
) -> list[str]:
    """The training script and its arguments (no python/torchrun in front); ``extra`` last, so it overrides."""
    if megatron_lm:
        cmd = [str(Path(megatron_lm) / "pretrain_gpt.py")]
    else:
        cmd = [str(Path(root) / "scripts" / "pretrain_gpt.py"), "--preset", preset.ref]
    if plan:
        extra = ["--lagom-plan", plan, *extra]
    return cmd + (megatron_lm_line(preset, extra) if megatron_lm else list(extra))


def shell_lines(
    preset: Preset,
    *,
    layout: str,
    root: str,
    plan: str | None = None,
    megatron_lm: str | None = None,
    extra: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    dry_run: bool = False,
) -> list[str]:
    """The lines for ``eval`` (``dry_run``: build nothing); ValueError: no slurm section, world size != nodes x GPUs
    per node, an allocation of another shape, a plan of another run."""
    environ = os.environ if environ is None else environ
    slurm = _slurm(preset)
    if slurm.nodes * slurm.gpus_per_node != preset.world_size:
        raise ValueError(
            f"preset {preset.name!r}: world_size {preset.world_size} != slurm.nodes x slurm.gpus_per_node "
            f"= {slurm.nodes} x {slurm.gpus_per_node}"
        )
    allocated = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    if allocated and allocated.isdigit() and int(allocated) != slurm.nodes:
        raise ValueError(
            f"the allocation has {allocated} nodes but preset {preset.name!r} needs {slurm.nodes}; "
            f"submit with --nodes={slurm.nodes}"
        )
    check_allocation(
        environ, nodes=slurm.nodes, name=preset.name, tasks_per_node=1 if layout == "per-node" else slurm.gpus_per_node
    )
    q = shlex.quote
    exports = {**preset.env, "LAGOM_CLUSTER": preset.env.get("LAGOM_CLUSTER", preset.cluster)}
    cluster = ClusterSpec.load(exports["LAGOM_CLUSTER"])
    saved = plan or preset.lagom.lagom_plan
    if saved and Path(saved).is_file():
        problem = plan_for_another_run(preset, saved, cluster, extra)
        if problem:
            raise ValueError(problem)
    plugin, note = launch_env(
        {**environ, **preset.env}, backend=cluster.backend, nccl_version=cluster.nccl_version, build=not dry_run
    )
    exports.update(plugin)
    lines = [f"echo {q(note)} >&2"] if note else []
    lines += [f"export {k}={q(str(v))}" for k, v in exports.items()]
    lines.append(f"LAGOM_EXPORTS=({' '.join(q(k) for k in exports)})")
    lines += [
        f"LAGOM_PRESET_NAME={q(preset.name)}",
        f"LAGOM_NODES={slurm.nodes}",
        f"LAGOM_GPUS_PER_NODE={slurm.gpus_per_node}",
        f"LAGOM_WORLD_SIZE={preset.world_size}",
        f"LAGOM_MASTER_PORT={master_port(environ)}",
    ]
    env_file = plan_env_file(plan or preset.lagom.lagom_plan)
    lines.append(f"LAGOM_PLAN_ENV={q(str(env_file)) if env_file else ''}")
    lines.append(f"LAGOM_SBATCH=({' '.join(q(o) for o in sbatch_options(preset, layout))})")
    cmd = train_command(preset, root=root, plan=plan, megatron_lm=megatron_lm, extra=extra)
    lines.append(f"LAGOM_TRAIN=({' '.join(q(c) for c in cmd)})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the lines; returns 0, or 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m lagom_megatron.launch.slurm", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--layout", choices=("per-node", "per-gpu"), default="per-node")
    parser.add_argument("--plan", help="plan file; default: the preset's lagom_plan")
    parser.add_argument("--megatron-lm", help="a patched Megatron-LM checkout to run instead of ours")
    parser.add_argument(
        "--root",
        default=str(Path(__file__).resolve().parents[2]),
        help="the lagom_megatron source tree (for scripts/pretrain_gpt.py)",
    )
    parser.add_argument("--dry-run", action="store_true", help="build nothing (the tuner plugin is only located)")
    parser.add_argument("extra", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    try:
        preset = load_preset(args.preset)
        lines = shell_lines(
            preset,
            layout=args.layout,
            root=args.root,
            plan=args.plan,
            megatron_lm=args.megatron_lm,
            extra=extra,
            dry_run=args.dry_run,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"lagom launch: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
