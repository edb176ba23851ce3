#!/usr/bin/env bash
# Run the test suite against one torch / megatron-core pair, in a virtual environment of its own.
#
#   scripts/test_versions.sh VENV PYTHON TORCH MEGATRON_CORE [pytest arguments...]
#   scripts/test_versions.sh .venv-max python3.12 2.15.0 0.19.2
#   scripts/test_versions.sh --install-only .venv-min python3.11 2.6.0 0.16.1
#
# `make test-min` and `make test-max` call it with the two ends of the tested ranges
# (lagom_megatron/megatron/hooks/versions.py; docs/training.md, "Tested versions").
# VENV is created with PYTHON when it does not exist; torch and megatron-core are installed at
# exactly the given versions (torch from the configured index: on Linux that may be a CUDA build,
# which runs the suite on CPU as well), then this project (editable, with its test extra, the two
# versions held), then pytest runs the whole suite (or the given pytest arguments).
# megatron-core 0.17 and newer need Python >= 3.12.
# Exit status: pytest's; 2 on bad usage; 1 when pip installed other versions than those asked for.
set -euo pipefail

usage="usage: $0 [--install-only] VENV PYTHON TORCH_VERSION MEGATRON_CORE_VERSION [pytest args...]"
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  echo "$usage"
  sed -n '2,15s/^# \{0,1\}//p' "$0"
  exit 0
fi
install_only=0
if [ "${1:-}" = "--install-only" ]; then
  install_only=1
  shift
fi
if [ $# -lt 4 ]; then
  echo "$usage" >&2
  exit 2
fi
venv=$1 python=$2 torch_version=$3 mcore_version=$4
shift 4
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! "$python" -c 'import sys' 2>/dev/null; then
  echo "$0: '$python' does not run (not found, not a Python, or a pyenv shim with no PYENV_VERSION set); give its full path, e.g. make test-max PYTHON_MAX=/path/to/python3.12 (megatron-core >= 0.17 needs Python >= 3.12)" >&2
  exit 2
fi
stamp="$venv/.lagom-versions"
want="torch==$torch_version megatron-core==$mcore_version"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  test -x "$venv/bin/python" || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$torch_version" "megatron-core==$mcore_version"
  "$venv/bin/python" -m pip install -q -e '.[test]' "torch==$torch_version" "megatron-core==$mcore_version"
  echo "$want" > "$stamp"
fi
"$venv/bin/python" - "$torch_version" "$mcore_version" <<'EOF'
import importlib.metadata as m, sys
import megatron.core, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| megatron-core", megatron.core.__version__)
got = [m.version("torch").split("+")[0], m.version("megatron-core")]
if got != sys.argv[1:]:
    sys.exit(f"test_versions.sh: installed torch {got[0]}, megatron-core {got[1]}; asked for {' '.join(sys.argv[1:])}")
EOF
[ "$install_only" = 1 ] && exit 0
if [ $# -eq 0 ]; then
  set -- tests -p no:cacheprovider
fi
exec "$venv/bin/python" -m pytest -q "$@"
