"""``lagom doctor`` and ``pretrain_gpt.py``'s pre-flight reach the same verdict on the same input.

Inputs: the examples of the pre-flight issue that are command lines of our ``pretrain_gpt.py``,
the Megatron-LM parity flags (``test_preflight_flags.FLAG_CASES``), and every preset under ``configs/presets/`` (with ``--mock-data``, at the preset's world size),
each checked on this machine (the doctor without ``--cluster`` chooses the cluster as training
does: ``preflight.cluster``). The verdict is "refused" (non-zero exit) or "may start"; a refused training run never
reaches ``training.loop.pretrain``.
"""

from __future__ import annotations

import socket

import pytest

from lagom_megatron.config.presets import CONFIGS_DIR, load_preset
from lagom_megatron.preflight.cluster import choose_cluster, mismatch, this_machine
from tests.training.preflight_harness import doctor, hold_lock_elsewhere, train
from tests.training.test_preflight_flags import FLAG_CASES

CPU = ["--preset", "cpu-tp2-dp2", "--mock-data"]
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


def _file(text):
    def make(tmp_path):
        path = tmp_path / "nccl.yaml"
        path.write_text(text)
        return str(path)

    return make


# (id, argv with {tmp} / callables filled per test, world size, env, refused?)
EXAMPLES = [
    ("1-empty-comm-config", [*CPU, "--nccl-communicator-config-path", _file("")], 4, {}, True),
    ("1-half-cta-range", [*CPU, "--nccl-communicator-config-path", _file("dp:\n  min_ctas: 2\n")], 4, {}, True),
    (
        "1-whole-cta-range",
        [*CPU, "--nccl-communicator-config-path", _file("dp:\n  min_ctas: 1\n  max_ctas: 4\n")],
        4,
        {},
        False,
    ),
    ("2-negative-bucket", [*CPU, "--ddp-bucket-size", "-5"], 4, {}, True),
    ("3-plan-under-a-file", [*CPU, "--lagom", "--lagom-plan", lambda t: str(t / "f" / "x" / "plan.json")], 4, {}, True),
    (
        "3-plan-folder-creatable",
        [*CPU, "--lagom", "--lagom-plan", lambda t: str(t / "new" / "plan.json")],
        4,
        {},
        False,
    ),
    ("6-tp-zero", ["--preset", "llama3-8b-h100x8", "--mock-data", "--tensor-model-parallel-size", "0"], 8, {}, True),
    ("6-micro-batch-zero", [*CPU, "--micro-batch-size", "0"], 4, {}, True),
    ("6-query-groups-zero", [*CPU, "--num-query-groups", "0"], 4, {}, True),
    ("7-unknown-lagom-cluster", CPU, 4, {"LAGOM_CLUSTER": "h100"}, True),
    ("8-groups-divide-tp", [*SMALL, "--num-query-groups", "2", "--tensor-model-parallel-size", "8"], 8, {}, False),
    ("9-local-rank", [*CPU, "--local-rank=0"], 4, {}, False),
    ("9-local_rank", [*CPU, "--local_rank", "0"], 4, {}, False),
    ("10-plan-in-use", [*CPU, "--lagom", "--lagom-plan", "LOCKED"], 4, {}, True),
    ("11-moe-overlap-flag", [*CPU, "--overlap-moe-expert-parallel-comm"], 4, {}, True),
    ("12-uneven-pipeline-flag", [*CPU, "--decoder-last-pipeline-num-layers", "1"], 4, {}, True),
    ("13-master-port-busy", CPU, 4, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "BUSY"}, True),
    ("13-master-port-not-a-number", CPU, 4, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, True),
    (
        "15-p2p-overlap-without-vpp",
        ["--preset", "cpu-pp2-dp2", "--mock-data", "--overlap-p2p-communication"],
        4,
        {},
        True,
    ),
    ("world-not-divisible", [*CPU, "--tensor-model-parallel-size", "3"], 4, {}, True),
    ("valid-cpu-line", CPU, 4, {}, False),
]
EXAMPLES += [(f"flags-{name}", [*CPU, *extra], 4, env, line is not None) for name, extra, env, line in FLAG_CASES]
"""The Megatron-LM parity flags (``test_preflight_flags.py`` checks their one line)."""

