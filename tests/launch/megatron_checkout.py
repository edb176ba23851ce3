"""The Megatron-LM checkout ``MEGATRON_LM_DIR`` names, for the tests that need one: they skip, with the reason, when it
is unset or names no checkout (a wrong path is not a failure of lagom); a checkout that holds none of ``patches/``
fails them (``test_megatron_patches.py``: exactly one must be applied)."""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT_FILES = ("pretrain_gpt.py", "megatron/core", "megatron/training")
"""What every Megatron-LM release the patches cover has at its root."""


def megatron_lm_checkout(environ=None) -> tuple[Path | None, str]:
    """(the checkout, "") or (None, why the tests that need one skip)."""
    environ = os.environ if environ is None else environ
    value = environ.get("MEGATRON_LM_DIR")
    if not value:
        return None, "MEGATRON_LM_DIR is not set: it names a Megatron-LM checkout with one of patches/ applied"
    path = Path(value).expanduser()
    if not path.is_dir():
        return None, f"MEGATRON_LM_DIR={value!r} is not a folder: give a Megatron-LM checkout, or unset it"
    missing = [name for name in CHECKOUT_FILES if not (path / name).exists()]
    if missing:
        return None, (
            f"MEGATRON_LM_DIR={value!r} is not a Megatron-LM checkout (it has no {', '.join(missing)}): give one, "
            "or unset it"
        )
    return path.resolve(), ""
