"""A preset given as a file path works wherever a name does: ``lagom doctor``, training and the SLURM dry run
resolve the cluster from the loaded preset, never by reloading the file's stem as a shipped name."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from lagom_megatron.cli.main import main
from lagom_megatron.config.presets import CONFIGS_DIR, available, load_preset
from lagom_megatron.preflight.cluster import Machine, choose_cluster, this_machine
from tests.launch.test_slurm_scripts import PER_GPU, PER_NODE, fake, plugin_dir  # noqa: F401 (fixtures)
from tests.training.preflight_harness import _env, train

SHIPPED = CONFIGS_DIR / "presets"


def _copy(name: str, folder, stem: str = "mine"):
    path = folder / f"{stem}.yaml"
    shutil.copyfile(SHIPPED / f"{name}.yaml", path)
    return path


def _doctor(argv, capsys, monkeypatch):
    _env(monkeypatch, {})
    capsys.readouterr()
    code = main(["doctor", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", available("presets"))
def test_the_doctor_on_a_copy_of_each_shipped_preset_exits_as_the_name(name, tmp_path, capsys, monkeypatch):
    """It stopped with ``unknown preset 'mine'`` (the stem reloaded as a name) unless --cluster was given."""
    by_name = _doctor(["--preset", name], capsys, monkeypatch)
    copy = _copy(name, tmp_path)
    by_file = _doctor(["--preset", str(copy)], capsys, monkeypatch)
    assert by_file[0] == by_name[0]
    assert "unknown preset" not in by_file[2]
    assert by_file[1] == by_name[1].replace(f"preset {name}:", "preset mine:").replace(
        f"preset {name!r}", "preset 'mine'"
    )
    assert copy.read_text() == (SHIPPED / f"{name}.yaml").read_text()  # the user's file is only read


def test_a_file_named_like_a_shipped_preset_keeps_its_own_cluster(tmp_path, capsys, monkeypatch):
    """The file's stem names a shipped preset of another cluster: the file's cluster is the one checked."""
    path = tmp_path / "llama3-8b-h100x8.yaml"
    path.write_text(
        (SHIPPED / "llama3-8b-h100x8.yaml").read_text().replace("cluster: h100-sxm-ib400", "cluster: h200-sxm")
    )
    assert choose_cluster(load_preset(path), {}, machine=Machine(cuda=False)).name == "h200-sxm"
    assert choose_cluster(str(path), {}, machine=Machine(cuda=False)).name == "h200-sxm"
    code, out, _ = _doctor(["--preset", str(path)], capsys, monkeypatch)
    assert out.splitlines()[0].startswith(
        "lagom doctor: checking cluster 'h200-sxm' (NCCL 2.30.7, sm_90 GPUs): the cluster of preset 'llama3-8b-h100x8'"
    )
    assert code == 0


@pytest.mark.skipif(this_machine().cuda, reason="a CPU-only check: this machine has a CUDA GPU")
def test_training_with_a_preset_file(tmp_path, monkeypatch, capsys):
    """A GPU preset's copy is refused as the name is (the machine, not ``unknown preset``); a CPU preset's trains."""
    gpu = _copy("llama3-8b-h100x8", tmp_path)
    by_name = train(["--preset", "llama3-8b-h100x8", "--mock-data"], monkeypatch, capsys, world=8)
    by_file = train(["--preset", str(gpu), "--mock-data"], monkeypatch, capsys, world=8)
    assert (by_file.code, by_file.started) == (by_name.code, by_name.started) == (2, False)
    assert by_file.errors == [e.replace("preset 'llama3-8b-h100x8'", "preset 'mine'") for e in by_name.errors]
    cpu = _copy("cpu-tp2-dp2", tmp_path, "cpu-copy")
    t = train(["--preset", str(cpu), "--mock-data"], monkeypatch, capsys, world=4)
    assert (t.code, t.started, t.errors) == (0, True, [])


@pytest.mark.parametrize("script, name", [(PER_NODE, "llama3-8b-h100x8"), (PER_GPU, "llama2-7b-a100x32-ib100")])
def test_the_slurm_dry_run_with_a_preset_file(fake, script, name):  # noqa: F811 (the fixture)
    """Every rank's line names the file (its absolute path: the ranks need not share the submit folder's cwd)."""
    by_name = fake(script, "--dry-run", "--preset", name, slurm=False)
    copy = _copy(name, fake.tmp)
    by_file = fake(script, "--dry-run", "--preset", "mine.yaml", slurm=False)
    assert by_file.returncode == by_name.returncode == 0, by_file.stderr
    assert "unknown preset" not in by_file.stderr
    assert "lagom doctor: preset mine: 0 error(s), 0 warning(s)" in by_file.stderr.splitlines()
    srun = by_file.stdout.splitlines()[-1]
    assert srun.endswith(f"scripts/pretrain_gpt.py --preset {copy.resolve()}")
    assert srun.rsplit(" --preset ", 1)[0] == by_name.stdout.splitlines()[-1].rsplit(" --preset ", 1)[0]
    assert not (fake.log / "srun.args").exists()
    assert subprocess.run(["cmp", str(copy), str(SHIPPED / f"{name}.yaml")]).returncode == 0
