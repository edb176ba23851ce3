"""The fifteen bad (and wrongly refused) inputs of the pre-flight issue, each as a test.

Each test asserts the exit status, the one line naming the flag or variable, the bad value and
what is allowed, and that no rank started (``preflight_harness.train`` records whether
``training.loop.pretrain``, which creates the process groups, was reached); for the plan cases,
that the user's file still exists. ``test_preflight_parity.py`` runs the doctor and training on
the same inputs and asserts the same verdict.
"""

from __future__ import annotations

import json
import socket

import pytest

from tests.timeouts import LAUNCH_S, run
from tests.training.preflight_harness import doctor, hold_lock_elsewhere, train

CPU = ["--preset", "cpu-tp2-dp2", "--mock-data"]


# 1. --nccl-communicator-config-path: empty, half a CTA range, and a quoted boolean
@pytest.mark.parametrize(
    "text, where, message",
    [
        (
            "",
            "1:1",
            "--nccl-communicator-config-path file is empty; megatron-core needs a mapping of process-group names",
        ),
        ("dp:\n  min_ctas: 2\n", "2:13", "group 'dp' sets min_ctas without max_ctas; give both"),
        (
            'tp:\n  is_high_priority_stream: "false"\n',
            "2:28",
            "tp.is_high_priority_stream must be a YAML bool; got 'false' (quoted: a string)",
        ),
        ("dp:\n  min_ctas: 1\n  max_ctas: '8'\n", "3:13", "dp.max_ctas must be a YAML int; got '8' (quoted: a string)"),
    ],
)
def test_1_communicator_config(tmp_path, monkeypatch, capsys, text, where, message):
    path = tmp_path / "nccl.yaml"
    path.write_text(text)
    t = train([*CPU, "--nccl-communicator-config-path", str(path)], monkeypatch, capsys)
    assert (t.code, t.started) == (2, False)
    assert len(t.errors) == 1 and t.errors[0].startswith(f"pretrain_gpt.py: error: {path}:{where}: {message}")
    d = doctor([*CPU, "--nccl-communicator-config-path", str(path)], monkeypatch, capsys)
    assert d.code == 1 and d.errors[0].startswith(f"{path}:{where}: {message}")


def test_1_a_whole_communicator_config_passes(tmp_path, monkeypatch, capsys):
    path = tmp_path / "nccl.yaml"
    path.write_text("dp:\n  min_ctas: 1\n  max_ctas: 8\n  is_high_priority_stream: true\ntp:\n  net_name: IB\n")
    t = train([*CPU, "--nccl-communicator-config-path", str(path)], monkeypatch, capsys)
    assert (t.code, t.errors, t.started) == (0, [], True)


# 2. --ddp-bucket-size -5 without --lagom
def test_2_negative_bucket_size(monkeypatch, capsys):
    t = train([*CPU, "--ddp-bucket-size", "-5"], monkeypatch, capsys)
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        "pretrain_gpt.py: error: --ddp-bucket-size -5 is not a positive integer; allowed: a number of parameters >= 1"
    ]


# 3. output folders that cannot be created or written
def test_3_plan_folder_cannot_be_created(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    plan = blocker / "sub" / "plan.json"
    t = train([*CPU, "--lagom", "--lagom-plan", str(plan)], monkeypatch, capsys)
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        f"pretrain_gpt.py: error: --lagom-plan {str(plan)!r}: {blocker} is a file, not a folder, "
        f"so {blocker / 'sub'} cannot be created"
    ]


def test_3_report_folder_not_writable(tmp_path, monkeypatch, capsys):
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.TemporaryFile

    def refuse(*args, dir=None, **kwargs):  # an immutable folder: root too gets EPERM there
        if dir is not None and str(dir) == str(ro):
            raise PermissionError(1, "Operation not permitted")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    report = ro / "report.md"
    t = train(
        [*CPU, "--lagom", "--lagom-plan", str(tmp_path / "p" / "plan.json"), "--lagom-report", str(report)],
        monkeypatch,
        capsys,
    )
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        f"pretrain_gpt.py: error: --lagom-report {str(report)!r}: {ro} cannot be written: Operation not permitted"
    ]