PRESETS = sorted(p.stem for p in (CONFIGS_DIR / "presets").glob("*.yaml"))


def _same_verdict(argv, world, env, monkeypatch, capsys):
    d = doctor(argv, monkeypatch, capsys, world=world, env=env)
    t = train(argv, monkeypatch, capsys, world=world, env=env)
    from lagom_megatron.preflight.files import _HELD, release_folder_lock

    for held in list(_HELD):
        release_folder_lock(held)
    assert d.refused == t.refused, (d, t)
    assert t.started == (not t.refused)
    if t.refused:
        assert len(t.errors) == 1  # one line, printed once
    return t


@pytest.mark.parametrize("name, argv, world, env, refused", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_doctor_and_training_agree_on_the_examples(tmp_path, monkeypatch, capsys, name, argv, world, env, refused):
    (tmp_path / "f").write_text("a file where a folder is needed")
    argv = [a(tmp_path) if callable(a) else a for a in argv]
    other = busy = None
    if "LOCKED" in argv:
        argv[argv.index("LOCKED")] = str(tmp_path / "plan.json")
        other = hold_lock_elsewhere(tmp_path / "plan.json")
    if env.get("MASTER_PORT") == "BUSY":
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = {**env, "MASTER_PORT": str(busy.getsockname()[1])}
    try:
        t = _same_verdict(argv, world, env, monkeypatch, capsys)
        assert t.refused == refused, t
    finally:
        if other is not None:
            other.kill()
            other.wait()
        if busy is not None:
            busy.close()


@pytest.mark.parametrize("preset", PRESETS)
def test_doctor_and_training_agree_on_every_preset(tmp_path, monkeypatch, capsys, preset):
    """Both check the preset's own cluster. Where this machine is not one of its nodes (a GPU preset
    here, without CUDA), training refuses with the one line naming both, and the doctor checks the
    job for that cluster instead of this machine."""
    # the presets' --lagom-plan is relative (runs/<preset>/plan.json) and a run that may start takes
    # its lock there: run from tmp_path, so the suite leaves no runs/<preset>/ in the source tree
    monkeypatch.chdir(tmp_path)
    world = load_preset(preset).world_size
    away = mismatch(choose_cluster(preset, {}), this_machine())
    if away is not None:
        d = doctor(["--preset", preset, "--mock-data"], monkeypatch, capsys, world=world)
        t = train(["--preset", preset, "--mock-data"], monkeypatch, capsys, world=world)
        assert f"cluster {load_preset(preset).cluster!r}" in away
        assert (t.code, t.started, len(t.errors)) == (2, False, 1)
        if t.errors != [f"pretrain_gpt.py: error: {away}"]:  # a line refused before the machine is looked at
            assert d.errors == [t.errors[0].removeprefix("pretrain_gpt.py: error: ")], (d, t)
        return
    t = _same_verdict(["--preset", preset, "--mock-data"], world, {}, monkeypatch, capsys)
    plan = load_preset(preset).lagom.lagom_plan
    if t.started and plan:
        assert (tmp_path / plan).parent.is_dir()  # the lock was taken here, not in the source tree


def test_cpu_presets_may_start():
    """The CPU presets are the demo: the shared pre-flight must let them start here."""
    from lagom_megatron.preflight.check import check_run, detect_cluster
    from lagom_megatron.training.argument_checks import check_installed, validate_args
    from lagom_megatron.training.arguments import parse_args

    for name in ("cpu-tp2-dp2", "cpu-pp2-dp2"):
        ns = parse_args(["--preset", name, "--mock-data"], exit_on_error=False)
        found = check_run(
            ns,
            {},
            detect_cluster(name, {}),
            world_size=4,
            local=True,
            validate=validate_args,
            installed=check_installed,
        )
        assert [f for f in found if f.level == "error"] == []
