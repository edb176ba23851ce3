"""Option types of the ``lagom`` subcommands: argparse ``type=`` callables checked while the command
line is parsed, before a subcommand runs anything.

Each raises ``argparse.ArgumentTypeError`` with the bad value and what is allowed; argparse turns
that into one ``lagom <command>: error: ...`` line and exit status 2 (``main.LagomParser``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Callable


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """A type for an integer in ``lo..hi`` (``hi`` None: no upper bound).

    Returns:
        A callable ``str -> int`` for ``add_argument(type=...)``.
    """
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
    """A path to an existing, readable regular file (a profile, a plan).

    Raises:
        argparse.ArgumentTypeError: missing, a folder, or not readable (names the path).
    """
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder; give a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return text


def readable_file_or_dir(text: str) -> str:
    """A path to an existing, readable regular file or folder (``lagom calibrate bandwidth``'s inputs).

    Raises:
        argparse.ArgumentTypeError: missing or not readable (names the path).
    """
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return text


def writable_file(text: str) -> str:
    """A path a file can be written to atomically: its folder exists (or can be created under an
    existing writable folder) and is writable, and the path is not a folder.

    Raises:
        argparse.ArgumentTypeError: names the path and why it cannot be written.
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: exists and is not writable")
    _check_folder(path.parent if str(path.parent) else Path("."), text)
    return text


def writable_dir(text: str) -> str:
    """A folder that exists and is writable, or can be created under an existing writable folder.

    Raises:
        argparse.ArgumentTypeError: names the path and why it cannot be written.
    """
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a file; give a folder")
    _check_folder(path, text)
    return text


def _check_folder(folder: Path, text: str) -> None:
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {existing} is not a folder")
    # the atomic write creates a temporary file in the folder: try one (os.access says yes to
    # root on a read-only or immutable folder)
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {existing} ({exc.strerror or exc})") from None


def refuse_overwriting_an_input(output: str | None, output_flag: str, inputs: dict[str, str | None]) -> None:
    """Refuses an output path that names another file of the same command (an input it reads, or
    another output): the same path, a symlink to it, or a hard link. The atomic write would
    replace that file (a user's plan or profile) without a word.

    Args:
        output: the output path, or None (standard output: nothing to check).
        output_flag: its option as the user typed it (``-o``, ``--plan-out``), for the message.
        inputs: option (or argument name) -> input path; None entries are skipped.

    Raises:
        ValueError: names both options and the path.
    """
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
            raise ValueError(f"{output_flag} {output} is the same file as {flag} {path}: one would replace "
                             "the other; give another file name")


FORCE_HELP = "replace an existing output file that is not lagom's own output of this kind (default: refused)"
"""Help of the ``--force`` option of every command that writes a file."""


def refuse_replacing(output: str | os.PathLike | None, output_flag: str, what: str, is_own: Callable[[str], bool],
                     *, force: bool) -> None:
    """Refuses to replace an existing regular file that is not lagom's own output of the same kind
    (a user's notes given as ``-o``), unless ``force``; a file that cannot be read is never replaced.
    A missing path, a device or named pipe (written into, not replaced: ``engine.files``) pass.

    Args:
        output: the output path, or None (standard output: nothing to check).
        output_flag: its option as the user typed it (``-o``, ``--out``), for the message.
        what: the kind for the message (``a lagom plan``).
        is_own: the file's text -> whether it is that kind (``lagom_json``, ``first_line``).
        force: the command's ``--force``.

    Raises:
        ValueError: names the option, the path, the kind, and ``--force``.
    """
    if output is None or not Path(output).is_file():
        return
    try:
        text = _read_text(Path(output))
    except UnicodeDecodeError:
        text = None
    except OSError:
        raise ValueError(f"{output_flag} {output}: exists and cannot be read; not overwriting it") from None
    if not force and (text is None or not is_own(text)):
        raise ValueError(f"{output_flag} {output}: exists and is not {what}; pass --force to replace it, "
                         "or give another file name")


def _read_text(path: Path) -> str:
    """The UTF-8 text of ``path`` (one seam: tests make it fail where permissions cannot, as root)."""
    return path.read_text(encoding="utf-8")


def lagom_json(*keys: str) -> Callable[[str], bool]:
    """``is_own`` of ``refuse_replacing`` for lagom's JSON files: a JSON object holding ``keys``
    (a plan: ``entries``, ``fingerprint``; a profile: ``samples``, ``sites``)."""

    def is_own(text: str) -> bool:
        try:
            data = json.loads(text)
        except ValueError:
            return False
        return isinstance(data, dict) and all(k in data for k in keys)

    return is_own


is_plan_text = lagom_json("entries", "fingerprint")
"""A plan file's text (``engine.plan.Plan.to_dict`` always writes both keys)."""
is_profile_text = lagom_json("samples", "sites")
"""A profile file's text (``engine.profile.Profile.to_dict``)."""


def first_line(prefix: str) -> Callable[[str], bool]:
    """``is_own`` of ``refuse_replacing`` for lagom's text files: the first line starts with ``prefix``
    (the header lagom writes there)."""
    return lambda text: text.split("\n", 1)[0].startswith(prefix)


def refuse_large_exhaustive(sites, rules) -> None:
    """Refuses ``--method exhaustive`` before anything is fitted or run when its joint space is
    surely above the searcher's limit (``engine.baselines.EXHAUSTIVE_LIMIT``). A site with a knob
    set per call (``rules.scope(knob) == "call"``) that has two or more values doubles the joint
    space at least; knobs set per communicator or per process multiply it once per unit, not per
    site, and are not counted (a lower bound, so nothing the searcher accepts is refused).
    ``lagom simulate`` and ``lagom search`` share this check.

    Args:
        sites: the collective sites (``engine.profile.CollectiveSite``: ``op``, ``n_nodes``,
            ``group_size``).
        rules: the knob rules the search would use (``engine.knobs.KnobRules``).

    Raises:
        ValueError: names the number of such sites, the lower bound and the limit.
    """
    from lagom_megatron.engine.baselines import EXHAUSTIVE_LIMIT
    from lagom_megatron.engine.problem import SEARCH_KNOBS

    per_call = [k for k in SEARCH_KNOBS if rules.scope(k) == "call"]
    free = 0
    for site in sites:
        doms = rules.domains(op=site.op, n_nodes=site.n_nodes, group_size=site.group_size)
        free += any(len(doms[k]) > 1 for k in per_call)
    if 2 ** free > EXHAUSTIVE_LIMIT:
        raise ValueError(f"--method exhaustive: {free} tunable sites need at least 2^{free} joint configurations, "
                         f"above the limit of {EXHAUSTIVE_LIMIT:,}; use --method priority (or autoccl)")