# 4. and 5. plans that `lagom plan validate` rejects, or that cannot be read: moved aside, never lost
def _plan_file(path, *, n_channels=1, env=None, truncate=False):
    from lagom_megatron.engine.knobs import CommConfig
    from lagom_megatron.engine.plan import Plan, PlanEntry

    entry = PlanEntry(
        config=CommConfig(n_channels=1),
        predicted_t_comm_us=10.0,
        predicted_t_region_us=12.0,
        group="dp",
        op="reduce_scatter",
        nbytes=4096,
        group_size=2,
    )
    plan = Plan(
        entries={"dp.grad_reduce_scatter[chunk0.bucket0]": entry},
        fingerprint={"cluster": "cpu-gloo"},
        backend="gloo",
        mechanism="gloo",
        env=env or {},
    )
    plan.save(path)
    data = json.loads(path.read_text())
    data["entries"]["dp.grad_reduce_scatter[chunk0.bucket0]"]["config"]["n_channels"] = n_channels
    text = json.dumps(data, indent=1)
    path.write_text(text[: len(text) // 2] if truncate else text)
    return path.read_bytes()


@pytest.mark.parametrize(
    "case, kwargs, tag, message",
    [
        (
            "n_channels 999",
            dict(n_channels=999),
            "invalid-",
            "entry 'dp.grad_reduce_scatter[chunk0.bucket0]': n_channels 999 is not allowed; allowed: 1..16 gloo worker threads",
        ),
        ("NCCL_ALGO foo", dict(env={"NCCL_ALGO": "foo"}), "invalid-", "env: NCCL_ALGO"),
        ("truncated", dict(truncate=True), "corrupt-", "invalid JSON at line"),
    ],
)
def test_4_5_bad_plan_is_moved_aside_not_reused_or_lost(tmp_path, capsys, case, kwargs, tag, message):
    from lagom_megatron.cli.main import main
    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.megatron.outputs.run_files import RunFiles

    path = tmp_path / "plan.json"
    original = _plan_file(path, **kwargs)
    assert main(["plan", "validate", str(path)]) == 2  # lagom plan validate rejects it too
    capsys.readouterr()
    files = RunFiles(plan_path=str(path))
    assert files.saved_plan({"cluster": "cpu-gloo"}, ClusterSpec.load("cpu-gloo")) is None
    (kept,) = tmp_path.glob(f"plan.{tag}*.json")
    assert kept.read_bytes() == original and not path.exists()  # the user's bytes, under a new name
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "cannot reuse plan" in ln]
    assert message in line and f"kept as {kept}" in line and line.endswith("searching a new one")


# 6. zero sizes: one line, no ZeroDivisionError, in the doctor (also for the SLURM dry run) and in training
@pytest.mark.parametrize(
    "preset, world, flag",
    [
        ("llama3-8b-h100x8", 8, "--tensor-model-parallel-size"),
        ("llama3-8b-h100x8", 8, "--pipeline-model-parallel-size"),
        ("llama3-8b-h100x8", 8, "--context-parallel-size"),
        ("llama3-8b-h100x8", 8, "--micro-batch-size"),
        ("llama3-8b-h100x8", 8, "--num-query-groups"),
        ("mixtral-8x7b-h100x32", 32, "--expert-model-parallel-size"),
        ("llama3-70b-h100x64", 64, "--num-layers-per-virtual-pipeline-stage"),
    ],
)
def test_6_zero_sizes(monkeypatch, capsys, preset, world, flag):
    argv = ["--preset", preset, "--mock-data", flag, "0"]
    line = f"{flag} must be a positive integer; got 0"
    for options in ((), ("--cluster", "h100-sxm-ib400")):
        d = doctor(argv, monkeypatch, capsys, world=world, options=options)
        assert d.code == 1 and d.errors == [line]
    t = train(argv, monkeypatch, capsys, world=world)
    assert (t.code, t.errors, t.started) == (2, [f"pretrain_gpt.py: error: {line}"], False)


# 7. an unknown LAGOM_CLUSTER names the variable
def test_7_unknown_lagom_cluster(monkeypatch, capsys):
    from lagom_megatron.config.presets import CONFIGS_DIR

    known = ", ".join(sorted(p.stem for p in (CONFIGS_DIR / "clusters").glob("*.yaml")))
    assert known.startswith("a100-ib100, ") and "cpu-gloo" in known
    line = (
        f"LAGOM_CLUSTER='h100' is not a known cluster or a cluster file; allowed: {known} or a path to a cluster YAML"
    )
    t = train(CPU, monkeypatch, capsys, env={"LAGOM_CLUSTER": "h100"})
    assert (t.code, t.errors, t.started) == (2, [f"pretrain_gpt.py: error: {line}"], False)
    d = doctor(CPU, monkeypatch, capsys, env={"LAGOM_CLUSTER": "h100"})
    assert (d.code, d.errors) == (2, [f"lagom doctor: error: {line}"])


# 8. query groups that divide TP are accepted, as megatron-core 0.16.1 does
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "32",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
    "--mock-data",
]


