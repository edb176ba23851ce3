"""Tested torch / megatron-core ranges (``make test-min`` / ``test-max``, docs/training.md) and the versions Python
would import, read without importing. Tested up to torch 2.15 and megatron-core 0.19.x and main's 0.20.0 (Megatron-LM
core_v0.19.0 and main d98e8a6, docs/training.md's table)."""

from __future__ import annotations

import ast
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from lagom_megatron.engine.cluster import release

TESTED_TORCH = ("2.6.0", "2.16")
"""torch versions lagom is tested with: ``>= [0]`` and ``< [1]`` (release part only)."""

TESTED_MEGATRON_CORE = ("0.16.1", "0.21")

ALLOW_UNTESTED_ENV = "LAGOM_ALLOW_UNTESTED_VERSIONS"


def in_range(version: str, bounds: tuple[str, str]) -> bool:
    """True when ``bounds[0] <= version < bounds[1]``, comparing release numbers only."""
    v, lo, hi = release(version), release(bounds[0]), release(bounds[1])
    width = max(len(v), len(lo), len(hi))

    def pad(t: tuple[int, ...]) -> tuple[int, ...]:
        return t + (0,) * (width - len(t))

    return pad(lo) <= pad(v) < pad(hi)


@dataclass(frozen=True)
class InstalledVersion:
    """One package as this interpreter would import it; ``checkout``: outside ``site-packages`` / ``dist-packages``."""

    name: str
    version: str
    path: str
    checkout: bool

    def describe(self) -> str:
        where = f" (checkout at {self.path})" if self.checkout else ""
        return f"{self.name} {self.version}{where}"


def _module_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _assignments(path: Path) -> dict[str, object]:
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


def is_checkout(path: Path) -> bool:
    return not any(part in ("site-packages", "dist-packages") for part in path.resolve().parts)


def installed_megatron_core() -> InstalledVersion | None:
    """megatron-core as ``import megatron.core`` loads it (its ``package_info.py``, 0.16.1 to main), or None."""
    mdir = _module_dir("megatron.core")
    if mdir is None:
        return None
    info = _assignments(mdir / "package_info.py")
    try:
        version = f"{info['MAJOR']}.{info['MINOR']}.{info['PATCH']}{info.get('PRE_RELEASE', '') or ''}"
    except KeyError:
        version = "unknown"
    return InstalledVersion("megatron-core", version, str(mdir), is_checkout(mdir))


def installed_torch() -> InstalledVersion | None:
    """torch as ``import torch`` would load it here (``__version__`` of ``torch/version.py``), or None."""
    tdir = _module_dir("torch")
    if tdir is None:
        return None
    version = _assignments(tdir / "version.py").get("__version__")
    return InstalledVersion("torch", str(version) if version else "unknown", str(tdir), is_checkout(tdir))


def untested_versions() -> list[str]:
    """One line per installed package outside its tested range (empty when all are tested)."""
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


def check_versions(*, allow_untested: bool = False, refuse: bool = True) -> list[str]:
    """Refuses an untested torch / megatron-core (UntestedVersionError: each, its range, the override); with
    ``allow_untested`` or ``LAGOM_ALLOW_UNTESTED_VERSIONS=1``, or ``refuse`` False (a Megatron-LM run without
    ``--lagom``), returns them as warnings."""
    problems = untested_versions()
    if not problems:
        return []
    if allow_untested or os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        return [f"{p} (running anyway: untested versions allowed)" for p in problems]
    override = f"--lagom-allow-untested-versions (or set {ALLOW_UNTESTED_ENV}=1)"
    if not refuse:
        return [f"{p} (running anyway without --lagom; with --lagom, pass {override})" for p in problems]
    raise UntestedVersionError(
        "; ".join(problems) + ". Install a tested version (pip install "
        f"'torch>={TESTED_TORCH[0]},<{TESTED_TORCH[1]}' "
        f"'megatron-core>={TESTED_MEGATRON_CORE[0]},<{TESTED_MEGATRON_CORE[1]}'), or pass {override} to run anyway"
    )
