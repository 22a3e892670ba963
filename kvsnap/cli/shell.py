"""The ``kvsnap`` shell: `main`, the parser (`build_parser`) and the error policy (`_run`). The
format's commands are `format_commands`; other stages add theirs through the ``kvsnap.commands``
entry-point group (a function ``register(subparsers)``), so this module never imports them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import kvformat
from kvformat import KVFormatError, KVSnapError, OutOfRangeError
from kvsnap.errors import BUG_REPORT, CommandError

from . import format_commands


def build_parser(plugins: bool = True) -> argparse.ArgumentParser:
    """The ``kvsnap`` parser: the format's commands and the stages' (`_add_stages`; ``plugins``:
    also those installed packages declare)."""
    parser = argparse.ArgumentParser(
        prog="kvsnap", description="KV-cache snapshots: capture, inspect, analyse."
    )
    parser.add_argument("--version", action="version", version=f"kvsnap {kvformat.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    format_commands.register(sub)
    missing = _add_stages(sub, plugins)
    parser.set_defaults(stages_missing=missing, commands=frozenset(sub.choices))
    return parser


STAGES = {"capture": "kvsnap.capture.cli:register", "analysis": "kvsnap.analysis.cli:register"}
"""The stages' command modules, as pyproject's ``kvsnap.commands`` entry points name them:
loaded by module name, so a source tree on ``sys.path`` needs no installed metadata; an
installed entry point of the same name replaces one when the parser scans them (`main`)."""


def _add_stages(sub: Any, plugins: bool = True) -> list[tuple[str, str]]:
    """Add the stages' commands: `STAGES` by module name and, with ``plugins``, every stage an
    installed package declares as a ``kvsnap.commands`` entry point (one may replace a `STAGES`
    module). Returns the stages that could not be loaded, each with the module that was missing
    (their commands are unknown to this parser)."""
    targets = dict(STAGES)
    if plugins:
        from importlib import metadata

        targets.update({entry.name: entry.value for entry in metadata.entry_points(group="kvsnap.commands")})
    missing = []
    for name in sorted(targets):
        try:
            register = _load(targets[name])
        except ImportError as exc:
            missing.append((name, getattr(exc, "name", None) or str(exc)))
            continue
        register(sub)
    return missing


def _load(target: str) -> Any:
    """The object an entry point's ``module:attribute`` value names."""
    module, _, attribute = target.partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split(".") if attribute else []:
        found = getattr(found, part)
    return found


def _command(argv: Sequence[str]) -> str | None:
    """The command word of ``argv`` (its first token that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def _not_installed(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """One line for a command this parser lacks because its stage could not be loaded, or None."""
    missing = parser.get_default("stages_missing")
    command = _command(argv)
    if not missing or command is None or command in parser.get_default("commands"):
        return None
    stages = " and ".join(f"kvsnap.{name}" for name, _ in missing)
    return (
        f"kvsnap: error: {command!r} is not a format command, and the commands of {stages} are not "
        f"available ({missing[0][1]} cannot be imported); in a source tree: "
        "pip install -e '.[capture,analysis]'"
    )


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # The built-in stages first: scanning every installed package's entry points for other
    # stages imports importlib.metadata, a cost every fresh command would pay
    # (`python -m benchmarks.cli_bench`), so it is done only for a command they do not know.
    parser = build_parser(plugins=False)
    if _command(arguments) not in parser.get_default("commands"):
        parser = build_parser()
    message = _not_installed(parser, arguments)
    if message is not None:
        print(message, file=sys.stderr)
        return 2
    args = parser.parse_args(arguments)
    if not hasattr(args, "func"):
        parser.error(f"'{args.command}' needs packages that are not installed; see README")
    return _run(parser, args)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run a parsed command: its argument checks first, then the command. What kvsnap refuses on
    purpose (a `KVSnapError`), an operating-system error and a missing optional package print one
    line and exit 2 (a `CommandError`: its own status); any other exception is a bug in kvsnap:
    its traceback, then `BUG_REPORT`, exit 1."""
    check = vars(args).get("check")  # set by the commands that check their arguments first
    try:
        if check is not None:  # argument checks that need no model or file: before anything loads
            check(parser, args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\nkvsnap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (KVSnapError, OSError, ModuleNotFoundError) as exc:
        print(_error_line(exc, args.command), file=sys.stderr)
        return exc.status if isinstance(exc, CommandError) else 2
    except Exception:  # not refused on purpose: a bug in kvsnap, shown with its traceback
        traceback.print_exc()
        print(BUG_REPORT.format(command=args.command), file=sys.stderr)
        return 1


def _error_line(exc: Exception, command: str) -> str:
    """The one line a command's known error prints (exit status 2)."""
    if isinstance(exc, KVFormatError):
        return f"kvsnap: {type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError):  # an extra not installed (polars, matplotlib, mlx, ...)
        missing = exc.name or str(exc)
        return (
            f"kvsnap: error: {command} needs {missing}, which is not installed: "
            "pip install 'kvsnap[capture,analysis]'"
        )
    if isinstance(exc, OutOfRangeError):  # --snapshot, --layer, --head, --seq outside the file's range
        return f"kvsnap: error: {exc.args[0] if exc.args else exc}"
    if isinstance(exc, OSError) and exc.strerror:  # the message, without Python's "[Errno 2]"
        named = f": {exc.filename}" if exc.filename is not None else ""
        return f"kvsnap: error: {exc.strerror}{named}"
    return f"kvsnap: error: {exc}"
