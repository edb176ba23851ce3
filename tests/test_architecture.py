"""The package's architecture as docs/architecture.md states it: one concept per folder, imports
flowing one way, an engine free of torch and Megatron, no import circle, no long source file, and
everything about NCCL configuration in the one NCCL folder.

The checks read the source with ``ast``: imports inside functions count as much as imports at
the top of a module (a lazy import is still a dependency), and so does
``importlib.import_module("lagom_megatron....")`` with a literal name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lagom_megatron"

ALLOWED: dict[str, set[str]] = {
    "engine": set(),
    "nccl": {"engine"},
    "config": set(),
    "sim": {"engine", "nccl", "config"},
    "megatron": {"engine", "nccl", "config"},
    "training": {"engine", "nccl", "config", "megatron"},
    "launch": {"engine", "nccl", "config", "megatron", "training"},
    "cli": {"engine", "nccl", "config", "sim", "megatron", "training", "launch"},
}
"""Folder -> the folders its modules may import (docs/architecture.md, "What may import what").
Every module may import its own folder and the package root (``__version__``)."""

ENGINE_THIRD_PARTY = {"numpy", "yaml"}
"""What the engine may import besides the standard library and itself."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
"""Every module of the package: dotted name -> file."""


def _resolve(name: str) -> str | None:
    """The package module ``name`` names, or the closest enclosing one (``a.b.attr`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> tuple[set[str], set[str]]:
    """(package modules, top-level external packages) that ``module`` imports anywhere in its file."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    ours: set[str] = set()
    external: set[str] = set()

    def add(name: str) -> None:
        if name == "lagom_megatron" or name.startswith("lagom_megatron."):
            target = _resolve(name)
            if target and target != module:
                ours.add(target)
        else:
            external.add(name.split(".")[0])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                full = f"{name}.{alias.name}"
                add(full if full in MODULES else name)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value)
    return ours, external


IMPORTS: dict[str, tuple[set[str], set[str]]] = {m: _imports(m) for m in MODULES}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_only_init_and_main_at_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"], f"modules at the package root: {loose}; put each in its folder"


def test_every_folder_has_its_place_in_the_layering():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(ALLOWED), (f"folders {sorted(folders ^ set(ALLOWED))} differ from the layering; add a "
                                     "new folder to ALLOWED and to docs/architecture.md")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _folder(m)))
def test_imports_flow_one_way(module):
    src = _folder(module)
    allowed = ALLOWED[src] | {src}
    bad = sorted(t for t in IMPORTS[module][0] if _folder(t) is not None and _folder(t) not in allowed)
    assert not bad, f"{module} ({src}/) imports {bad}; {src}/ may import only {sorted(allowed)}"


def test_engine_imports_only_the_standard_library_numpy_and_yaml():
    allowed = set(sys.stdlib_module_names) | ENGINE_THIRD_PARTY | {"lagom_megatron", "__future__"}
    for module in (m for m in MODULES if _folder(m) == "engine"):
        extra = IMPORTS[module][1] - allowed
        assert not extra, f"{module} imports {sorted(extra)}; the engine may use the standard library, numpy and PyYAML only"


def test_engine_imports_without_torch_or_megatron():
    """Every engine module imports in a process where torch, Megatron and Transformer Engine
    cannot be imported (a static check can miss what a dependency drags in)."""
    engine = sorted(m for m in MODULES if _folder(m) == "engine")
    code = ("import sys\nfor name in ('torch', 'megatron', 'transformer_engine', 'pydantic', 'matplotlib'):\n"
            "    sys.modules[name] = None\n"
            f"import importlib\nfor m in {engine!r}:\n    importlib.import_module(m)\n"
            "print(len([m for m in sys.modules if m.startswith('lagom_megatron.engine')]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= len(engine)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> modules it imports): its strongly connected
    components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle():
    """No module reaches itself through imports (module-level or inside functions)."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail
    circles = _circles({m: IMPORTS[m][0] for m in MODULES})
    assert not circles, f"import circles: {circles}"


SOURCE_SUFFIXES = {".py", ".c", ".h", ".sh", ".sbatch"}


@pytest.mark.parametrize("folder", ["lagom_megatron", "scripts", "tests"])
def test_no_source_file_over_450_lines(folder):
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / folder).rglob("*"))
            if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts
            and (n := len(p.read_text(errors="replace").splitlines())) > 450}
    assert not long, f"source files over 450 lines (split them along their seams): {long}"


def _string_constants(path: Path) -> set[str]:
    """String literals of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings}


def test_nccl_configuration_lives_in_the_nccl_folder():
    """No file outside ``nccl/`` is named after NCCL, and no module outside it handles an NCCL
    variable by name (an ``NCCL_*`` string of its own): those go through ``lagom_megatron.nccl``."""
    named = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*")
                   if "nccl" in p.name.lower() and "nccl" not in p.relative_to(PACKAGE).parts[:1] and p.name != "__pycache__")
    assert not named, f"files about NCCL outside lagom_megatron/nccl/: {named}"
    for module, path in MODULES.items():
        if _folder(module) == "nccl":
            continue
        variables = sorted(s for s in _string_constants(path) if s.startswith("NCCL_") and s.isupper())
        assert not variables, f"{module} handles NCCL variables {variables}; move that to lagom_megatron/nccl/"


def test_the_checks_see_the_whole_package():
    """Guards the checks above: they find every folder, nested modules, lazy imports and literal
    import_module names."""
    assert {_folder(m) for m in MODULES} - {None} == set(ALLOWED)
    assert "lagom_megatron.nccl.plugin.build" in MODULES and _folder("lagom_megatron.nccl.plugin.build") == "nccl"
    assert "lagom_megatron.megatron.controller" in IMPORTS["lagom_megatron.training.loop"][0]  # a lazy import
    assert "lagom_megatron.engine.priority" in IMPORTS["lagom_megatron.engine.search"][0]  # `from pkg import module`
    assert "torch" in IMPORTS["lagom_megatron.megatron.gloo"][1]
