import subprocess
import sys

import lagom_megatron
from lagom_megatron.cli.main import main


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
