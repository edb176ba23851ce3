"""Builds lagom's NCCL plugin (tuner and profiler) into one shared library with gcc; no CUDA or NCCL sources needed."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PLUGIN_DIR = Path(__file__).resolve().parent
TUNER_SOURCES = (
    PLUGIN_DIR / "plugin.c",
    PLUGIN_DIR / "table.c",
    PLUGIN_DIR / "status.c",
    PLUGIN_DIR / "profiler.c",
    PLUGIN_DIR / "observed.c",
)
HEADERS = (PLUGIN_DIR / "lagom_tuner.h", PLUGIN_DIR / "lagom_profiler.h", PLUGIN_DIR / "plugin_internal.h")
LIBRARY_NAME = "libnccl-tuner-lagom.so"
"""File name of the built plugin (NCCL also finds it as ``NCCL_TUNER_PLUGIN=lagom`` on the library path)."""
HARNESS_SOURCE = PLUGIN_DIR / "test" / "test_plugin.c"
"""The C test harness's main source (in a source checkout, not in an installed wheel)."""
HARNESS_SOURCES = (
    HARNESS_SOURCE,
    *(PLUGIN_DIR / "test" / f"test_{name}.c" for name in ("calls", "table", "slices", "profiler", "observed", "ce")),
)

_WARN = ["-std=gnu11", "-Wall", "-Wextra"]


def find_compiler(cc: str | None = None) -> str:
    """Path of the C compiler: ``cc``, else ``$CC``, else ``gcc``; FileNotFoundError when it is not on ``PATH``."""
    name = cc or os.environ.get("CC") or "gcc"
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(
            f"C compiler {name!r} not found on PATH; the NCCL tuner plugin is built with gcc "
            "(Debian/Ubuntu: apt-get install gcc), or set CC to another C compiler"
        )
    return path


def _compile(args: list[str], out: Path, what: str) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run(args + ["-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {what} failed ({' '.join(args)}):\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build_tuner(
    out_dir: str | os.PathLike, *, cc: str | None = None, extra_cflags: list[str] | tuple[str, ...] = ()
) -> Path:
    """Compiles the plugin (tuner v3-v7, profiler v1-v7) into ``out_dir``; FileNotFoundError, RuntimeError."""
    out = Path(out_dir).resolve() / LIBRARY_NAME
    args = [
        find_compiler(cc),
        *_WARN,
        "-O2",
        "-g",
        *extra_cflags,
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        *(str(src) for src in TUNER_SOURCES),
        "-ldl",
    ]
    return _compile(args, out, "the NCCL tuner plugin")


def usage_line(library: str | os.PathLike) -> str:
    """One shell line telling how to load the built plugin as NCCL's tuner and profiler (the path is quoted)."""
    import shlex

    lib = shlex.quote(str(library))
    return (
        f"# use it with:  export NCCL_TUNER_PLUGIN={lib} NCCL_PROFILER_PLUGIN={lib} LAGOM_TUNER_CONFIG=TABLE.csv"
        "  (TABLE.csv: lagom plan export PLAN --format nccl-tuner-csv --extended -o TABLE.csv)"
    )


def build_harness(
    out_dir: str | os.PathLike, *, cc: str | None = None, extra_cflags: list[str] | tuple[str, ...] = ()
) -> Path:
    """Compiles the C test harness to ``out_dir/test_plugin``; FileNotFoundError (no cc or sources), RuntimeError."""
    for source in HARNESS_SOURCES:
        if not source.is_file():
            raise FileNotFoundError(f"test harness source {source} is missing (not a source checkout)")
    out = Path(out_dir).resolve() / "test_plugin"
    args = [find_compiler(cc), *_WARN, "-O1", "-g", *extra_cflags, *(str(src) for src in HARNESS_SOURCES), "-ldl"]
    return _compile(args, out, "the tuner plugin test harness")
