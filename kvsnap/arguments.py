"""argparse types and options that every stage's commands share: checked numbers (one line naming
the rule, never a traceback), ``--storage-option KEY=VALUE`` for remote files, and `typed` (a
namespace as a command's options dataclass). Below the stages: `kvsnap.capture` and
`kvsnap.analysis` build their commands from it, and the shell (`kvsnap.cli`) above them."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, TypeVar


def _integer(text: str, minimum: int, rule: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
    return value


def _number(text: str, valid: Callable[[float], bool], rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or not valid(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, 1, "at least 1")


def odd_int(text: str) -> int:
    """argparse type: an odd integer >= 1."""
    value = _integer(text, 1, "at least 1")
    if value % 2 == 0:
        raise argparse.ArgumentTypeError(f"must be odd, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "0 or more")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number(text, lambda value: value > 0, "a number above 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(text, lambda value: value >= 0, "0 or more")


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    return _number(text, lambda value: 0 <= value <= 1, "in 0..1")


def storage_options(items: Sequence[str] | None) -> dict[str, Any] | None:
    """``KEY=VALUE`` strings (``--storage-option``) as fsspec options; VALUE is parsed as JSON
    when it is JSON (``anon=true``, ``client_kwargs={"region_name": "eu-west-1"}``)."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            from kvformat.errors import InvalidArgumentError  # here: this module loads before numpy

            raise InvalidArgumentError(f"--storage-option wants KEY=VALUE, not {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options or None


def remote_options(p: argparse.ArgumentParser) -> None:
    """Add ``--storage-option KEY=VALUE`` (repeatable) to ``p``."""
    p.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="for a URL: fsspec option (endpoint_url=..., anon=true) or headers={...} for HTTP; repeatable",
    )


T = TypeVar("T")


def typed(kind: type[T], args: argparse.Namespace) -> T:
    """A command's options dataclass ``kind`` from argparse's namespace: the fields its parser
    declares, the others at their defaults."""
    given = vars(args)
    return kind(**{f.name: given[f.name] for f in fields(kind) if f.name in given})  # type: ignore[arg-type]
