"""Command line: ``attngeom <command> ...``. Each command lives in :mod:`attngeom.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import AttngeomError

COMMANDS = ("analyze", "faithfulness", "sinks", "selection", "heads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attngeom", description="Geometry-aware analysis of attention in Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"attngeom.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"attngeom.commands.{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AttngeomError as e:
        print(f"attngeom {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attngeom {args.command}: interrupted; what was finished is kept in the output directory "
              "and the same command resumes from it", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
