"""Command line: ``attngeom <command> ...`` (or ``python -m attngeom``). Each command lives in
:mod:`attngeom.commands`; a command module imports torch, transformers, pandas and matplotlib only
inside its ``run``, so ``--help`` and argument errors answer at once."""

from __future__ import annotations

import argparse
import importlib
import sys

from attngeom.errors import AttngeomError

COMMANDS = ("analyze", "faithfulness", "sinks", "selection", "heads", "explore", "compare", "claims", "kvcache", "kvtasks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attngeom", description="Geometry-aware analysis of attention in Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:      # a command whose module is missing fails here, at start-up, never silently dropped
        importlib.import_module(f"attngeom.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AttngeomError as e:
        say(f"attngeom {args.command}: error: {e}")
        return 2
    except KeyboardInterrupt:
        say(f"attngeom {args.command}: {interrupted_message(getattr(args, 'out', None))}")
        return 130


def say(line: str) -> None:
    """Write one line to stderr in a single write, so that the lines of several ranks sharing a
    pipe (torchrun) never interleave mid-line (``print`` writes the text and the newline apart)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def interrupted_message(out) -> str:
    """What Ctrl-C leaves behind: every corpus command checkpoints its finished units."""
    where = f"{out}/checkpoint" if out else "the output directory's checkpoint"
    return f"interrupted; finished units are kept in {where} and rerunning the same command resumes"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
