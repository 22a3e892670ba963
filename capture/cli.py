"""``kvsnap`` subcommands of the capture stage (registered through the ``kvsnap.commands``
entry point): convert-gguf, fetch-models, capture."""

from __future__ import annotations

import argparse
from typing import Any


def _convert(args: argparse.Namespace) -> int:
    from capture.convert import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, args.dtype)
    print(f"wrote mlx-lm model directory {out}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from capture.fixtures import MODELS, cache_dir, fetch_model

    for name in args.names or list(MODELS):
        path = fetch_model(name, args.dtype)
        print(f"{name}: {path}")
    print(f"cache: {cache_dir()}")
    return 0


def register(sub: Any) -> None:
    """Add the capture commands to the ``kvsnap`` argument parser."""
    from capture.convert import DTYPES
    from capture.fixtures import MODELS

    p = sub.add_parser("convert-gguf", help="convert a GGUF model (llama, gemma3) to an mlx-lm directory")
    p.add_argument("gguf")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=DTYPES, default="float16")
    p.set_defaults(func=_convert)

    p = sub.add_parser("fetch-models", help="download, verify and convert the fixture models (cached)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(MODELS)} (default: all)")
    p.add_argument("--dtype", choices=DTYPES, default="float16")
    p.set_defaults(func=_fetch)