def test_8_query_groups_dividing_tp_are_accepted(monkeypatch, capsys):
    argv = [*SMALL, "--num-query-groups", "2", "--tensor-model-parallel-size", "8"]
    assert doctor(argv, monkeypatch, capsys, world=8).code == 0
    t = train(argv, monkeypatch, capsys, world=8)
    assert (t.code, t.errors, t.started) == (0, [], True)
    bad = train(
        [
            *SMALL,
            "--num-attention-heads",
            "24",
            "--hidden-size",
            "240",
            "--num-query-groups",
            "12",
            "--tensor-model-parallel-size",
            "8",
        ],
        monkeypatch,
        capsys,
        world=8,
    )
    assert (bad.code, bad.started) == (2, False)
    assert bad.errors == [
        "pretrain_gpt.py: error: --num-query-groups 12 is neither a multiple nor a divisor of "
        "--tensor-model-parallel-size 8"
    ]


# 9. --local-rank / --local_rank as launchers pass them
@pytest.mark.parametrize("words", [["--local-rank=0"], ["--local_rank", "0"], ["--local-rank", "1"]])
def test_9_local_rank_is_accepted(monkeypatch, capsys, words):
    t = train([*CPU, *words], monkeypatch, capsys)
    assert (t.code, t.errors, t.started) == (0, [], True)


# 10. two jobs, one plan path: the second is refused and told who holds it
def test_10_plan_in_use_by_another_job(tmp_path, monkeypatch, capsys):
    plan = tmp_path / "plan.json"
    other = hold_lock_elsewhere(plan)
    try:
        t = train([*CPU, "--lagom", "--lagom-plan", str(plan)], monkeypatch, capsys)
        assert (t.code, t.started) == (2, False)
        (line,) = t.errors
        assert line.startswith(
            f"pretrain_gpt.py: error: --lagom-plan {str(plan)!r} is in use by another run "
            f"(pid {other.pid} on host {socket.gethostname()}, job 4242, since "
        )
        assert line.endswith("wait for it, or give this run another --lagom-plan")
        d = doctor([*CPU, "--lagom", "--lagom-plan", str(plan)], monkeypatch, capsys)
        assert d.code == 1 and d.errors == [line.removeprefix("pretrain_gpt.py: error: ")]
    finally:
        other.kill()
        other.wait()
    from lagom_megatron.preflight.files import release_folder_lock

    t = train([*CPU, "--lagom", "--lagom-plan", str(plan)], monkeypatch, capsys)  # free again: this run takes it
    release_folder_lock(plan.parent)
    assert (t.code, t.started) == (0, True)


# 11. --overlap-moe-expert-parallel-comm without what megatron-core needs
MOE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--bf16",
    "--overlap-moe-expert-parallel-comm",
    "--eval-interval",
    "10",
]


