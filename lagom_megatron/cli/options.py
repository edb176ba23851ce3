"""Option types (argparse ``type=``: ``ArgumentTypeError``, exit 2) and output-path guards of ``lagom``."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """A ``str -> int`` type for an integer in ``lo..hi`` (``hi`` None: no upper bound)."""
    allowed = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is not {allowed}")
        return value

    parse.__name__ = "integer"
    return parse


def readable_file(text: str) -> str:
    """A path to an existing, readable regular file; ArgumentTypeError otherwise."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder; give a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return text


def readable_file_or_dir(text: str) -> str:
    """A path to an existing, readable file or folder; ArgumentTypeError otherwise."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return text


def writable_file(text: str) -> str:
    """A non-folder path whose folder exists (or can be created) and is writable; ArgumentTypeError otherwise."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: exists and is not writable")
    _check_folder(path.parent if str(path.parent) else Path("."), text)
    return text


def writable_dir(text: str) -> str:
    """A writable folder, or one that can be created; ArgumentTypeError otherwise."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a file; give a folder")
    _check_folder(path)
    return text


def _check_folder(folder: Path, file: str | None = None) -> None:
    from lagom_megatron.preflight.files import folder_problem

    problem = folder_problem(folder)
    if problem:
        raise argparse.ArgumentTypeError(f"{file}: {problem}" if file else problem)  # the problem names the folder


def refuse_overwriting_an_input(output: str | None, output_flag: str, inputs: dict[str, str | None]) -> None:
    """Refuses an output that is (path, symlink or hard link) one of ``inputs`` (option -> path); ValueError."""
    if output is None:
        return
    out = Path(output)
    for flag, path in inputs.items():
        if path is None:
            continue
        same = out.resolve() == Path(path).resolve()
        if not same and out.exists() and Path(path).exists():
            same = os.path.samefile(out, path)
        if same:
            raise ValueError(
                f"{output_flag} {output} is the same file as {flag} {path}: one would replace "
                "the other; give another file name"
            )


FORCE_HELP = "replace an existing output file that is not lagom's own output of this kind (default: refused)"


def refuse_replacing(
    output: str | os.PathLike | None, output_flag: str, what: str, is_own: Callable[[str], bool], *, force: bool
) -> None:
    """ValueError for an existing regular file not lagom's own (``is_own(text)``) without ``force``, or unreadable."""
    if output is None or not Path(output).is_file():
        return
    try:
        text = _read_text(Path(output))
    except UnicodeDecodeError:
        text = None
    except OSError:
        raise ValueError(f"{output_flag} {output}: exists and cannot be read; not overwriting it") from None
    if not force and (text is None or not is_own(text)):
        raise ValueError(
            f"{output_flag} {output}: exists and is not {what}; pass --force to replace it, or give another file name"
        )


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path`` (a seam for tests, which run as root)."""
    return path.read_text(encoding="utf-8")


def lagom_json(*keys: str) -> Callable[[str], bool]:
    """``is_own`` of ``refuse_replacing``: a JSON object holding ``keys``."""

    def is_own(text: str) -> bool:
        try:
            data = json.loads(text)
        except ValueError:
            return False
        return isinstance(data, dict) and all(k in data for k in keys)

    return is_own


is_plan_text = lagom_json("entries", "fingerprint")
is_profile_text = lagom_json("samples", "sites")


def first_line(prefix: str) -> Callable[[str], bool]:
    """``is_own`` of ``refuse_replacing``: the first line starts with ``prefix``."""
    return lambda text: text.split("\n", 1)[0].startswith(prefix)


def refuse_large_exhaustive(sites, rules) -> None:
    """ValueError when ``--method exhaustive`` surely exceeds ``EXHAUSTIVE_LIMIT`` (2^sites with a per-call choice)."""
    from lagom_megatron.engine.baselines import EXHAUSTIVE_LIMIT
    from lagom_megatron.engine.problem import SEARCH_KNOBS

    per_call = [k for k in SEARCH_KNOBS if rules.scope(k) == "call"]
    free = 0
    for site in sites:
        doms = rules.domains(op=site.op, n_nodes=site.n_nodes, group_size=site.group_size)
        free += any(len(doms[k]) > 1 for k in per_call)
    if 2**free > EXHAUSTIVE_LIMIT:
        raise ValueError(
            f"--method exhaustive: {free} tunable sites need at least 2^{free} joint configurations, "
            f"above the limit of {EXHAUSTIVE_LIMIT:,}; use --method priority (or autoccl)"
        )
