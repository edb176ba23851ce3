"""Profile and plan readers over ``cli.schemas`` that say so when given a profile for a plan (or the reverse)."""

from __future__ import annotations

from typing import Any


def read_plan(path: str, command: str):
    """``schemas.load_plan(path)``; ValueError ``<path> looks like a profile ...; <command> reads plans`` for one."""
    from lagom_megatron.cli.schemas import load_plan

    return _load(load_plan, path, "profile", f"{path} looks like a profile (it has samples, no entries); {command} reads "
                 "plans (a profile is searched with lagom search --profile)")


def read_profile(path: str, command: str):
    """``schemas.load_profile(path)``; ValueError ``<path> looks like a plan ...; <command> reads profiles`` for one."""
    from lagom_megatron.cli.schemas import load_profile

    return _load(load_profile, path, "plan", f"{path} looks like a plan (it has entries, no samples); {command} reads "
                 "profiles (a plan is read by lagom plan show | diff | validate | export)")


def _load(loader, path: str, other: str, message: str):
    try:
        return loader(path)
    except ValueError:
        if _kind(path) == other:
            raise ValueError(message) from None
        raise


def _kind(path: str) -> str | None:
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