@pytest.mark.parametrize(
    "extra, line",
    [
        (
            ["--num-experts", "8", "--expert-model-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"],
            "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1; got 1",
        ),
        (
            ["--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
            "--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall or flex; got 'allgather'",
        ),
        (
            [
                "--num-experts",
                "8",
                "--expert-model-parallel-size",
                "2",
                "--moe-token-dispatcher-type",
                "alltoall",
                "--moe-shared-expert-overlap",
            ],
            "--overlap-moe-expert-parallel-comm cannot be combined with --moe-shared-expert-overlap",
        ),
        (
            ["--moe-token-dispatcher-type", "alltoall"],
            "--overlap-moe-expert-parallel-comm is set but the model has no experts (--num-experts unset)",
        ),
    ],
)
def test_11_moe_overlap(monkeypatch, capsys, extra, line):
    d = doctor([*MOE, *extra], monkeypatch, capsys, options=("--megatron-lm",))
    assert d.code == 1 and line in d.errors
    ok = doctor(
        [*MOE, "--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
        monkeypatch,
        capsys,
        options=("--megatron-lm",),
    )
    assert ok.code == 0
    t = train([*CPU, "--overlap-moe-expert-parallel-comm"], monkeypatch, capsys)  # our script: the same rule
    assert (t.code, t.started) == (2, False)
    assert t.errors[0].startswith(
        "pretrain_gpt.py: error: --overlap-moe-expert-parallel-comm is set but the model "
        "has no experts (--num-experts unset)"
    )


# 12. uneven pipeline splits, as megatron-core computes them
LAYERS = [
    "--num-layers",
    "30",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "1",
    "--eval-interval",
    "10",
]


def test_12_uneven_pipeline(monkeypatch, capsys):
    bad = doctor(
        [*LAYERS, "--pipeline-model-parallel-size", "1", "--decoder-last-pipeline-num-layers", "1"],
        monkeypatch,
        capsys,
        world=1,
        options=("--megatron-lm",),
    )
    assert bad.code == 1 and bad.errors == [
        "--num-layers 30 with --pipeline-model-parallel-size 1, first stage None, last stage 1 leaves 29 layers "
        "for 0 middle stages"
    ]
    good = doctor(
        [
            *LAYERS,
            "--pipeline-model-parallel-size",
            "4",
            "--decoder-first-pipeline-num-layers",
            "6",
            "--decoder-last-pipeline-num-layers",
            "8",
        ],
        monkeypatch,
        capsys,
        world=4,
        options=("--megatron-lm",),
    )
    assert (good.code, good.errors) == (0, [])
    odd = doctor(
        [
            *LAYERS,
            "--pipeline-model-parallel-size",
            "4",
            "--decoder-first-pipeline-num-layers",
            "5",
            "--decoder-last-pipeline-num-layers",
            "8",
        ],
        monkeypatch,
        capsys,
        world=4,
        options=("--megatron-lm",),
    )
    assert odd.errors == [
        "the 17 middle layers (--num-layers 30 less first 5 and last 8) are not divisible by the "
        "2 middle pipeline stages"
    ]


# 13. MASTER_PORT already bound on this machine
def test_13_master_port_in_use(monkeypatch, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        line = f"MASTER_PORT={port} is already in use on this machine (MASTER_ADDR=127.0.0.1); allowed: a free port"
        t = train(CPU, monkeypatch, capsys, env=env)
        assert (t.code, t.errors, t.started) == (2, [f"pretrain_gpt.py: error: {line}"], False)
        d = doctor(CPU, monkeypatch, capsys, env=env)
        assert d.code == 1 and d.errors == [line]
    t = train(CPU, monkeypatch, capsys, env={"MASTER_PORT": "http"})
    assert t.errors == ["pretrain_gpt.py: error: MASTER_PORT='http' is not a port number; allowed: 1..65535"]


# 14. a process group of one rank is never a site
def test_14_group_of_one_rank_is_not_a_site():
    from lagom_megatron.megatron.hooks.sites import GroupInfo, GroupNames, SiteRegistry

    registry = SiteRegistry(GroupNames(local_world_size=2))
    registry.record(
        "dp.grad_all_reduce[chunk0.bucket0]",
        op="all_reduce",
        nbytes=4096,
        dtype="float32",
        group=GroupInfo(name="dp", ranks=(0,)),
    )
    registry.record(
        "tp.sp_all_gather[0]", op="all_gather", nbytes=4096, dtype="float32", group=GroupInfo(name="tp", ranks=(0, 1))
    )
    assert [s.site_id for s in registry.sites()] == ["tp.sp_all_gather[0]"]


# 15. --overlap-p2p-communication is refused, not dropped: Megatron-LM has no such flag (overlap is
# its default, on in the interleaved schedule, turned off without one; --no-overlap-p2p-communication)
def test_15_p2p_overlap_without_virtual_pipeline(monkeypatch, capsys):
    argv = ["--preset", "cpu-pp2-dp2", "--mock-data", "--overlap-p2p-communication"]
    line = (
        "--overlap-p2p-communication is not accepted: Megatron-LM has no such flag: pipeline send/recv overlap "
        "is on by default (interleaved schedule); --no-overlap-p2p-communication turns it off"
    )
    t = train(argv, monkeypatch, capsys)
    assert (t.code, t.errors, t.started) == (2, [f"pretrain_gpt.py: error: {line}"], False)
    d = doctor(argv, monkeypatch, capsys)
    assert d.code == 1 and d.errors == [line]


def test_torchrun_refused_input_starts_no_rank():
    """End to end, under torchrun: a refused input prints its line once and no rank reaches the
    process group (the loop's first line, ``pretrain_gpt: preset=...``, never appears)."""
    import os
    import sys

    from tests.training.preflight_harness import CLEAN, ROOT

    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    proc = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "scripts/pretrain_gpt.py",
            *CPU,
            "--ddp-bucket-size",
            "-5",
        ],
        cwd=ROOT,
        env=env,
        text=True,
        timeout=LAUNCH_S,
    )
    out = proc.stdout + proc.stderr
    line = (
        "pretrain_gpt.py: error: --ddp-bucket-size -5 is not a positive integer; allowed: a number of parameters >= 1"
    )
    assert proc.returncode != 0
    # printed by rank 0, then repeated after torchrun's ChildFailedError summary: the last line the user sees
    assert [text for text in out.splitlines() if "pretrain_gpt.py: error:" in text] == [line, line]
    assert [text for text in proc.stderr.splitlines() if text.strip()][-1] == line
    assert "pretrain_gpt: preset=" not in out and "iteration" not in out


def test_only_rank_0_probes_the_plan_lock(tmp_path):
    """The other ranks of the job that holds the lock must not see it as another run's."""
    from lagom_megatron.preflight.check import resolve
    from lagom_megatron.preflight.files import rule_plan_lock

    plan = tmp_path / "plan.json"
    other = hold_lock_elsewhere(plan)
    try:
        args = {"lagom": True, "lagom_plan": str(plan)}
        assert [f.rule for f in rule_plan_lock(resolve(args, {"RANK": "0"}, "cpu-gloo", local=True))] == ["plan-lock"]
        assert rule_plan_lock(resolve(args, {"RANK": "1"}, "cpu-gloo", local=True)) == []
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--adam-beta2", "1.0"], "--adam-beta2 1.0 is out of range; allowed: [0, 1)"),
        (["--adam-eps=-1e-8"], "--adam-eps -1e-08 is out of range; allowed: >= 0"),
        (["--weight-decay", "-0.1"], "--weight-decay -0.1 is out of range; allowed: >= 0"),
        (["--clip-grad", "-1"], "--clip-grad -1.0 is out of range; allowed: >= 0"),
        (["--seed", "-1"], "--seed -1 is out of range; allowed: 0..4294967295"),
        (["--split", "0,1,0"], "--split '0,1,0' is out of range; allowed: up to three weights >= 0"),
        (["--split", "90,5,4,1"], "--split '90,5,4,1' is out of range"),
        (
            ["--split", "90,abc5,5"],
            "--split '90,abc5,5' is out of range; allowed: up to three weights >= 0 separated by commas",
        ),
        (["--split", "90;5;5"], "--split '90;5;5' is out of range"),
        (["--ffn-hidden-size", "0"], "--ffn-hidden-size 0 is out of range; allowed: an integer >= 1"),
        (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0 is out of range"),
    ],
)
def test_value_domains_checked_after_process_groups_are_refused_before(monkeypatch, capsys, extra, line):
    """Values torch's Adam, numpy's seed or megatron-core's split parser would refuse mid-setup."""
    t = train([*CPU, *extra], monkeypatch, capsys)
    assert (t.code, t.started) == (2, False)
    assert len(t.errors) == 1 and t.errors[0].startswith(f"pretrain_gpt.py: error: {line}")
    d = doctor([*CPU, *extra], monkeypatch, capsys)
    assert d.code == 1 and d.errors[0].startswith(line)


def test_5_a_plan_that_cannot_be_moved_aside_is_never_overwritten(tmp_path, capsys, monkeypatch):
    import os

    from lagom_megatron.engine.cluster import ClusterSpec
    from lagom_megatron.engine.plan import Plan
    from lagom_megatron.megatron.outputs.run_files import RunFiles

    path = tmp_path / "plan.json"
    original = _plan_file(path, truncate=True)

    def refuse(src, dst, **kwargs):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(os, "link", refuse)  # run_files.rename_no_replace moves by link + unlink
    files = RunFiles(plan_path=str(path))
    assert files.saved_plan({"cluster": "cpu-gloo"}, ClusterSpec.load("cpu-gloo")) is None
    files.save_plan(Plan(entries={}, backend="gloo", mechanism="gloo"))
    assert path.read_bytes() == original
    out = capsys.readouterr().out
    assert "left in place; searching a new one" in out
    assert f"lagom: WARNING: plan not saved: {path} could not be reused nor moved aside" in out
