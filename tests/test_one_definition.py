"""Each ``--lagom-*`` default and bound is defined once; every other module reads it.

The definitions: ``engine.tuner.TunerConfig`` (iteration counts, method), ``engine.tuner``'s ``MIN_ITERS`` and
``MAX_*_ITERS`` (bounds), ``megatron.pool.comm_pool.DEFAULT_BUDGET_MIB`` (pool budget), ``engine.search.METHODS`` (the
method list). The scan reads the package's source with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lagom_megatron"

FLAG_VALUES = {"warmup_iters", "verify_iters", "verify_max_iters", "pool_budget_mib"}
"""Names (also with a ``lagom_`` prefix) of parameters, fields and argument keys that carry a ``--lagom-*`` value."""
DEFAULT_OWNER = ("engine/tuner.py", "TunerConfig")
"""The one class whose fields may give these names (and ``method``) a literal default."""
OWNERS = {
    "MIN_ITERS": "engine/tuner.py",
    "MAX_WARMUP_ITERS": "engine/tuner.py",
    "MAX_VERIFY_ITERS": "engine/tuner.py",
    "MAX_VERIFY_MAX_ITERS": "engine/tuner.py",
    "DEFAULT_BUDGET_MIB": "megatron/pool/comm_pool.py",
    "METHODS": "engine/search.py",
    "LAGOM_METHODS": "engine/search.py",
}
"""Name of a bound, default or list -> the one module that assigns it."""
METHOD_NAMES = {"priority", "autoccl", "exhaustive", "nccl-default"}


def _flag_value(name: str) -> bool:
    return name.removeprefix("lagom_") in FLAG_VALUES


def _literal(node: ast.AST | None) -> bool:
    """A number or string written out (``None`` means "not given" and is no default)."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    return False


def _number(node: ast.AST) -> bool:
    return _literal(node) and not (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _defaults(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """(name, default) of a function's parameters or a class body's fields."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = node.args
        positional = a.posonlyargs + a.args
        pairs = list(zip([p.arg for p in positional[len(positional) - len(a.defaults) :]], a.defaults))
        return pairs + [(p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    if isinstance(node, ast.ClassDef):
        return [
            (s.target.id, s.value)
            for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None
        ] + [
            (t.id, s.value)
            for s in node.body
            if isinstance(s, ast.Assign)
            for t in s.targets
            if isinstance(t, ast.Name)
        ]
    return []


def second_definitions(root: Path) -> list[str]:
    """``file:line: what`` for each literal default or bound of a ``--lagom-*`` flag outside its one definition."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            pairs = _defaults(node)
            takes_flags = any(_flag_value(n) for n, _ in pairs)
            if (rel, getattr(node, "name", None)) != DEFAULT_OWNER:
                found += [
                    f"{where}: default {n} = {ast.unparse(d)}"
                    for n, d in pairs
                    if _literal(d) and (_flag_value(n) or (n.removeprefix("lagom_") == "method" and takes_flags))
                ]
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [
                    f"{where}: {t.id} assigned outside {OWNERS[t.id]}"
                    for t in targets
                    if isinstance(t, ast.Name) and t.id in OWNERS and OWNERS[t.id] != rel
                ]
            if isinstance(node, ast.Call):
                func = _name(node.func)
                args = node.args
                if (
                    func == "add_argument"
                    and args
                    and isinstance(args[0], ast.Constant)
                    and str(args[0].value).startswith("--lagom")
                ):
                    found += [
                        f"{where}: {args[0].value} default={ast.unparse(k.value)}"
                        for k in node.keywords
                        if k.arg == "default" and _literal(k.value)
                    ]
                found += [
                    f"{where}: {func}({k.arg}={ast.unparse(k.value)})"
                    for k in node.keywords
                    if func == "set_defaults" and k.arg and _flag_value(k.arg) and _literal(k.value)
                ]
                looked_up = args[1:3] if func == "getattr" else args[:2] if func == "get" else []
                key, fallback = [*looked_up, None, None][:2]
                if (
                    isinstance(key, ast.Constant)
                    and isinstance(key.value, str)
                    and _flag_value(key.value)
                    and _literal(fallback)
                ):
                    found.append(f"{where}: {func}({key.value!r}, {ast.unparse(fallback)})")
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(_flag_value(_name(o) or "") for o in operands) and any(_number(o) for o in operands):
                    found.append(f"{where}: bound {ast.unparse(node)}")
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and rel != OWNERS["METHODS"]:
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)} & METHOD_NAMES
                if len(names) >= 3:
                    found.append(f"{where}: a method list {ast.unparse(node)}")
            if isinstance(node, ast.Subscript) and _name(node.value) == "Literal" and rel != OWNERS["METHODS"]:
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                if any(isinstance(e, ast.Constant) and e.value in METHOD_NAMES for e in elts):
                    found.append(f"{where}: a method list {ast.unparse(node)}")
    return found


def test_each_lagom_default_and_bound_is_defined_once():
    found = second_definitions(PACKAGE)
    assert not found, (
        "a --lagom-* default, bound or method list is written out again; read it from its one "
        f"definition ({DEFAULT_OWNER[1]}, {sorted(OWNERS)}): {found}"
    )


SECOND_LITERALS = {
    "parameter": "def run(*, warmup_iters: int = 1): ...",
    "field": "class Spec:\n    lagom_verify_iters: int = 4\n",
    "method beside a count": "def run(verify_iters=None, method='priority'): ...",
    "argparse": "p.add_argument('--lagom-pool-budget-mib', type=float, default=512.0)",
    "set_defaults": "p.set_defaults(lagom_warmup_iters=4)",
    "fallback": "getattr(args, 'lagom_verify_max_iters', 8)",
    "bound name": "MAX_VERIFY_ITERS = 200",
    "bound": "ok = 1 <= cfg.verify_iters <= 200",
    "Literal": "m: Literal['priority', 'autoccl'] = None",
    "method tuple": "CHOICES = ('priority', 'autoccl', 'nccl-default')",
}


def test_the_scan_finds_a_second_literal_of_each_kind(tmp_path):
    for kind, source in SECOND_LITERALS.items():
        (tmp_path / "mod.py").write_text(source + "\n")
        assert second_definitions(tmp_path), f"the scan misses a second {kind}: {source}"
    (tmp_path / "mod.py").write_text(
        "def search(method='priority'): ...\ndef run(*, warmup_iters=DEFAULT.warmup_iters,"
        " pool_budget_mib=None): ...\nfor m in ('priority', 'autoccl'): ...\n"
    )
    assert second_definitions(tmp_path) == []
