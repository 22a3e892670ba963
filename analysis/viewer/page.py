"""The viewer's page: one HTML document with its stylesheet and script inline (plain ES, a canvas
per view, no libraries to fetch), served by `server` or written whole by `write_html` with its
data embedded (no server needed: it opens from disk). Data from a file is JSON inside a
``<script type="application/json">`` element with ``<``, ``>`` and ``&`` escaped, and the script
puts text on the page only through ``textContent``: a prompt holding markup shows as text."""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

from kvformat.io.outputs import output_path

from . import data


def _json_for_html(value: Any) -> str:
    text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _static(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text("utf-8")


EMBEDDED_POINTS = 4096
"""The most keys (and queries) of a head's query-key projection a standalone page holds."""


def render(embedded: dict[str, Any] | None, config: dict[str, Any]) -> str:
    """The page: served (``embedded`` None: the script asks the server, ``config`` carries the
    token) or standalone (``embedded``: every answer the page can show, precomputed)."""
    return (
        _static("viewer.html")
        .replace("/*STYLE*/", _static("viewer.css"))
        .replace("/*SCRIPT*/", _static("viewer.js"))
        .replace("/*CONFIG*/null", _json_for_html(config))
        .replace("/*DATA*/null", _json_for_html(embedded))
    )


def write_html(
    paths: list[str],
    out: str | os.PathLike[str],
    *,
    layers: list[int] | None = None,
    heads: list[int] | None = None,
    force: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Write one self-contained page of ``paths`` (one or two files) to ``out``: the head grid for
    every score, and the maps (pooled to 256 x 512 tiles), query-key planes (at most
    `EMBEDDED_POINTS` keys) and K/V views of ``layers`` x ``heads`` (default: the first 4 layers
    and heads that hold queries, or K/V heads without). Returns the
    number of maps embedded. Written through a temporary name; an existing ``out`` only with
    ``force``; never one of ``paths``."""

    sources = [data.Source(path, storage_options) for path in paths]
    embedded: dict[str, Any] = {"files": [], "grids": {}, "maps": {}, "kv": {}, "qk": {}, "diff": None}
    count = 0
    try:
        for number, source in enumerate(sources):
            count += _embed_file(embedded, number, source, layers, heads)
        if len(sources) == 2:
            embedded["diff"] = data.difference(sources[0].snap, sources[1].snap)
        page = render(embedded, {"token": None, "files": len(sources)})
        with (
            output_path(out, inputs=paths, force=force) as temporary,
            open(temporary, "x", encoding="utf-8") as f,
        ):
            f.write(page)
    finally:
        for source in sources:
            source.close()
    return count


def _embed_file(
    embedded: dict[str, Any], number: int, source: Any, layers: list[int] | None, heads: list[int] | None
) -> int:
    """Add file ``number``'s info, head grids, maps and K/V views to ``embedded``; the maps added."""

    info = source.info()
    embedded["files"].append(info)
    present = {spec["layer"]: spec for spec in info["layers"] if spec["present"]}
    if info["has_queries"]:
        embedded["grids"][str(number)] = {score: source.grid(score) for score in data.GRID_SCORES}
    count = 0
    for layer in layers if layers is not None else list(present)[:4]:
        if layer not in present:
            raise data.ViewerError(f"layer {layer} is not a present layer of {source.path}")
        count += _embed_layer(embedded, f"{number}:{layer}", source.snap, layer, present[layer], heads)
    return count


def _embed_layer(
    embedded: dict[str, Any],
    prefix: str,
    snap: Any,
    layer: int,
    spec: dict[str, Any],
    heads: list[int] | None,
) -> int:
    """Add the maps of ``layer``'s query heads and the K/V views of its KV heads (``heads``, or
    the first 4 of each) under keys ``prefix:head``; the maps added."""

    query_heads = heads if heads is not None else list(range(min(4, spec["query_heads"])))
    query_heads = query_heads if spec["query_heads"] else []
    for head in query_heads:
        embedded["maps"][f"{prefix}:{head}"] = data.attention_map(snap, layer, head)
        embedded["qk"][f"{prefix}:{head}"] = data.qk_projection(snap, layer, head, limit=EMBEDDED_POINTS)
    kv_heads = heads if heads is not None else list(range(min(4, spec["kv_heads"])))
    for head in (h for h in kv_heads if h < spec["kv_heads"]):
        embedded["kv"][f"{prefix}:{head}"] = data.kv_view(snap, layer, head)
    return len(query_heads)
