"""The ``lagom`` command; subcommand modules (``add_arguments``, ``run``) import anything heavy in ``run`` only."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable

from lagom_megatron import __version__

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "search": ("search", "search a plan from a profile file"),
    "plan": ("plan", "show, diff, validate or export plan files"),
    "bench": ("bench", "benchmarks: search scaling, simulated cluster comparison"),
    "simulate": ("simulate", "run profile -> fit -> search -> apply -> verify on a simulated GPU cluster"),
    "doctor": ("doctor", "pre-flight checks of a preset or command line and the environment"),
    "build-tuner": ("build_tuner", "build the NCCL tuner plugin shared library"),
    "calibrate": ("calibrate", "fit the simulator's contention or bandwidth constants on your own GPUs"),
}


class LagomParser(argparse.ArgumentParser):
    """argparse's parser with a one-line usage error ``<prog>: error: <message>``, exit status 2."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {_missing_choice(self, message) or message} (see {self.prog} --help)\n")


_REQUIRED = "the following arguments are required: "


def _missing_choice(parser: argparse.ArgumentParser, message: str) -> str | None:
    """``no <name> given; give one of <choices>`` for the first missing positional with choices, or None."""
    if not message.startswith(_REQUIRED):
        return None
    missing = message[len(_REQUIRED) :].split(", ")
    for action in parser._actions:  # argparse names a missing argument by its metavar, else its dest
        name = argparse._get_action_name(action)
        if not action.option_strings and action.choices and name in missing:
            return f"no {name.lower()} given; give one of {', '.join(action.choices)}"
    return None


def _load(module: str):
    return importlib.import_module(f"lagom_megatron.cli.{module}")


def build_parser(commands: Iterable[str] = tuple(SUBCOMMANDS)) -> argparse.ArgumentParser:
    """The top-level parser; the subcommands in ``commands`` get their module's arguments (each imports it)."""
    parser = LagomParser(
        prog="lagom",
        description="Lagom for Megatron-Core: per-collective NCCL configurations for overlapped communication.",
    )
    parser.add_argument("--version", action="version", version=f"lagom-megatron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=LagomParser, required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in commands:
            mod = _load(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (``lagom`` has no option with a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def one_line(message: str) -> str:
    """``message`` joined on one line; blank and caret-only lines (PyYAML's excerpts) dropped."""
    lines = (line.strip() for line in message.splitlines())
    return " ".join(line for line in lines if line and set(line) != {"^"})


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lagom``: 0 done, 1 the thing checked failed, 2 bad usage or input, 130 interrupted."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    try:  # Ctrl-C at any point, start-up included: files are written atomically, so nothing half-written is left
        # only the named subcommand's module is imported: `lagom --help` and `--version` import none
        parser = build_parser([command] if command in SUBCOMMANDS else [])
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version, or a usage error already printed on one line
            return exc.code if isinstance(exc.code, int) else 2
        return _run(args)
    except KeyboardInterrupt:
        print(f"lagom{' ' + command if command in SUBCOMMANDS else ''}: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # e.g. `lagom plan show plan.json | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as exc:
        print(f"lagom {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
