"""Which cluster ``lagom doctor`` and ``pretrain_gpt.py`` check (``preflight.cluster``): one rule,
a first line that names the cluster and why, and a training run refused on a machine that is not
one of the cluster's nodes."""

from __future__ import annotations

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.config.presets import CONFIGS_DIR, load_preset
from lagom_megatron.preflight.cluster import Machine, choose_cluster, mismatch, this_machine
from tests.training.preflight_harness import _env, train

PRESETS = sorted(p.stem for p in (CONFIGS_DIR / "presets").glob("*.yaml"))
GPU_PRESETS = [p for p in PRESETS if load_preset(p).cluster != "cpu-gloo"]
NO_CUDA = Machine(cuda=False)
HOPPER = Machine(cuda=True, sm_arch=90, nccl_version="2.27.5")
AMPERE = Machine(cuda=True, sm_arch=80, nccl_version="2.21.5")
NCCL_DEFECTS = {  # exported variable -> what the doctor's error says of it
    "NCCL_ALGO": ("NVLS", "NCCL_ALGO='NVLS' takes Ring away from every collective"),
    "NCCL_NTHREADS": ("480", "NCCL_NTHREADS=480 is not one of 64, 128, 256, 512"),
    "NCCL_PROTO": ("LL,LL128,Simple", "NCCL_PROTO='LL,LL128,Simple' force-enables LL128"),
}


def test_the_rule_in_order():
    assert GPU_PRESETS and "llama3-8b-h100x8" in GPU_PRESETS
    env = {"LAGOM_CLUSTER": "a100-ib100"}
    assert choose_cluster("llama3-8b-h100x8", env, "h200-sxm", machine=NO_CUDA).name == "h200-sxm"  # the flag
    t = choose_cluster("llama3-8b-h100x8", env, machine=NO_CUDA)
    assert (t.name, t.source, t.chosen_by) == ("a100-ib100", "env", "LAGOM_CLUSTER")
    t = choose_cluster("llama3-8b-h100x8", {}, machine=NO_CUDA)
    assert (t.name, t.source, t.chosen_by) == ("h100-sxm-ib400", "preset", "preset 'llama3-8b-h100x8'")
    t = choose_cluster(None, {}, machine=NO_CUDA)
    assert (t.name, t.source) == ("cpu-gloo", "machine")
    t = choose_cluster(None, {"LOCAL_WORLD_SIZE": "4"}, machine=HOPPER)
    assert t.cluster == {"gpus_per_node": 4, "sm_arch": 90, "backend": "nccl", "nccl_version": "2.27.5"}
    with pytest.raises(
        ValueError,
        match=r"^--lagom-cluster='h100' is not a known cluster or a cluster file; "
        r"allowed: a100-ib100, .*cpu-gloo",
    ):
        choose_cluster(None, {}, "h100", "--lagom-cluster", machine=NO_CUDA)


def test_a_machine_that_is_not_a_node_of_the_cluster():
    preset = choose_cluster("llama3-8b-h100x8", {}, machine=NO_CUDA)
    assert mismatch(preset, NO_CUDA) == (
        "preset 'llama3-8b-h100x8' is for cluster 'h100-sxm-ib400' (NCCL 2.30.7, sm_90 GPUs) but this machine has "
        "no CUDA GPU (cpu-gloo); run it on that cluster (lagom doctor checks it from here), or to run it on CPU "
        "anyway add --lagom-cluster cpu-gloo"
    )
    assert mismatch(preset, HOPPER) is None
    assert mismatch(preset, AMPERE) == (
        "preset 'llama3-8b-h100x8' is for cluster 'h100-sxm-ib400' (NCCL 2.30.7, sm_90 GPUs) but this machine has "
        "a CUDA GPU of compute capability sm_80 (NCCL 2.21.5); name a cluster of this GPU with --lagom-cluster "
        "(a100-ib100 or a cluster YAML)"
    )
    env = choose_cluster("cpu-tp2-dp2", {"LAGOM_CLUSTER": "a100-ib100"}, machine=NO_CUDA)
    assert mismatch(env, NO_CUDA).startswith("LAGOM_CLUSTER chose cluster 'a100-ib100' (NCCL 2.21.5, sm_80 GPUs)")
    for machine in (NO_CUDA, HOPPER):  # a gloo cluster runs anywhere
        assert mismatch(choose_cluster("cpu-tp2-dp2", {}, machine=machine), machine) is None


