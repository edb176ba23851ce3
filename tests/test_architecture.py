"""The package's architecture as docs/architecture.md states it: one concept per folder, imports
flowing one way, an engine free of torch and Megatron, no import circle, no long source file, and
everything about NCCL configuration in the one NCCL folder.

The checks read the source with ``ast``: imports inside functions count as much as imports at
the top of a module (a lazy import is still a dependency), and so does
``importlib.import_module("lagom_megatron....")`` with a literal name.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timeouts import COMMAND_S

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lagom_megatron"

ALLOWED: dict[str, set[str]] = {
    "engine": set(),
    "nccl": {"engine"},
    "config": {"engine"},
    "sim": {"engine", "nccl", "config"},
    "megatron": {"engine", "nccl", "config"},
    "preflight": {"engine", "nccl", "config", "megatron", "sim"},
    "training": {"engine", "nccl", "config", "megatron", "preflight"},
    "launch": {"engine", "nccl", "config", "megatron", "training", "preflight"},
    "cli": {"engine", "nccl", "config", "sim", "megatron", "training", "launch", "preflight"},
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


DYNAMIC_IMPORTS: dict[str, str] = {
    "lagom_megatron.training.cpu_shims": "patches Megatron-Core modules it names in a tuple",
    "lagom_megatron.launch.megatron_lm_cpu": "patches a Megatron-LM checkout's modules, which it names in tuples "
    "(the checkout is not a package of ours)",
    "lagom_megatron.megatron.hooks.te_targets": "finds Transformer Engine's and torch FSDP2's modules, whose paths differ "
    "by version (and a stand-in package in tests)",
}
"""Modules allowed to import a computed module name, and why (a computed name escapes these checks)."""


def imports_of(source: str, module: str, *, is_package: bool = False) -> tuple[set[str], set[str], int]:
    """(package modules, top-level external packages, computed-name imports) that ``source``, the text
    of ``module``, imports anywhere: ``import`` statements at any depth, ``importlib.import_module``
    and ``__import__`` with a literal name or an f-string whose literal head names a package module,
    and ``sys.modules["..."]``."""
    tree = ast.parse(source)
    ours: set[str] = set()
    external: set[str] = set()
    computed = 0

    def add(name: str) -> None:
        if name == "lagom_megatron" or name.startswith("lagom_megatron."):
            target = _resolve(name)
            if target and target != module:
                ours.add(target)
        else:
            external.add(name.split(".")[0])

    def literal(node: ast.AST) -> tuple[str, bool]:
        """(the literal text a name expression starts with, whether that is the whole name)."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value, True
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            return str(node.values[0].value), False  # f"lagom_megatron.cli.{name}": at least that package
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, whole = literal(node.left)
            right, right_whole = literal(node.right) if whole else ("", False)
            return left + right, whole and right_whole
        return "", False

    def add_named(node: ast.AST) -> bool:
        """Adds what a name expression names; False when the name is (partly) computed."""
        text, whole = literal(node)
        if text:
            add(text if whole else text.rpartition(".")[0] or text)
        return whole

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
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module",
            "__import__",
        ):
            if node.args and not add_named(node.args[0]):
                computed += 1
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "modules"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "sys"
        ):
            add_named(node.slice)
    return ours, external, computed


def _imports(module: str) -> tuple[set[str], set[str], int]:
    path = MODULES[module]
    return imports_of(path.read_text(), module, is_package=path.name == "__init__.py")


IMPORTS: dict[str, tuple[set[str], set[str], int]] = {m: _imports(m) for m in MODULES}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_only_init_and_main_at_the_package_root():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"], f"modules at the package root: {loose}; put each in its folder"


def test_every_folder_has_its_place_in_the_layering():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(ALLOWED), (
        f"folders {sorted(folders ^ set(ALLOWED))} differ from the layering; add a "
        "new folder to ALLOWED and to docs/architecture.md"
    )


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _folder(m)))
def test_imports_flow_one_way(module):
    src = _folder(module)
    allowed = ALLOWED[src] | {src}
    bad = sorted(t for t in IMPORTS[module][0] if _folder(t) is not None and _folder(t) not in allowed)
    assert not bad, f"{module} ({src}/) imports {bad}; {src}/ may import only {sorted(allowed)}"


def test_the_flow_check_sees_every_form_of_import():
    """The checker finds lazy, literal, f-string, concatenated, ``__import__`` and ``sys.modules``
    imports, and counts computed names (each form here would break the flow from engine/)."""
    src = """
import numpy
def f():
    from lagom_megatron.megatron.hooks import sites
    import importlib, sys
    importlib.import_module("lagom_megatron.nccl.rules")
    importlib.import_module(f"lagom_megatron.cli.{name}")
    importlib.import_module("lagom_megatron." + "launch")
    __import__("lagom_megatron.sim.device")
    sys.modules["lagom_megatron.training.loop"]
    importlib.import_module(name)
"""
    ours, external, computed = imports_of(src, "lagom_megatron.engine.fake")
    assert {_folder(m) for m in ours} == {"megatron", "nccl", "cli", "launch", "sim", "training"}
    assert external == {"numpy", "importlib", "sys"} and computed == 2  # the f-string and the bare name


