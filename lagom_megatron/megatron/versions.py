"""The torch and megatron-core versions lagom is tested with, and those this process would import.

lagom hooks private names of Megatron-Core (``_ParamAndGradBucketGroup``, ``P2PCommunicator._communicate``,
module-level aliases) and of torch (gloo's process-group constructor), and our ``pretrain_gpt.py``
runs Megatron-Core on CPU through shims; each release can move them. The ranges below are the
versions the whole test suite passed on (``make test-min`` / ``make test-max``, docs/training.md,
"Tested versions"); ``pyproject.toml`` declares the same ranges and ``tests/megatron/test_versions.py``
keeps the two equal.

Why the upper bounds:

- megatron-core 0.19 and newer: ``_ParamAndGradBucketGroup.start_grad_sync`` calls
  ``torch.cuda.current_stream()`` unconditionally (megatron-core 0.19.0
  ``distributed/param_and_grad_buffer.py:632``; Megatron-LM main ``:638``), so no data-parallel
  gradient reduction runs without CUDA and every CPU training test fails there. Untested on GPU.
- torch 2.15 and newer: not tested (2.14.1 was the newest release the test machines could install).

The versions are read from the source files of the packages Python would import (``megatron/core/
package_info.py``, ``torch/version.py``), found with :func:`importlib.util.find_spec`, without
importing them: a Megatron-LM checkout on ``PYTHONPATH`` (or the working directory of a patched
``pretrain_gpt.py``) shadows a pip-installed megatron-core, and its code is what runs, whatever
pip's metadata says. Nothing here imports torch or Megatron.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

TESTED_TORCH = ("2.6.0", "2.15")
"""torch versions lagom is tested with: ``>= [0]`` and ``< [1]`` (release part; ``+cpu`` or an NGC
``a0+...`` suffix is ignored)."""

TESTED_MEGATRON_CORE = ("0.16.1", "0.19")
"""megatron-core versions lagom is tested with: ``>= [0]`` and ``< [1]``."""

ALLOW_UNTESTED_ENV = "LAGOM_ALLOW_UNTESTED_VERSIONS"
"""Set to 1 to run with versions outside the tested ranges (the flag ``--lagom-allow-untested-versions``
does the same on the command line)."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.13.0+cpu"`` -> (2, 13, 0), ``"2.8.0a0+nv25"`` ->
    (2, 8, 0), ``"0.19"`` -> (0, 19).

    Raises:
        ValueError: a string that does not start with a dotted number.
    """
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"not a version number: {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def in_range(version: str, bounds: tuple[str, str]) -> bool:
    """True when ``bounds[0] <= version < bounds[1]``, comparing release numbers only (so a
    pre-release or local build of a tested release counts as that release)."""
    v, lo, hi = release(version), release(bounds[0]), release(bounds[1])
    width = max(len(v), len(lo), len(hi))

    def pad(t: tuple[int, ...]) -> tuple[int, ...]:
        return t + (0,) * (width - len(t))

    return pad(lo) <= pad(v) < pad(hi)


@dataclass(frozen=True)
class InstalledVersion:
    """One package as this interpreter would import it.

    Attributes:
        name: ``torch`` or ``megatron-core``.
        version: the version in the imported source (``package_info.py`` / ``version.py``), or
            ``"unknown"`` when the file has none.
        path: the package directory Python imports it from.
        checkout: True when that directory is not inside a ``site-packages`` / ``dist-packages``
            folder (a source checkout such as Megatron-LM's).
    """

    name: str
    version: str
    path: str
    checkout: bool

    def describe(self) -> str:
        """``megatron-core 0.17.1 (checkout at /path)`` or ``torch 2.13.0+cpu``."""
        where = f" (checkout at {self.path})" if self.checkout else ""
        return f"{self.name} {self.version}{where}"


def _module_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _assignments(path: Path) -> dict[str, object]:
    """Top-level ``NAME = literal`` assignments of a Python file (without running it)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return {}
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def _is_checkout(path: Path) -> bool:
    return not any(part in ("site-packages", "dist-packages") for part in path.resolve().parts)


def installed_megatron_core() -> InstalledVersion | None:
    """megatron-core as ``import megatron.core`` would load it here, or None when it is not importable.

    The version is ``MAJOR.MINOR.PATCH`` + ``PRE_RELEASE`` of the imported ``megatron/core/package_info.py``
    (the same string as ``megatron.core.__version__``; megatron-core 0.16.1 to Megatron-LM main).
    """
    mdir = _module_dir("megatron.core")
    if mdir is None:
        return None
    info = _assignments(mdir / "package_info.py")
    try:
        version = f"{info['MAJOR']}.{info['MINOR']}.{info['PATCH']}{info.get('PRE_RELEASE', '') or ''}"
    except KeyError:
        version = "unknown"
    return InstalledVersion("megatron-core", version, str(mdir), _is_checkout(mdir))


def installed_torch() -> InstalledVersion | None:
    """torch as ``import torch`` would load it here (``__version__`` of ``torch/version.py``), or None."""
    tdir = _module_dir("torch")
    if tdir is None:
        return None
    version = _assignments(tdir / "version.py").get("__version__")
    return InstalledVersion("torch", str(version) if version else "unknown", str(tdir), _is_checkout(tdir))


def untested_versions() -> list[str]:
    """One line per installed package outside its tested range (empty when all are tested), each
    naming the version, where it is imported from, and the tested range."""
    problems = []
    for found, bounds in ((installed_torch(), TESTED_TORCH), (installed_megatron_core(), TESTED_MEGATRON_CORE)):
        if found is None:
            continue
        try:
            ok = in_range(found.version, bounds)
        except ValueError:
            ok = False
        if not ok:
            problems.append(f"{found.describe()} is outside the tested range >={bounds[0]},<{bounds[1]}")
    return problems


class UntestedVersionError(RuntimeError):
    """torch or megatron-core outside the tested ranges (:func:`check_versions`)."""


def check_versions(*, allow_untested: bool = False) -> list[str]:
    """Refuses to run on a torch or megatron-core outside the tested ranges.

    Args:
        allow_untested: True (``--lagom-allow-untested-versions``), or the environment variable
            ``LAGOM_ALLOW_UNTESTED_VERSIONS=1``, turns the error into returned warnings.

    Returns:
        The warning lines (empty when every version is tested).

    Raises:
        UntestedVersionError: one message naming each untested version, where it is imported
            from, the tested range, and the override.
    """
    problems = untested_versions()
    if not problems:
        return []
    if allow_untested or os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        return [f"{p} (running anyway: untested versions allowed)" for p in problems]
    raise UntestedVersionError(
        "; ".join(problems) + ". Install a tested version (pip install "
        f"'torch>={TESTED_TORCH[0]},<{TESTED_TORCH[1]}' "
        f"'megatron-core>={TESTED_MEGATRON_CORE[0]},<{TESTED_MEGATRON_CORE[1]}'), or pass --lagom-allow-untested-versions "
        f"(or set {ALLOW_UNTESTED_ENV}=1) to run anyway"
    )