def _doctor(capsys, monkeypatch, argv, env=None):
    _env(monkeypatch, env)
    capsys.readouterr()
    code = main(["doctor", *argv])
    return code, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_doctor_checks_a_gpu_preset_on_its_own_cluster(preset, capsys, monkeypatch):
    cluster = load_preset(preset).cluster
    code, lines = _doctor(capsys, monkeypatch, ["--preset", preset])
    assert lines[0].startswith(f"lagom doctor: checking cluster {cluster!r} (NCCL ")
    assert f": the cluster of preset {preset!r} (--cluster or $LAGOM_CLUSTER checks another)" in lines[0]
    if not this_machine().cuda:
        assert lines[0].endswith(
            "; this machine (no CUDA GPU) is not one of its nodes, so the command line, layout "
            "and environment are checked for its nodes but not this machine's files, port and "
            "libraries (training checks those on each node before it starts)"
        )
    assert "needs CUDA" not in "\n".join(lines)


@pytest.mark.parametrize("variable", list(NCCL_DEFECTS))
@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_a_bad_nccl_variable_fails_the_doctor_of_every_gpu_preset(preset, variable, capsys, monkeypatch):
    value, what = NCCL_DEFECTS[variable]
    code, lines = _doctor(capsys, monkeypatch, ["--preset", preset], {variable: value})
    errors = [line for line in lines if line.startswith("error: [nccl-env]")]
    assert code == 1 and any(what in line for line in errors), lines


def test_the_nccl_variables_are_checked_when_the_line_is_refused(capsys, monkeypatch):
    """A line the parser refuses still gets the environment's findings: one run names both."""
    code, lines = _doctor(
        capsys, monkeypatch, ["--preset", "llama3-8b-h100x8", "--", "--no-such-flag"], {"NCCL_NTHREADS": "480"}
    )
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 1 and [e.split("]")[0] for e in errors] == ["error: [command-line", "error: [nccl-env"], lines


def test_first_line_names_what_chose_the_cluster(capsys, monkeypatch):
    code, lines = _doctor(capsys, monkeypatch, ["--cluster", "a100-ib100", "--preset", "llama3-8b-h100x8"])
    assert lines[0].startswith(
        "lagom doctor: checking cluster 'a100-ib100' (NCCL 2.21.5, sm_80 GPUs): named by --cluster"
    )
    code, lines = _doctor(capsys, monkeypatch, ["--preset", "llama3-8b-h100x8"], {"LAGOM_CLUSTER": "h200-sxm"})
    assert lines[0].startswith(
        "lagom doctor: checking cluster 'h200-sxm' (NCCL 2.30.7, sm_90 GPUs): named by "
        "$LAGOM_CLUSTER (--cluster checks another)"
    )
    code, lines = _doctor(capsys, monkeypatch, ["--preset", "llama3-8b-h100x8", "--", "--lagom-cluster", "a100-ib100"])
    assert lines[0].startswith(
        "lagom doctor: checking cluster 'a100-ib100' (NCCL 2.21.5, sm_80 GPUs): named by --lagom-cluster"
    )
    if not this_machine().cuda:
        code, lines = _doctor(capsys, monkeypatch, ["--", "--mock-data", "--num-layers", "2"])
        assert lines[0] == (
            "lagom doctor: checking cluster 'cpu-gloo' (gloo, CPU): this machine (--preset, --cluster "
            "or $LAGOM_CLUSTER checks another)"
        )


