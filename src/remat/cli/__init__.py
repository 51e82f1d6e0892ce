"""The ``remat`` command line: ``remat demo``, ``remat bench``, ``remat profile``, ``remat plan``.

Each subcommand lives in its own private module (``remat.cli.<name>``) that
defines ``add_parser(subparsers)``; this file only dispatches.

Example:
    $ remat --help
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = ("demo", "bench", "profile", "plan")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``remat`` command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = argparse.ArgumentParser(prog="remat", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"remat.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"remat.cli.{name}":
                raise
            continue
        module.add_parser(subparsers)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
