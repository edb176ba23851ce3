"""The profile and plan files the ``lagom`` commands read: ``cli.schemas`` checks them; these
wrappers add, when a file fails as one kind and is plainly the other (a profile given to
``lagom plan``, a plan given to ``lagom search --profile``), one line saying so instead of the
schema's first complaint (``entries: Field required``).

A profile has ``samples`` and no ``entries``; a plan has ``entries`` and no ``samples``
(``engine.profile.Profile.to_dict``, ``engine.plan.Plan.to_dict``).
"""

from __future__ import annotations

from typing import Any


def read_plan(path: str, command: str):
    """``schemas.load_plan(path)``.

    Args:
        path: the plan file.
        command: the command reading it, for the message (``lagom plan show``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the schema's line; or, for a profile, ``<path> looks like a profile (it has
            samples, no entries); <command> reads plans``.
    """
    from lagom_megatron.cli.schemas import load_plan

    return _load(load_plan, path, "profile", f"{path} looks like a profile (it has samples, no entries); {command} reads "
                 "plans (a profile is searched with lagom search --profile)")


def read_profile(path: str, command: str):
    """``schemas.load_profile(path)``.

    Args:
        path: the profile file.
        command: the command and option reading it, for the message (``lagom search --profile``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the schema's line; or, for a plan, ``<path> looks like a plan (it has entries,
            no samples); <command> reads profiles``.
    """
    from lagom_megatron.cli.schemas import load_profile

    return _load(load_profile, path, "plan", f"{path} looks like a plan (it has entries, no samples); {command} reads "
                 "profiles (a plan is read by lagom plan show | diff | validate | export)")


def _load(loader, path: str, other: str, message: str):
    """``loader(path)``; its ValueError becomes ``message`` when the file is plainly ``other``."""
    try:
        return loader(path)
    except ValueError:
        if _kind(path) == other:
            raise ValueError(message) from None
        raise


def _kind(path: str) -> str | None:
    """``profile``, ``plan`` or None (neither plainly, or unreadable: the schema's error stands)."""
    from lagom_megatron.engine.files import read_json

    try:
        data: Any = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if "samples" in data and "entries" not in data:
        return "profile"
    if "entries" in data and "samples" not in data:
        return "plan"
    return None