@pytest.mark.skipif(this_machine().cuda, reason="a CPU-only check: this machine has a CUDA GPU")
def test_training_a_gpu_preset_on_cpu_is_refused_unless_asked_for(monkeypatch, capsys):
    argv = ["--preset", "llama3-8b-h100x8", "--mock-data"]
    t = train(argv, monkeypatch, capsys, world=8)
    assert (t.code, t.started) == (2, False)
    assert t.errors == ["pretrain_gpt.py: error: " + mismatch(choose_cluster("llama3-8b-h100x8", {}), NO_CUDA)]
    t = train(argv, monkeypatch, capsys, world=8, env={"LAGOM_CLUSTER": "h100-sxm-ib400"})
    assert t.errors[0].startswith("pretrain_gpt.py: error: LAGOM_CLUSTER chose cluster 'h100-sxm-ib400'")
    # --lagom-cluster cpu-gloo: checked as a CPU run; what stops it now is the preset itself
    t = train([*argv, "--lagom-cluster", "cpu-gloo"], monkeypatch, capsys, world=8)
    assert t.errors and "cluster" not in t.errors[0] and "--context-parallel-size 2" in t.errors[0]
    t = train(["--preset", "cpu-tp2-dp2", "--mock-data", "--lagom-cluster", "cpu-gloo"], monkeypatch, capsys)
    assert (t.code, t.started) == (0, True)


def test_training_tells_lagom_the_cluster_it_checked(monkeypatch, capsys):
    import lagom_megatron.training.loop as loop

    seen = []
    monkeypatch.setattr(loop, "pretrain", lambda args: seen.append(args.lagom_cluster))
    from tests.training.preflight_harness import SCRIPT

    _env(monkeypatch, {"RANK": "0", "WORLD_SIZE": "4"})
    assert SCRIPT.main(["--preset", "cpu-tp2-dp2", "--mock-data"]) == 0
    assert seen == ["cpu-gloo"]


@pytest.mark.parametrize(
    "variable, value, stands_for",
    [
        ("WORLD_SIZE", "abc", "--world-size"),
        ("WORLD_SIZE", "0", "--world-size"),
        ("LOCAL_WORLD_SIZE", "-2", "--gpus-per-node"),
    ],
)
def test_the_doctor_reads_its_default_counts_strictly(variable, value, stands_for, capsys, monkeypatch):
    """A WORLD_SIZE of abc or 0 was ignored without a word (rc 0)."""
    _env(monkeypatch, {variable: value})
    monkeypatch.setenv(variable, value)
    capsys.readouterr()
    assert main(["doctor", "--", "--mock-data", "--num-layers", "2"]) == 2
    hi = 1048576 if variable == "WORLD_SIZE" else 1024
    assert capsys.readouterr().err.strip() == (
        f"lagom doctor: error: {variable}={value!r} is not an integer in 1..{hi} "
        f"(it stands for {stands_for}): set it to a count, or unset it"
    )


def test_training_reads_world_size_strictly(monkeypatch, capsys):
    t = train(["--preset", "cpu-tp2-dp2", "--mock-data"], monkeypatch, capsys, env={"WORLD_SIZE": "abc"})
    assert (t.code, t.started) == (2, False)
    assert t.errors == [
        "pretrain_gpt.py: error: WORLD_SIZE='abc' is not an integer in 1..1048576 (it stands for the "
        "job's world size): set it to a count, or unset it"
    ]


def test_a_lagom_configs_without_presets_is_named(tmp_path):
    """It said ``unknown preset ...; available: none``, without naming the variable that chose the folder."""
    import subprocess
    import sys

    from tests.timeouts import COMMAND_S

    env = {k: v for k, v in __import__("os").environ.items() if k != "LAGOM_CLUSTER"}
    env["LAGOM_CONFIGS"] = str(tmp_path / "nowhere")
    proc = subprocess.run(
        [sys.executable, "-m", "lagom_megatron", "doctor", "--preset", "llama3-8b-h100x8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"lagom doctor: error: unknown preset 'llama3-8b-h100x8': {tmp_path}/nowhere/presets "
        "(from LAGOM_CONFIGS) holds no presets; set LAGOM_CONFIGS to a folder with clusters/, "
        "models/ and presets/, or unset it"
    )


def test_a_python_without_torch_sees_no_cuda_gpu(monkeypatch):
    """A dry run from a login node falls back to its ``python3``, which may lack torch: the doctor's
    machine check must then say "no CUDA GPU", not raise ImportError."""
    import sys

    from lagom_megatron.preflight import cluster

    monkeypatch.setattr(cluster, "cuda_certainly_absent", lambda: False)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert this_machine() == Machine(cuda=False)
    assert this_machine().describe() == "no CUDA GPU"
