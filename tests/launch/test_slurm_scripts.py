"""SLURM launch scripts run with fake srun / scontrol / sbatch on PATH: the printed (--dry-run) and
executed commands, the environment every rank inherits, the plan's env file, and the doctor gate."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lagom_megatron.config.presets import load_preset
from lagom_megatron.launch.slurm import master_port, plan_env_file

ROOT = Path(__file__).resolve().parents[2]
PER_NODE = ROOT / "scripts" / "slurm" / "lagom_pretrain.sbatch"
PER_GPU = ROOT / "scripts" / "slurm" / "lagom_pretrain_per_gpu.sbatch"
PY = sys.executable

FAKE_SRUN = r"""#!/bin/bash
# records its arguments and the NCCL/CUDA/rendezvous environment; with FAKE_SRUN_EXEC=N runs the
# command for N tasks with SLURM_PROCID/SLURM_LOCALID set, as srun does
echo "$@" > "$FAKE_LOG/srun.args"
env | grep -E '^(NCCL_[A-Z0-9_]*|LAGOM_CLUSTER|CUDA_DEVICE_MAX_CONNECTIONS|MASTER_ADDR|MASTER_PORT|TORCH_NCCL_[A-Z_]*|WORLD_SIZE|LOCAL_WORLD_SIZE)=' | sort > "$FAKE_LOG/srun.env"
while [[ $# -gt 0 && "$1" == --* ]]; do shift; done
for ((i = 0; i < ${FAKE_SRUN_EXEC:-0}; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i "$@" || exit $?; done
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && printf 'node-a07\\nnode-a08\\n'
"""
FAKE_SBATCH = """#!/bin/bash
echo "$@" > "$FAKE_LOG/sbatch.args"
"""
FAKE_PRETRAIN = """import os, sys
print("RANK", os.environ["RANK"], "LOCAL_RANK", os.environ["LOCAL_RANK"], "WORLD_SIZE", os.environ["WORLD_SIZE"],
      "PLUGIN", os.environ.get("NCCL_TUNER_PLUGIN"), "TABLE", repr(os.environ.get("LAGOM_TUNER_CONFIG")),
      "ARGS", " ".join(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """Where the launch finds (here: builds once) the tuner plugin, as LAGOM_TUNER_DIR."""
    from lagom_megatron.nccl.plugin import build_tuner

    out = tmp_path_factory.mktemp("nccl-plugin")
    return build_tuner(out).parent


@pytest.fixture
def fake(tmp_path, plugin_dir):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("sbatch", FAKE_SBATCH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    log.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "NCCL_", "CUDA_DEVICE_MAX", "MASTER_", "WORLD_SIZE"))
    }
    env = {k: v for k, v in env.items() if not k.startswith("LAGOM_TUNER")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        FAKE_LOG=str(log),
        LAGOM_PYTHON=PY,
        LAGOM_ROOT=str(ROOT),
        LAGOM_TUNER_DIR=str(plugin_dir),
    )

    def run(script, *args, slurm=True, extra_env=None):
        e = dict(env)
        if slurm:  # an allocation of the preset's nodes, node-a07 onwards, as SLURM would set it
            i = args.index("--preset") + 1 if "--preset" in args else len(args)
            name = args[i] if i < len(args) and not args[i].startswith("-") else None
            preset = load_preset(name) if name else None
            nodes = preset.slurm.nodes if preset is not None and preset.slurm is not None else 2
            e.update(
                SLURM_JOB_ID="123456", SLURM_JOB_NODELIST=f"node-a[07-{6 + nodes:02d}]" if nodes > 1 else "node-a07"
            )
        e.update(extra_env or {})
        return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=e, cwd=tmp_path)

    run.log = log
    run.tmp = tmp_path
    run.plugin = str(plugin_dir / "libnccl-tuner-lagom.so")
    return run


def test_per_node_dry_run_prints_exact_commands(fake):
    proc = fake(PER_NODE, "--dry-run", "--preset", "llama3-70b-h100x64", "--", "--train-iters", "50")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:8] == [
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export TORCH_NCCL_AVOID_RECORD_STREAMS=1",
        "export NCCL_P2P_NET_CHUNKSIZE=2097152",
        "export NCCL_DEBUG=WARN",
        "export LAGOM_CLUSTER=h100-sxm-ib400",
        f"export NCCL_TUNER_PLUGIN={fake.plugin}",
        f"export NCCL_PROFILER_PLUGIN={fake.plugin}",
        "export LAGOM_TUNER_CONFIG=''",
    ]
    lines = lines[:4] + lines[8:]
    doctor = shlex.split(lines[4])
    assert doctor[:5] == [PY, "-m", "lagom_megatron.cli", "doctor", "--no-preset-env"]
    assert lines[5] == f"export MASTER_ADDR=node-a07 MASTER_PORT={20000 + 123456 % 40000}"
    srun = shlex.split(lines[6])
    train = str(ROOT / "scripts" / "pretrain_gpt.py")
    assert srun == [
        "srun",
        "--kill-on-bad-exit=1",
        "--nodes=8",
        "--ntasks-per-node=1",
        "--export=ALL",
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes=8",
        "--nproc-per-node=8",
        "--rdzv-id=123456",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node-a07:23456",
        "--max-restarts=0",
        train,
        "--preset",
        "llama3-70b-h100x64",
        "--train-iters",
        "50",
    ]
    assert len(lines) == 7
    assert not (fake.log / "srun.args").exists()  # dry run: srun never called
    assert "0 error(s)" in proc.stderr


def test_per_gpu_dry_run_prints_exact_commands(fake):
    proc = fake(PER_GPU, "--dry-run", "--preset", "llama2-7b-a100x32-ib100", slurm=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # NCCL 2.21.5 (a100-ib100) cannot load lagom's plugin: no plugin variables, a note on stderr
    assert lines[:4] == [
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export TORCH_NCCL_AVOID_RECORD_STREAMS=1",
        "export NCCL_DEBUG=WARN",
        "export LAGOM_CLUSTER=a100-ib100",
    ]
    assert "NCCL 2.21.5 cannot load lagom's tuner plugin (2.22+); lagom applies CTA bounds only" in proc.stderr
    lines = lines[:3] + lines[4:]
    assert lines[4] == "export MASTER_ADDR=FIRST_NODE_OF_THE_ALLOCATION MASTER_PORT=29500"
    assert lines[5] == "export WORLD_SIZE=32 LOCAL_WORLD_SIZE=8 OMP_NUM_THREADS=1"
    srun = shlex.split(lines[6])
    assert srun[:5] == ["srun", "--kill-on-bad-exit=1", "--nodes=4", "--ntasks-per-node=8", "--export=ALL"]
    assert srun[5:9] == ["bash", "-c", 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID; exec "$@"', "lagom-rank"]
    assert srun[9:] == [PY, str(ROOT / "scripts" / "pretrain_gpt.py"), "--preset", "llama2-7b-a100x32-ib100"]


def test_per_node_run_exports_settings_to_every_rank(fake):
    proc = fake(PER_NODE, "--preset", "llama3-8b-h100x8", extra_env={"SLURM_JOB_NUM_NODES": "1"})
    assert proc.returncode == 0, proc.stderr
    env = (fake.log / "srun.env").read_text().splitlines()
    assert env == [
        "CUDA_DEVICE_MAX_CONNECTIONS=1",
        "LAGOM_CLUSTER=h100-sxm-ib400",
        "MASTER_ADDR=node-a07",
        "MASTER_PORT=23456",
        "NCCL_DEBUG=WARN",
        f"NCCL_PROFILER_PLUGIN={fake.plugin}",
        f"NCCL_TUNER_PLUGIN={fake.plugin}",
        "TORCH_NCCL_AVOID_RECORD_STREAMS=1",
    ]
    assert (fake.log / "srun.args").read_text().startswith("--kill-on-bad-exit=1 --nodes=1 ")


def test_per_gpu_ranks_from_slurm_and_megatron_lm_flags(fake):
    mlm = fake.tmp / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text(FAKE_PRETRAIN)
    proc = fake(
        PER_GPU,
        "--preset",
        "llama2-7b-a100x32-ib100",
        "--megatron-lm",
        str(mlm),
        "--",
        "--train-iters",
        "3",
        extra_env={"FAKE_SRUN_EXEC": "2"},
    )
    assert proc.returncode == 0, proc.stderr
    ranks = [line.split(" ARGS ")[0] for line in proc.stdout.splitlines() if line.startswith("RANK")]
    assert ranks == [f"RANK {r} LOCAL_RANK {r} WORLD_SIZE 32 PLUGIN None TABLE None" for r in (0, 1)]  # NCCL 2.21
    args = proc.stdout.splitlines()[-1].split(" ARGS ")[1].split()
    for flag in (
        "--tensor-model-parallel-size 2",
        "--num-query-groups 32 --group-query-attention",
        "--disable-bias-linear",
        "--rotary-base 10000",
        "--lagom-plan runs/llama2-7b-a100x32-ib100/plan.json",
    ):
        assert flag in " ".join(args), flag
    assert args[-2:] == ["--train-iters", "3"]
    assert "--preset" not in args


def _valid_plan(path, preset="llama3-8b-h100x8"):
    """A minimal valid plan file of ``preset``'s run (an empty NCCL plan never verified): the scripts
    check an existing --plan against the run they launch."""
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.engine.plan import Plan
    from lagom_megatron.nccl.rules import default_mechanism

    p = load_preset(preset)
    cluster = ClusterSpec.load(p.cluster)
    Plan(
        entries={},
        backend="nccl",
        mechanism=default_mechanism(cluster),
        fingerprint={"cluster": cluster.name, "backend": "nccl", "world_size": p.world_size},
    ).save(path)


def test_plan_env_file_is_sourced_before_srun(fake):
    plan = fake.tmp / "plan.json"
    _valid_plan(plan)
    (fake.tmp / "plan.env").write_text("NCCL_NTHREADS=256\nNCCL_BUFFSIZE=8388608\n")
    proc = fake(PER_NODE, "--preset", "llama3-8b-h100x8", "--plan", str(plan))
    assert proc.returncode == 0, proc.stderr
    env = (fake.log / "srun.env").read_text().splitlines()
    assert "NCCL_NTHREADS=256" in env and "NCCL_BUFFSIZE=8388608" in env
    assert (fake.log / "srun.args").read_text().split()[-2:] == ["--lagom-plan", str(plan)]
    dry = fake(PER_NODE, "--dry-run", "--preset", "llama3-8b-h100x8", "--plan", str(plan))
    assert f"set -a; source {fake.tmp / 'plan.env'}; set +a" in dry.stdout.splitlines()


def test_doctor_errors_stop_the_launch(fake):
    proc = fake(PER_NODE, "--preset", "llama3-8b-h100x8", "--", "--tensor-model-parallel-size", "3")
    assert proc.returncode == 1
    assert "[world-size]" in proc.stderr and "not launching" in proc.stderr
    assert not (fake.log / "srun.args").exists()


@pytest.mark.parametrize(
    "extra, what",
    [
        (["--lagom-method", "foo"], "invalid choice: 'foo' (choose from 'priority', 'autoccl', 'nccl-default')"),
        (["--tensor-model-paralel-size", "2"], "unrecognized arguments: --tensor-model-paralel-size"),
    ],
)
def test_bad_pretrain_flags_stop_at_the_doctor(fake, extra, what):
    proc = fake(PER_NODE, "--preset", "llama3-70b-h100x64", "--dry-run", "--", *extra)
    assert proc.returncode == 1, proc.stderr
    assert "error: [command-line] " in proc.stderr and what in proc.stderr
    assert "lagom doctor found errors; not launching" in proc.stderr
    assert "srun" not in proc.stdout.split("lagom_megatron.cli doctor")[-1]
    assert not (fake.log / "srun.args").exists()


@pytest.mark.parametrize("script", [PER_NODE, PER_GPU], ids=["per-node", "per-gpu"])
def test_help_prints_usage(fake, script):
    proc = fake(script, "--help", slurm=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Megatron pretraining with lagom on SLURM")
    assert "Options: --preset NAME|PATH (required)" in proc.stdout and "#" not in proc.stdout.split("\n")[0]
    assert proc.stderr == ""


def test_missing_plan_is_announced_and_its_folder_created(fake):
    plan = fake.tmp / "runs" / "new" / "plan.json"
    dry = fake(PER_NODE, "--dry-run", "--preset", "llama3-8b-h100x8", "--plan", str(plan))
    assert dry.returncode == 0, dry.stderr
    assert (
        f"lagom_pretrain: warning: plan {plan} does not exist; this run searches a new plan and saves it there"
        in dry.stderr.splitlines()
    )
    assert not plan.parent.exists()  # a dry run creates nothing
    proc = fake(
        PER_GPU, "--preset", "llama2-7b-a100x32-ib100", "--plan", str(plan), extra_env={"SLURM_JOB_NUM_NODES": "4"}
    )
    assert proc.returncode == 0, proc.stderr
    assert "warning: plan" in proc.stderr and plan.parent.is_dir()
    assert (fake.log / "srun.args").read_text().split()[-2:] == ["--lagom-plan", str(plan)]
    _valid_plan(plan)
    again = fake(PER_NODE, "--dry-run", "--preset", "llama3-8b-h100x8", "--plan", str(plan))
    assert again.returncode == 0 and "warning: plan" not in again.stderr


def test_plan_under_a_file_or_a_directory_is_refused(fake):
    (fake.tmp / "afile").write_text("")
    proc = fake(PER_NODE, "--dry-run", "--preset", "llama3-8b-h100x8", "--plan", str(fake.tmp / "afile" / "plan.json"))
    assert proc.returncode == 2
    assert f"cannot write the plan under {fake.tmp / 'afile'} (not a writable folder)" in proc.stderr
    proc = fake(PER_NODE, "--dry-run", "--preset", "llama3-8b-h100x8", "--plan", str(fake.tmp))
    assert proc.returncode == 2 and "is a directory; give the plan's file" in proc.stderr


def test_bad_plan_env_values_stop_the_launch(fake):
    plan = fake.tmp / "plan.json"
    _valid_plan(plan, "llama2-7b-a100x32-ib100")
    (fake.tmp / "plan.json.env").write_text("export NCCL_NTHREADS=480\n")
    proc = fake(PER_GPU, "--preset", "llama2-7b-a100x32-ib100", "--plan", str(plan))
    assert proc.returncode == 1 and "NCCL_NTHREADS=480" in proc.stderr
    assert not (fake.log / "srun.args").exists()


def test_submit_uses_the_preset_shape(fake):
    proc = fake(PER_GPU, "--submit", "--preset", "llama2-7b-a100x32-ib100", slurm=False)
    assert proc.returncode == 0, proc.stderr
    args = (fake.log / "sbatch.args").read_text().split()
    assert args == [
        "--job-name=lagom-llama2-7b-a100x32-ib100",
        "--nodes=4",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--time=01:00:00",
        "--exclusive",
        str(PER_GPU),
        "--preset",
        "llama2-7b-a100x32-ib100",
    ]


def test_allocation_of_the_wrong_size_is_refused(fake):
    proc = fake(PER_NODE, "--preset", "llama3-70b-h100x64", extra_env={"SLURM_JOB_NUM_NODES": "2"})
    assert proc.returncode == 2
    assert "has 2 nodes but preset 'llama3-70b-h100x64' needs 8" in proc.stderr


def test_outside_an_allocation_without_dry_run(fake):
    proc = fake(PER_NODE, "--preset", "llama3-8b-h100x8", slurm=False)
    assert proc.returncode == 2 and "not inside a SLURM allocation" in proc.stderr


def test_master_port_and_plan_env_helpers(tmp_path):
    assert master_port({"SLURM_JOB_ID": "123456"}) == 23456
    assert master_port({}) == 29500
    assert plan_env_file(str(tmp_path / "p.json")) is None
    (tmp_path / "p.env").write_text("")
    assert plan_env_file(str(tmp_path / "p.json")) == tmp_path / "p.env"


def test_slurm_env_refuses_presets_without_a_slurm_shape(capsys):
    from lagom_megatron.launch.slurm import main

    assert main(["--preset", "cpu-tp2-dp2"]) == 2
    assert "preset 'cpu-tp2-dp2' has no slurm section" in capsys.readouterr().err


def test_slurm_env_checks_world_size_against_slurm_shape(tmp_path):
    from lagom_megatron.config.presets import load_preset
    from lagom_megatron.launch.slurm import shell_lines

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: llama3-8b\ncluster: h100-sxm-ib400\nworld_size: 16\nslurm: {nodes: 1, gpus_per_node: 8}\n")
    with pytest.raises(ValueError, match=r"world_size 16 != slurm.nodes x slurm.gpus_per_node = 1 x 8"):
        shell_lines(load_preset(bad), layout="per-node", root="/src", environ={})
    lines = shell_lines(
        load_preset("gpt3-13b-h100x64"),
        layout="per-gpu",
        root="/src",
        environ={},
        megatron_lm="/mlm",
        extra=["--train-iters", "2"],
    )
    train = shlex.split(lines[-1][len("LAGOM_TRAIN=(") : -1])
    assert train[0] == "/mlm/pretrain_gpt.py" and train[-2:] == ["--train-iters", "2"]
    assert "--ntasks-per-node=8" in lines[-2] and "--nodes=8" in lines[-2]


def test_dry_run_sets_an_absolute_tuner_plugin_for_every_rank(fake):
    """Must show: `lagom_pretrain.sbatch --preset llama3-70b-h100x64 --dry-run` exports
    NCCL_TUNER_PLUGIN, an absolute path to a library NCCL can load, before the srun whose
    --export=ALL hands it to every rank (torchrun passes its environment to its ranks)."""
    proc = fake(PER_NODE, "--preset", "llama3-70b-h100x64", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    (plugin,) = [l for l in lines if l.startswith("export NCCL_TUNER_PLUGIN=")]
    path = plugin.split("=", 1)[1]
    assert os.path.isabs(path) and Path(path).is_file() and path == fake.plugin
    srun = next(i for i, l in enumerate(lines) if l.startswith("srun "))
    assert lines.index(plugin) < srun and "--export=ALL" in lines[srun]
    assert "NCCL_TUNER_PLUGIN" not in proc.stderr, "the doctor accepts the exported plugin"


def test_users_plugin_and_gloo_clusters_are_left_alone(fake):
    mine = fake(
        PER_NODE,
        "--preset",
        "llama3-70b-h100x64",
        "--dry-run",
        extra_env={"NCCL_TUNER_PLUGIN": fake.plugin, "LAGOM_TUNER_CONFIG": "/tmp/x.csv"},
    )
    assert mine.returncode == 0, mine.stderr
    assert not [l for l in mine.stdout.splitlines() if l.startswith(("export NCCL_TUNER_PLUGIN", "export LAGOM_TUNER"))]
    from lagom_megatron.nccl.plugin_launch import launch_env

    assert launch_env({}, backend="gloo") == ({}, None)
    no_cc = launch_env({"LAGOM_TUNER_DIR": str(fake.tmp / "empty"), "CC": "no-such-cc-lagom"})
    assert no_cc[0] == {} and "communicator mode" in no_cc[1] and "no-such-cc-lagom" in no_cc[1]


def test_every_rank_inherits_the_plugin(fake):
    """Per-GPU layout on an NCCL 2.27 cluster: each rank srun starts sees the same absolute path."""
    mlm = fake.tmp / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text(FAKE_PRETRAIN)
    proc = fake(
        PER_GPU,
        "--preset",
        "llama3-8b-h100x8",
        "--megatron-lm",
        str(mlm),
        extra_env={"FAKE_SRUN_EXEC": "8", "SLURM_JOB_NUM_NODES": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    ranks = [line.split(" ARGS ")[0] for line in proc.stdout.splitlines() if line.startswith("RANK")]
    assert ranks == [f"RANK {r} LOCAL_RANK {r} WORLD_SIZE 8 PLUGIN {fake.plugin} TABLE ''" for r in range(8)]


@pytest.mark.parametrize("script", [PER_NODE, PER_GPU])
def test_dry_run_never_executes_the_plan_env_file(fake, script):
    """A dry run reads the plan's env file with lagom's parser: a command in it neither runs
    nor passes; clean `export` lines are shown, never sourced."""
    plan = fake.tmp / "runs" / "plan.json"
    plan.parent.mkdir()
    marker = fake.tmp / "ran"
    plan.with_suffix(".env").write_text(f"export NCCL_MAX_CTAS=16\ntouch {marker}\n")
    proc = fake(script, "--dry-run", "--preset", "llama3-70b-h100x64", "--plan", str(plan))
    assert proc.returncode == 2 and not marker.exists(), proc.stderr
    assert "expected NAME=value, got 'touch" in proc.stderr and "the plan's env file) is not valid" in proc.stderr
    plan.with_suffix(".env").write_text("export NCCL_MAX_CTAS=16\n")
    proc = fake(script, "--dry-run", "--preset", "llama3-70b-h100x64", "--plan", str(plan))
    assert proc.returncode == 0, proc.stderr
    assert f"set -a; source {plan.with_suffix('.env')}; set +a" in proc.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--preset"], "lagom_pretrain: --preset needs a value (see --help)"),
        (["--preset", "llama3-70b-h100x64", "--plan"], "--plan needs a value"),
        (["--preset", "--dry-run"], "--preset needs a value"),
        (
            ["--preset", "llama3-70b-h100x64", "--megatron-lm", "/nonexistent"],
            "--megatron-lm /nonexistent: no pretrain_gpt.py there",
        ),
    ],
)
def test_dry_run_checks_every_input(fake, args, expected):
    proc = fake(PER_NODE, "--dry-run", *args)
    assert proc.returncode == 2 and expected in proc.stderr and proc.stdout == "", (proc.stdout, proc.stderr)
    assert "line " not in proc.stderr  # no bash internals


def test_dry_run_refuses_a_truncated_plan(fake):
    plan = fake.tmp / "plan.json"
    plan.write_text('{"schema_version": 1, "entries": {')
    proc = fake(PER_NODE, "--dry-run", "--preset", "llama3-70b-h100x64", "--plan", str(plan))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "invalid JSON" in proc.stderr and f"--plan {plan} is not a valid plan" in proc.stderr


def test_submit_outside_slurm_names_the_missing_tool(fake, tmp_path):
    bare = {"PATH": "/usr/bin:/bin"}  # no sbatch, no srun
    proc = fake(PER_NODE, "--submit", "--preset", "llama3-70b-h100x64", slurm=False, extra_env=bare)
    assert proc.returncode == 2, proc.stderr
    assert "--submit needs SLURM's sbatch, which is not on PATH here" in proc.stderr
    assert "command not found" not in proc.stderr
    proc = fake(PER_GPU, "--preset", "llama2-7b-a100x32-ib100", extra_env=bare)
    assert proc.returncode == 2 and "SLURM's srun is not on PATH here" in proc.stderr


def test_a_plan_of_another_run_stops_the_dry_run(fake):
    """A CPU (gloo) plan given to an H100 preset passed the dry run (rc 0); the run would only have
    moved it aside once the allocation had started."""
    from lagom_megatron.config.plan_files import load_plan
    from lagom_megatron.engine.plan import Plan

    gloo = fake.tmp / "cpu-plan.json"
    Plan(
        entries={},
        backend="gloo",
        mechanism="gloo",
        fingerprint={"cluster": "cpu-gloo", "backend": "gloo", "world_size": 4, "tensor_model_parallel_size": 2},
    ).save(gloo)
    proc = fake(PER_NODE, "--dry-run", "--preset", "llama3-8b-h100x8", "--plan", str(gloo))
    assert proc.returncode == 2 and "srun" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        f"lagom launch: error: --plan {gloo} is not a plan of this run (preset 'llama3-8b-h100x8' on cluster "
        "'h100-sxm-ib400'): tensor_model_parallel_size 2 (this run: 1); world_size 4 (this run: 8); backend 'gloo' "
        "(this run: 'nccl'); cluster 'cpu-gloo' (this run: 'h100-sxm-ib400'); "
        "the run would move it aside and search anew: give this run's plan, or a path that does not exist yet"
    )
    layout = fake.tmp / "tp2-plan.json"
    _valid_plan(layout)
    data = load_plan(layout).to_dict()
    data["fingerprint"]["tensor_model_parallel_size"] = 2
    Plan.from_dict(data).save(layout)
    proc = fake(PER_NODE, "--dry-run", "--preset", "llama3-8b-h100x8", "--plan", str(layout))
    assert proc.returncode == 2 and "tensor_model_parallel_size 2 (this run: 1)" in proc.stderr
    # the same line with the layout the plan was made for: accepted (the doctor then checks that layout)
    proc = fake(
        PER_NODE,
        "--dry-run",
        "--preset",
        "llama3-8b-h100x8",
        "--plan",
        str(layout),
        "--",
        "--tensor-model-parallel-size",
        "2",
    )
    assert "is not a plan of this run" not in proc.stderr, proc.stderr


def test_a_dry_run_builds_nothing(fake, tmp_path):
    """The dry run built build/nccl-plugin/libnccl-tuner-lagom.so although a dry run creates nothing."""
    empty = tmp_path / "no-plugin-yet"
    empty.mkdir()
    proc = fake(PER_NODE, "--dry-run", "--preset", "llama3-8b-h100x8", extra_env={"LAGOM_TUNER_DIR": str(empty)})
    assert proc.returncode == 0, proc.stderr
    assert list(empty.iterdir()) == []
    assert (
        f"lagom: note: a dry run builds nothing; the launch builds the NCCL tuner plugin as "
        f"{empty / 'libnccl-tuner-lagom.so'} and exports NCCL_TUNER_PLUGIN to every rank"
    ) in proc.stderr
    assert "NCCL_TUNER_PLUGIN" not in proc.stdout.split("lagom_megatron.cli doctor")[0]
    run = fake(
        PER_NODE, "--preset", "llama3-8b-h100x8", extra_env={"LAGOM_TUNER_DIR": str(empty), "SLURM_JOB_NUM_NODES": "1"}
    )
    assert run.returncode == 0, run.stderr
    assert (empty / "libnccl-tuner-lagom.so").is_file()  # the launch itself builds it


@pytest.mark.parametrize("preset", ["llama3-70b-h100x64", "gpt3-13b-h100x64"])
def test_a_dry_run_off_the_cluster_says_what_it_checked_and_passes(fake, preset):
    """On a machine that is not a node of the preset's cluster (here: no CUDA GPU, no Transformer
    Engine, no APEX) the dry run checks the line, the layout and the environment for the nodes and
    says that this machine's files, port and libraries are not checked: context parallel (llama3-70b)
    needs Transformer Engine and gradient accumulation fusion (gpt3-13b) APEX on the nodes, where
    training checks them, so neither stops the dry run here (exit 0, the srun line printed)."""
    proc = fake(PER_NODE, "--preset", preset, "--dry-run", slurm=False)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.splitlines()
    assert (
        "lagom doctor: checking cluster 'h100-sxm-ib400' (NCCL 2.30.7, sm_90 GPUs): named by $LAGOM_CLUSTER "
        "(--cluster checks another); this machine (no CUDA GPU) is not one of its nodes, so the command line, "
        "layout and environment are checked for its nodes but not this machine's files, port and libraries "
        "(training checks those on each node before it starts)"
    ) in err
    # NCCL 2.30.7 tries getNcclTuner_v6 and getNcclProfiler_v6 first (src/plugin/tuner.cc:73,
    # src/plugin/profiler.cc:73 @v2.30.7-1; no v7 header in that tree)
    assert (
        f"lagom doctor: NCCL 2.30.7 will use, of {fake.plugin}: ncclTunerPlugin_v6 (tuner ABI v6); "
        "ncclProfiler_v6 (profiler ABI v6)"
    ) in err
    assert f"lagom doctor: preset {preset}: 0 error(s), 0 warning(s)" in err
    assert proc.stdout.splitlines()[-1].startswith("srun --kill-on-bad-exit=1 --nodes=8 ")
    # the same line checked as a node would check it stops on the missing library
    from lagom_megatron.launch.doctor import check_command_line

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "LAGOM_", "CUDA_DEVICE_MAX"))}
    env.update(load_preset(preset).env)
    found = check_command_line(["--preset", preset, "--mock-data"], None, env, "h100-sxm-ib400", local=True)
    what = "Transformer Engine" if preset.startswith("llama3") else "APEX"
    assert any(f.level == "error" and what in f.what for f in found), [str(f) for f in found]