def test_computed_import_names_only_where_listed():
    found = {m for m in MODULES if IMPORTS[m][2]}
    assert found <= set(DYNAMIC_IMPORTS) | {"lagom_megatron.cli.main"}, (
        f"{sorted(found - set(DYNAMIC_IMPORTS))} import a computed module name, which the flow check cannot "
        "follow; import the module by name, or list it in DYNAMIC_IMPORTS with the reason"
    )
    assert IMPORTS["lagom_megatron.cli.main"][0] >= {"lagom_megatron.cli"}  # its f-string names its own folder


def test_engine_imports_only_the_standard_library_numpy_and_yaml():
    allowed = set(sys.stdlib_module_names) | ENGINE_THIRD_PARTY | {"lagom_megatron", "__future__"}
    for module in (m for m in MODULES if _folder(m) == "engine"):
        extra = IMPORTS[module][1] - allowed
        assert not extra, (
            f"{module} imports {sorted(extra)}; the engine may use the standard library, numpy and PyYAML only"
        )


def test_engine_imports_without_torch_or_megatron():
    """Every engine module imports in a process where torch, Megatron and Transformer Engine
    cannot be imported (a static check can miss what a dependency drags in)."""
    engine = sorted(m for m in MODULES if _folder(m) == "engine")
    code = (
        "import sys\nfor name in ('torch', 'megatron', 'transformer_engine', 'pydantic', 'matplotlib'):\n"
        "    sys.modules[name] = None\n"
        f"import importlib\nfor m in {engine!r}:\n    importlib.import_module(m)\n"
        "print(len([m for m in sys.modules if m.startswith('lagom_megatron.engine')]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=COMMAND_S)
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
MAX_LINES = 600
MIN_LINES = 100
SMALL_MODULES: dict[str, str] = {
    "cli/build_tuner.py": "entry point: lagom build-tuner",
    "engine/files.py": "the one atomic writer and JSON reader every room uses",
    "engine/p2p_knobs.py": "one plugin of the post-search knob interface (net-peer channels)",
    "engine/search.py": "registry: METHODS and the searchers, the one entry point of the search",
    "engine/steps.py": "protocol: what the tuner and a backend exchange each iteration",
    "engine/stream_priority.py": "one plugin of the post-search knob interface (high-priority stream)",
    "megatron/hooks/router_coalesced.py": "one mixin of SiteRouter (TE quantized gathers), like its siblings",
    "preflight/types.py": "protocol: RunShape and Finding, which every rule module reads",
    "sim/program.py": "protocol: the program a workload emits and the timeline runs",
    "training/tokenizer.py": "torch-free, so pre-flight and lagom doctor read vocabulary sizes without torch",
}
"""Modules under MIN_LINES and why each stands alone: an entry point, a registry, a protocol, or one
plugin of an interface. Anything else under MIN_LINES belongs in its concept's module."""


def _lines(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines())


@pytest.mark.parametrize("folder", ["lagom_megatron", "scripts", "tests"])
def test_no_source_file_over_600_lines(folder):
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / folder).rglob("*"))
        if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts and (n := _lines(p)) > MAX_LINES
    }
    assert not long, f"source files over {MAX_LINES} lines (one concept per file; split along a concept): {long}"


def test_modules_under_100_lines_say_why_they_stand_alone():
    small = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.stem not in ("__init__", "__main__") and (n := _lines(p)) < MIN_LINES
    }
    unexplained = {f: n for f, n in small.items() if f not in SMALL_MODULES}
    assert not unexplained, (
        f"modules under {MIN_LINES} lines {unexplained}: merge each into its concept's module, "
        "or list it in SMALL_MODULES with why it stands alone"
    )
    stale = sorted(set(SMALL_MODULES) - set(small))
    assert not stale, f"SMALL_MODULES lists {stale}, which are gone or no longer small"


def test_the_package_has_at_most_110_modules():
    modules = [m for m, p in MODULES.items() if p.stem not in ("__init__", "__main__")]
    assert len(modules) <= 110, f"{len(modules)} modules; merge fragments of one concept"


