"""`kvsnap view`: the attention explorer, served locally or written as one page."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from kvformat.errors import InvalidArgumentError
from kvsnap.errors import OptionsConflictError

from ..viewer.data import Source
from ..viewer.page import write_html
from ..viewer.server import ViewerServer
from .common import FromArgs, url_options


def _indices(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgumentError(f"{text!r}: give comma-separated numbers, e.g. 0,5,12") from None


@dataclass(frozen=True)
class ViewOptions(FromArgs):
    """``kvsnap view``'s options, typed (`from_args`)."""

    files: list[str] = field(default_factory=list)
    html: str | None = None
    layers: str | None = None
    heads: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    no_browser: bool = False
    force: bool = False


def view_command(args: argparse.Namespace) -> int:
    """Serve the viewer (and open the browser), or with ``--html`` write the page."""
    options = ViewOptions.from_args(args)
    if len(options.files) > 2:
        raise InvalidArgumentError("kvsnap view takes one file, or two to compare")
    if not options.html and (options.layers or options.heads):
        which = "--layers" if options.layers else "--heads"
        raise OptionsConflictError(
            f"{which} chooses the maps a --html page holds; the served viewer shows every layer and head"
        )
    if options.html:
        count = write_html(
            options.files,
            options.html,
            layers=_indices(options.layers),
            heads=_indices(options.heads),
            force=options.force,
            storage_options=url_options(args),
        )
        print(f"wrote {options.html}: {count} attention map(s); open it in a browser, no server needed")
        return 0
    return _serve(options, args)


def _serve(options: ViewOptions, args: argparse.Namespace) -> int:
    """Serve the viewer until Ctrl-C: the files opened and checked before the URL is given out."""
    if options.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"kvsnap: warning: serving on {options.host}: anyone who can reach it and has the URL's token "
            "can read these files",
            file=sys.stderr,
        )
    sources = [Source(path, url_options(args)) for path in options.files]
    for source in sources:  # opened (and checked) before the URL is given out
        source.snap  # noqa: B018
    server = ViewerServer(sources, options.host, options.port)
    print(f"kvsnap view: {server.url}  (Ctrl-C stops it)", flush=True)
    if not options.no_browser:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("\nkvsnap view: stopped", file=sys.stderr)
    finally:
        server.server_close()
        for source in server.sources:
            source.close()
    return 0
