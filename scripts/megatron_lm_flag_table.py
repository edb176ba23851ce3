"""Writes the flag table of a Megatron-LM checkout's parser (name, destination, default, kind,
choices) for the flags ``scripts/pretrain_gpt.py`` knows, as the data ``tests/training/
test_megatron_parity.py`` compares our parser with.

    PYTHONPATH=/path/to/Megatron-LM python scripts/megatron_lm_flag_table.py core_v0.16.1 \\
        tests/training/data/megatron_lm_flags.json

The checkout must be importable (its ``megatron/training/arguments.py`` needs torch, megatron-core's
dependencies and six, regex, einops, tqdm, triton); nothing of Megatron-LM is copied, only the
parser's values. The entry for LABEL in OUT is replaced; other labels are kept.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lagom_megatron.engine.files import write_text_atomic  # noqa: E402
from lagom_megatron.training.arguments import MEGATRON_LM_REFUSED, build_parser  # noqa: E402


def _jsonable(value):
    if isinstance(value, enum.Enum):  # AttnBackend.auto -> "auto", as our parser spells it
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "store_true"
    if isinstance(action, argparse._StoreFalseAction):
        return "store_false"
    return "store"


def flag_table(parser: argparse.ArgumentParser, names: set[str]) -> dict[str, dict]:
    """``{flag: {dest, default, kind, choices}}`` of ``parser`` for the option strings in ``names``."""
    table = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option in names:
                table[option] = {"dest": action.dest, "default": _jsonable(action.default), "kind": _kind(action),
                                 "choices": _jsonable(list(action.choices)) if action.choices else None}
    return dict(sorted(table.items()))


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("label", help="the checkout's tag, e.g. core_v0.16.1")
    cli.add_argument("out", type=Path, help="JSON file to update")
    opts = cli.parse_args(argv)
    from megatron.training.arguments import add_megatron_arguments

    mlm = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ours = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    names = ours | set(MEGATRON_LM_REFUSED)
    data = json.loads(opts.out.read_text()) if opts.out.exists() else {}
    data[opts.label] = flag_table(mlm, names)
    write_text_atomic(opts.out, json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{opts.label}: {len(data[opts.label])} flags -> {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