def docstring_lines(source: str) -> int:
    """Lines of the module, class and function docstrings of ``source``."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                count += first.end_lineno - first.lineno + 1
    return count


def test_docstrings_are_at_most_a_fifth_of_the_package():
    assert docstring_lines('"""a\nb"""\nclass A:\n    """c"""\n    def f(self):\n        """d"""\n') == 4
    texts = [p.read_text() for p in PACKAGE.rglob("*.py")]
    docs = sum(docstring_lines(t) for t in texts)
    total = sum(len(t.splitlines()) for t in texts)
    assert docs <= 0.2 * total, f"docstrings are {docs} of {total} lines; say what the code cannot, no history"


MEGATRON_ROOMS = ("control", "outputs", "hooks", "pool")
"""megatron/'s inner rooms, top to bottom; below them the floor modules MEGATRON_FLOOR."""
MEGATRON_FLOOR = ("groups", "consensus")


def _megatron_level(module: str) -> int | None:
    """0 for the floor, 1 (pool) .. 4 (control) for the rooms, None outside megatron/'s modules."""
    parts = module.split(".")
    if parts[:2] != ["lagom_megatron", "megatron"] or len(parts) < 3:
        return None
    if parts[2] in MEGATRON_FLOOR:
        return 0
    return len(MEGATRON_ROOMS) - MEGATRON_ROOMS.index(parts[2]) if parts[2] in MEGATRON_ROOMS else None


def test_megatron_holds_its_rooms_and_floor_only():
    folder = PACKAGE / "megatron"
    flat = sorted(p.stem for p in folder.glob("*.py") if p.stem not in (*MEGATRON_FLOOR, "__init__"))
    assert not flat, f"flat modules in megatron/ {flat}: put each in its room {MEGATRON_ROOMS}"
    rooms = sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file())
    assert rooms == sorted(MEGATRON_ROOMS), f"megatron/ rooms {rooms}; add a new room to MEGATRON_ROOMS"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _megatron_level(m) is not None))
def test_megatron_rooms_import_only_downward(module):
    level = _megatron_level(module)
    assert [
        _megatron_level(m)
        for m in ("lagom_megatron.megatron.control.apply", "lagom_megatron.megatron.groups", "lagom_megatron.megatron")
    ] == [4, 0, None]
    up = sorted(t for t in IMPORTS[module][0] if (lt := _megatron_level(t)) is not None and lt > level)
    assert not up, (
        f"{module} imports {up}, a room above its own; megatron/ flows {' -> '.join(MEGATRON_ROOMS)} -> floor"
    )


NCCL_VARIABLE = re.compile(r"\b(?:TORCH_)?NCCL_[A-Z0-9_]+")
"""An NCCL or ProcessGroupNCCL environment variable's name."""


def nccl_variables(source: str) -> set[str]:
    """NCCL variable names in the string literals (f-string parts included) of ``source`` that are
    not docstrings: code that reads, writes or explains an NCCL variable."""
    tree = ast.parse(source)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {
        v
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
        for v in NCCL_VARIABLE.findall(n.value)
    }


def test_nccl_configuration_lives_in_the_nccl_folder():
    """No file outside ``nccl/`` is named after NCCL, and no module outside it handles an NCCL
    variable by name: those go through ``lagom_megatron.nccl``."""
    assert nccl_variables(
        '"""NCCL_ALGO in a docstring"""\nx = {"NCCL_ALGO": 1}\ny = f"export NCCL_PROTO={v}"\n'
        'z = "TORCH_NCCL_USE_COMM_NONBLOCKING=1"'
    ) == {"NCCL_ALGO", "NCCL_PROTO", "TORCH_NCCL_USE_COMM_NONBLOCKING"}  # the check can fail
    named = sorted(
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*")
        if "nccl" in p.name.lower() and "nccl" not in p.relative_to(PACKAGE).parts[:1] and p.name != "__pycache__"
    )
    assert not named, f"files about NCCL outside lagom_megatron/nccl/: {named}"
    for module, path in MODULES.items():
        if _folder(module) == "nccl":
            continue
        variables = sorted(nccl_variables(path.read_text()))
        assert not variables, f"{module} handles NCCL variables {variables}; move that to lagom_megatron/nccl/"


def test_the_checks_see_the_whole_package():
    """Guards the checks above: they find every folder, nested modules, lazy imports and literal
    import_module names."""
    assert {_folder(m) for m in MODULES} - {None} == set(ALLOWED)
    assert "lagom_megatron.nccl.plugin.build" in MODULES and _folder("lagom_megatron.nccl.plugin.build") == "nccl"
    assert "lagom_megatron.megatron.control.controller" in IMPORTS["lagom_megatron.training.loop"][0]  # a lazy import
    assert "lagom_megatron.engine.priority" in IMPORTS["lagom_megatron.engine.search"][0]  # `from pkg import module`
    assert "torch" in IMPORTS["lagom_megatron.megatron.pool.gloo"][1]
