"""MkDocs hook: the Python API page's ``<!-- api: NAME -->`` markers (HTML comments, which GitHub
shows as nothing, so the page reads as its tables there) become mkdocstrings' ``::: NAME``
directives on the site, each rendering NAME's docstring."""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^<!-- api: ([\w.]+) -->$", flags=re.M)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "api.md":
        return markdown
    return MARKER.sub(lambda match: f"::: {match.group(1)}", markdown)
