"""The ``remat`` command line: ``remat demo``, ``remat bench``, ``remat profile``, ``remat plan``.

Each subcommand lives in its own private module (``remat.cli.<name>``) that
defines ``add_parser(subparsers)``; this file only dispatches, and turns every
mistake on the command line into one line on stderr and exit status 2, as pip,
ruff and torchrun do: a bad value names the flag and the values it accepts, a
misspelled option shows the subcommand's usage and the nearest option.

Examples:
    $ remat --help
    $ remat plan my_model:make --input-shape 8,128 --budget 60%
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

SUBCOMMANDS = ("demo", "bench", "profile", "plan")


class UsageError(SystemExit):
    """A mistake on the command line: its message is one line, its exit status 2.

    ``str(error)`` is the message; ``error.code`` is 2, as for argparse's own errors.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 2


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (the usage only for an unknown option)
    and whose help shows docstring markup (double backticks) as plain text."""

    def error(self, message: str) -> NoReturn:
        line = f"{self.prog}: error: {message}"
        print(line, file=sys.stderr)
        raise UsageError(line)

    def unknown_options(self, extras: list[str]) -> NoReturn:
        """Show this parser's usage and the nearest known option for each unknown one."""
        known = [s for action in self._actions for s in action.option_strings]
        hints = []
        for extra in extras:
            close = difflib.get_close_matches(extra.split("=")[0], known, n=1) if extra.startswith("-") else []
            if close:
                hints.append(f"{extra!r}: did you mean {close[0]}?")
        self.print_usage(sys.stderr)
        message = f"unrecognized arguments: {' '.join(extras)}"
        self.error(message + (" (" + "; ".join(hints) + ")" if hints else ""))

    def format_help(self) -> str:
        return super().format_help().replace("``", "")

    def format_usage(self) -> str:
        return super().format_usage().replace("``", "")


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    """The ``remat`` parser and its subcommands' parsers, by name."""
    parser = Parser(prog="remat", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"remat.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"remat.cli.{name}":
                raise
            continue
        module.add_parser(subparsers)
    return parser, dict(subparsers.choices)


def _joined_values(argv: list[str]) -> list[str]:
    """``--budget -10%`` as ``--budget=-10%``: argparse reads a value that starts with a dash
    as an option ("expected one argument"); joined, the flag's own check refuses it."""
    out = []
    for i, item in enumerate(argv):
        if i and argv[i - 1] in _VALUE_FLAGS and item.startswith("-") and out and out[-1] == argv[i - 1]:
            out[-1] = f"{out[-1]}={item}"
        else:
            out.append(item)
    return out


_VALUE_FLAGS = ("--budget", "--input-shape", "--throughput")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``remat`` command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    Raises:
        UsageError: a mistake on the command line (exit status 2), printed on stderr first.
    """
    parser, commands = build_parser()
    args, extras = parser.parse_known_args(_joined_values(sys.argv[1:] if argv is None else list(argv)))
    if extras:
        commands[args.command].unknown_options(extras)
    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return int(args.run(args) or 0)
    except UsageError:
        raise
    except SystemExit as exit:  # a subcommand's "remat plan: --budget ..." message
        if not isinstance(exit.code, str):
            raise
        print(exit.code, file=sys.stderr)
        raise UsageError(exit.code) from None


if __name__ == "__main__":
    sys.exit(main())
