"""The command-line reference page (``docs/cli.md``), generated from the parsers themselves, so it
cannot go stale: ``python -m kvsnap.cli.reference > docs/cli.md``; a test holds the committed
page equal to what this prints."""

from __future__ import annotations

import argparse
import os
import sys

WIDTH = "100"  # argparse wraps help at the terminal's width: a fixed one, for a stable page


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser by its name (an alias, which shares its command's parser, left out)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            named: dict[str, argparse.ArgumentParser] = {}
            for name, sub in action.choices.items():
                if all(sub is not other for other in named.values()):
                    named[name] = sub
            return named
    return {}


def page() -> str:
    """The reference as Markdown: every command's help, in the order ``kvsnap --help`` lists them."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        from kvsnap.cli import build_parser

        parser = build_parser()
        parts = [
            "# CLI reference\n",
            "Generated from the command's own parsers (`python -m kvsnap.cli.reference`); every "
            "command takes `--help` too.\n",
            "```text\n" + parser.format_help().replace("python -m kvsnap.cli.reference", "kvsnap") + "```\n",
        ]
        for name, sub in _subcommands(parser).items():
            text = sub.format_help().replace("python -m kvsnap.cli.reference", "kvsnap")
            parts.append(f"## `kvsnap {name}`\n\n```text\n{text}```\n")
        return "\n".join(parts)
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


if __name__ == "__main__":
    sys.stdout.write(page())
