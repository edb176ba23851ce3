"""Which Python the SLURM scripts run: an explicit ``LAGOM_PYTHON`` is used or refused, never swapped for another;
without it, the tree's ``.venv``, else ``python3`` with a warning."""

import shlex

import pytest

from tests.launch.test_slurm_scripts import PER_GPU, PER_NODE, PY, ROOT, fake, plugin_dir  # noqa: F401 (fixtures)


@pytest.mark.parametrize("script, preset", [(PER_NODE, "gpt3-13b-h100x64"), (PER_GPU, "llama2-7b-a100x32-ib100")])
@pytest.mark.parametrize("python", ["/nonexistent/python", "folder", "not-executable"])
def test_a_lagom_python_that_cannot_run_is_refused_not_swapped(fake, script, preset, python):  # noqa: F811
    """Both scripts replaced it with the system ``python3`` without a word: the dry run passed and every srun line
    named another Python."""
    if python == "folder":
        python = str(fake.tmp)
    elif python == "not-executable":
        (fake.tmp / "python").write_text("#!/bin/sh\n")
        python = str(fake.tmp / "python")
    before = sorted(p.name for p in fake.tmp.iterdir())
    proc = fake(script, "--dry-run", "--preset", preset, slurm=False, extra_env={"LAGOM_PYTHON": python})
    tag = script.name.removesuffix(".sbatch")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"{tag}: LAGOM_PYTHON={python} is not an executable file or a command on PATH; set it to the Python of "
        f"lagom's environment (e.g. {ROOT}/.venv/bin/python), or unset it"
    )
    assert proc.stdout == "" and sorted(p.name for p in fake.tmp.iterdir()) == before


def test_without_lagom_python_or_a_venv_the_fallback_is_named(fake):  # noqa: F811
    """No LAGOM_PYTHON and no ``.venv`` in LAGOM_ROOT: python3 from PATH, said once on stderr, and every line names it."""
    tree = fake.tmp / "tree"
    tree.mkdir()
    for part in ("lagom_megatron", "scripts", "configs"):
        (tree / part).symlink_to(ROOT / part)
    python3 = fake.tmp / "bin" / "python3"
    python3.write_text(f'#!/bin/sh\nexec {shlex.quote(PY)} "$@"\n')
    python3.chmod(0o755)
    proc = fake(
        PER_NODE,
        "--dry-run",
        "--preset",
        "gpt3-13b-h100x64",
        slurm=False,
        extra_env={"LAGOM_PYTHON": "", "LAGOM_ROOT": str(tree)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        f"lagom_pretrain: warning: {tree}/.venv/bin/python does not exist; using {python3} (set LAGOM_PYTHON to choose)"
    )
    assert f" {python3} -m torch.distributed.run " in proc.stdout.splitlines()[-1]
