import subprocess
import sys

import pytest

import lagom_megatron
from lagom_megatron.cli.main import main
from tests.timeouts import COMMAND_S


def test_version_flag(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.strip() == f"lagom-megatron {lagom_megatron.__version__}"


def test_help_runs_without_torch():
    code = "import sys; sys.modules['torch'] = None; from lagom_megatron.cli.main import main; main(['--help'])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "usage: lagom" in proc.stdout


def test_help_imports_neither_training_nor_preflight():
    """Building every subcommand's parser imports no module of ``training/`` or ``preflight/``."""
    code = (
        "import sys; from lagom_megatron.cli.main import main; main(['--help']); "
        "print(*(m for m in sys.modules if m.startswith(('lagom_megatron.training', 'lagom_megatron.preflight'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=COMMAND_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "", proc.stdout.splitlines()[-1]


def test_every_entry_point_is_the_lagom_command():
    """``python -m lagom_megatron``, ``python -m lagom_megatron.cli`` (the SLURM scripts' form) and the
    ``lagom`` console script named in pyproject.toml all run the same command."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    target = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["lagom"]
    module, _, func = target.partition(":")
    code = f"import sys, importlib; sys.exit(getattr(importlib.import_module({module!r}), {func!r})(['--version']))"
    expected = f"lagom-megatron {lagom_megatron.__version__}"
    for argv in (
        [sys.executable, "-m", "lagom_megatron", "--version"],
        [sys.executable, "-m", "lagom_megatron.cli", "--version"],
        [sys.executable, "-c", code],
    ):
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=root, timeout=COMMAND_S)
        assert proc.returncode == 0 and proc.stdout.strip() == expected, (argv, proc.stdout, proc.stderr)


def test_ctrl_c_is_one_line_and_exit_130_without_a_traceback():
    """SIGINT while a command runs (here the 10,000-site search of ``lagom bench search``)."""
    import os
    import signal

    # numpy.random is imported first: a SIGINT that lands inside numpy's lazy import of it (its
    # compiled modules' initialisation) can be lost before Python raises it, whatever lagom does.
    # SIGINT gets Python's default handler as in a terminal: a suite started as a background job
    # (``.ci/run &``) hands its children SIGINT ignored, and Python then installs no handler
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "import sys, numpy.random; from lagom_megatron.cli.main import main; "
        "sys.exit(main(['bench', 'search', '--sizes', '10000', '10000', '10000', '--instances', '1']))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout.readline().startswith("search scaling on")  # running: the search has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=COMMAND_S)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.strip().splitlines() == ["lagom bench: interrupted"], err


def test_a_missing_command_is_a_usage_error_naming_the_choices(capsys):
    """No command (like git) and no benchmark, action or kind: exit 2, one line with the choices;
    argparse's internal names (``bench_args``) never shown. ``lagom --help`` stays exit 0."""
    cases = [
        (
            [],
            "lagom: error: no command given; give one of search, plan, bench, simulate, doctor, build-tuner, "
            "calibrate (see lagom --help)",
        ),
        (["bench"], "lagom bench: error: no benchmark given; give one of search, simulated (see lagom bench --help)"),
        (
            ["plan"],
            "lagom plan: error: no action given; give one of show, diff, validate, export (see lagom plan --help)",
        ),
        (
            ["calibrate"],
            "lagom calibrate: error: no kind given; give one of contention, bandwidth (see lagom calibrate --help)",
        ),
    ]
    for argv, line in cases:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", line + "\n"), argv
    assert main(["--help"]) == 0
    assert "usage: lagom" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["calibrate", "bandwidth", "x"], ["--version"], []], ids=["command", "version", "none"]
)
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(argv, tmp_path):
    """A real SIGINT while the parser is built (the subcommand's module imported): no traceback."""
    code = (
        "import os, signal, sys\n"
        "from lagom_megatron.cli import main as m\n"
        "m.build_parser = lambda commands, build=m.build_parser: (os.kill(os.getpid(), signal.SIGINT), build(commands))[1]\n"
        f"sys.exit(m.main({argv!r}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=COMMAND_S, cwd=tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == (
        "lagom calibrate: interrupted\n" if argv and argv[0] == "calibrate" else "lagom: interrupted\n"
    )
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


def test_help_and_version_import_no_subcommand_module():
    """Only the named subcommand's module is imported; ``--help`` and ``--version`` import none (nor numpy)."""
    code = (
        "import sys; from lagom_megatron.cli.main import main; main([sys.argv[1]]); "
        "print(*sorted(m for m in sys.modules if m.startswith(('lagom_megatron.cli.', 'numpy'))))"
    )
    for flag in ("--help", "--version"):
        proc = subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, timeout=COMMAND_S)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == "lagom_megatron.cli.main", proc.stdout
    code = "import sys; from lagom_megatron.cli.main import main; main(['plan', '--help']); print(sorted(sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=COMMAND_S)
    loaded = proc.stdout.splitlines()[-1]
    assert "'lagom_megatron.cli.plan'" in loaded and "'lagom_megatron.cli.search'" not in loaded
