"""Writes the flag table of a Megatron-LM checkout's parser (name, destination, default, kind,
choices) for the flags ``scripts/pretrain_gpt.py`` knows, and the Megatron-LM flags of the checkout's
GPT-3, Llama 3 and Mixtral example scripts, as the data ``tests/training/test_megatron_parity.py``
compares our parser with.

    PYTHONPATH=/path/to/Megatron-LM python scripts/megatron_lm_flag_table.py core_v0.16.1 \\
        tests/training/data/megatron_lm_flags.json --examples tests/training/data/megatron_lm_example_flags.json

The checkout must be importable (its ``megatron/training/arguments.py`` needs torch, megatron-core's
dependencies and the ``megatron-lm`` extra; triton gets the CPU stand-in of
``lagom_megatron.launch.megatron_lm_cpu``); nothing of Megatron-LM is copied, only the parser's
values and flag names. The entry for LABEL in each file is replaced; other labels are kept.
"""

from __future__ import annotations

import argparse
import enum
import json
import re
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
                table[option] = {
                    "dest": action.dest,
                    "default": _jsonable(action.default),
                    "kind": _kind(action),
                    "choices": _jsonable(list(action.choices)) if action.choices else None,
                }
    return dict(sorted(table.items()))


EXAMPLE_SCRIPTS = (
    "examples/gpt3/train_gpt3_175b_distributed.sh",
    "examples/llama/train_llama3_8b_h100_fp8.sh",
    "examples/mixtral/train_mixtral_8x7b_distributed.sh",
)
"""Megatron-LM's GPT pre-training examples (the same paths in core_v0.16.1 to core_v0.18.2)."""


def example_flags(checkout: Path, parser: argparse.ArgumentParser) -> list[str]:
    """The ``--flags`` of :data:`EXAMPLE_SCRIPTS` that ``parser`` (Megatron-LM's) defines, sorted;
    torchrun's and docker's own flags in those scripts are left out by that test."""
    known = {o for a in parser._actions for o in a.option_strings}
    words = set()
    for rel in EXAMPLE_SCRIPTS:
        path = checkout / rel
        if path.is_file():
            words |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", path.read_text()))
    return sorted(words & known)


def _update(path: Path, label: str, value) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data[label] = value
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("label", help="the checkout's tag, e.g. core_v0.16.1")
    cli.add_argument("out", type=Path, help="JSON file to update")
    cli.add_argument("--examples", type=Path, help="JSON file of the example scripts' flags to update")
    opts = cli.parse_args(argv)
    from lagom_megatron.launch.megatron_lm_cpu import import_with_triton_stand_in

    import_with_triton_stand_in()
    import megatron.training.arguments as mlm_arguments

    mlm = mlm_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    checkout = Path(mlm_arguments.__file__).resolve().parents[2]
    examples = example_flags(checkout, mlm)
    ours = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    names = ours | set(MEGATRON_LM_REFUSED) | set(examples)
    table = flag_table(mlm, names)
    _update(opts.out, opts.label, table)
    print(f"{opts.label}: {len(table)} flags -> {opts.out}")
    if opts.examples:
        _update(opts.examples, opts.label, examples)
        print(f"{opts.label}: {len(examples)} flags of {len(EXAMPLE_SCRIPTS)} example scripts -> {opts.examples}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
