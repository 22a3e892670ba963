"""Conformance: describe a `.kv` file as manifest-shaped JSON, and check readers against
``spec/vectors/manifest.json``.

The description of a file is what any reader can compute from `spec/SPEC.md` alone::

    {"version": [major, minor], "num_seqs": S, "num_snapshots": N,
     "layers": [<layer JSON as in the manifest record>], "metadata": {...},
     "snapshots": [{"metadata": {...}, "arrays": {name: sha256},
                    "heads": [{"layer", "head", "seq", "n_tokens",
                               "positions": sha256, "k": sha256, "v": sha256}, ...],
                    "queries": [{"layer", "head", "seq", "n_queries",
                                 "positions": sha256, "q": sha256}, ...],
                    "selections": [{"layer", "seq", "n_rows",
                                    "positions": sha256, "rows": sha256}, ...]}, ...]}

Hashes are SHA-256 (hex) of a canonical layout: positions as little-endian int64; K and V as the
decoded ``(n_tokens, dim)`` rows, C order, little-endian, in the layer's dtype (``float32`` /
``float16`` / ``bfloat16``; a quantized layer dequantized to its scale dtype); arrays likewise.
Heads are listed for every present layer, sequence and head (``n_tokens`` may be 0). A file a
reader must refuse is described as ``{"error": "<KVFormatError subclass name>"}``. ``queries``
(format 1.3) appears only in files with a layer that has queries, ``selections`` (1.7) only in
files with a layer whose queries have a ``selection`` (rows hashed as little-endian int32).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvformat import KVFormatError, LimitExceededError, Snapshot
from kvformat import open as open_kv
from kvformat.errors import InvalidArgumentError


def _sha(array: np.ndarray) -> str:
    canonical = np.ascontiguousarray(array)
    if canonical.dtype.byteorder == ">":
        canonical = canonical.byteswap().view(canonical.dtype.newbyteorder("<"))
    return hashlib.sha256(canonical.tobytes()).hexdigest()


# The NaN a description hashes in place of any NaN of a dequantized layer (SPEC section 17).
CANONICAL_NAN_BITS = {2: 0x7E00, 4: 0x7FC00000}  # by itemsize: float16, float32; bfloat16 below
BFLOAT16_NAN_BITS = 0x7FC0


def _canonical_nans(values: np.ndarray) -> np.ndarray:
    """``values`` with every NaN replaced by the canonical quiet NaN of its dtype: dequantizing
    (``scale * q + bias``) can produce NaNs whose payload depends on the hardware (inf x 0)."""
    nan = np.isnan(values.astype(np.float32))
    if not nan.any():
        return values
    out = np.array(values, copy=True)
    bits = out.view(np.uint16 if out.dtype.itemsize == 2 else np.uint32)
    canonical = BFLOAT16_NAN_BITS if out.dtype.name == "bfloat16" else CANONICAL_NAN_BITS[out.dtype.itemsize]
    bits[nan] = canonical
    return out


def _queries(snap: Any) -> list[dict[str, Any]]:
    """The ``queries`` of a snapshot's description (format 1.3): every layer with queries, then
    sequence, then query head, with the hashes of its positions and rows."""
    found = []
    for layer, spec in enumerate(snap.layers):
        if not spec.present or spec.queries is None:
            continue
        for seq in range(snap.num_seqs):
            for head in range(spec.queries.num_heads):
                data = snap.queries(layer, head, seq)
                found.append(
                    {
                        "layer": layer,
                        "head": head,
                        "seq": seq,
                        "n_queries": int(data.positions.size),
                        "positions": _sha(data.positions.astype("<i8")),
                        "q": _sha(data.q),
                    }
                )
    return found


def _selects(spec: Any) -> bool:
    """Whether a layer holds key selections (format 1.7)."""
    return bool(spec.present and spec.queries is not None and spec.queries.selection is not None)


def _selections(snap: Any) -> list[dict[str, Any]]:
    """The ``selections`` of a snapshot's description (format 1.7): every layer with key
    selections, then sequence, with the hashes of its positions and rows."""
    found = []
    for layer, spec in enumerate(snap.layers):
        if not _selects(spec):
            continue
        for seq in range(snap.num_seqs):
            data = snap.selection(layer, seq)
            found.append(
                {
                    "layer": layer,
                    "seq": seq,
                    "n_rows": int(data.positions.size),
                    "positions": _sha(data.positions.astype("<i8")),
                    "rows": _sha(data.rows.astype("<i4")),
                }
            )
    return found


def describe(path: str | Path, **open_options: Any) -> dict[str, Any]:
    """The manifest-shaped description of one file, or ``{"error": class name}``;
    ``open_options`` go to `kvformat.open` (e.g. ``storage_options`` for a URL)."""
    try:
        with open_kv(path, snapshot=0, **open_options) as first:
            _check_size(first)
            first.verify()  # SPEC 13.1: the whole file (steps 7-9) before any snapshot's data
            description: dict[str, Any] = {
                "version": list(first.version),
                "num_seqs": first.num_seqs,
                "num_snapshots": first.num_snapshots,
                "layers": [layer.to_json() for layer in first.layers],
                "metadata": first.metadata,
                "snapshots": [],
            }
            for index in range(first.num_snapshots):
                description["snapshots"].append(_snapshot_entry(first.select(index)))
        return description
    except KVFormatError as error:
        return {"error": type(error).__name__}


MAX_DESCRIBED_HEADS = 1 << 20
"""At most this many head entries (``heads`` and ``queries``, over every snapshot) in a
description (SPEC section 17); a file that would list more is refused after opening."""


def _check_size(snap: Snapshot) -> None:
    """`LimitExceededError` for a file whose description would list more than
    `MAX_DESCRIBED_HEADS` head entries (a valid 6 kB file of 2^20 sequences lists millions)."""
    per_snapshot = sum(
        layer.num_heads + (layer.queries.num_heads if layer.queries is not None else 0) + _selects(layer)
        for layer in snap.layers
        if layer.present
    )
    entries = per_snapshot * snap.num_seqs * snap.num_snapshots
    if entries > MAX_DESCRIBED_HEADS:
        raise LimitExceededError(
            f"its description would list {entries} head entries; the limit is 2^20 (SPEC section 17)"
        )


def _head_entry(snap: Snapshot, layer: int, head: int, seq: int) -> dict[str, Any]:
    """One head's description: token count, SHA-256 of positions, K and V (quantized parts with
    NaNs made canonical)."""
    data = snap.head(layer, head, seq)
    assert data is not None
    k, v = data.k, data.v
    if snap.layers[layer].quantization is not None:
        k, v = _canonical_nans(k), _canonical_nans(v)
    where = {"layer": layer, "head": head, "seq": seq, "n_tokens": int(data.positions.size)}
    return {**where, "positions": _sha(data.positions.astype("<i8")), "k": _sha(k), "v": _sha(v)}


def _snapshot_entry(snap: Snapshot) -> dict[str, Any]:
    """One snapshot's description: its metadata, SHA-256 of each array, each head's positions,
    K and V (quantized parts with NaNs made canonical), and the queries where the file has them."""
    heads = [
        _head_entry(snap, layer, head, seq)
        for layer, spec in enumerate(snap.layers)
        if spec.present
        for seq in range(snap.num_seqs)
        for head in range(spec.num_heads)
    ]
    arrays = {}
    for name in snap.array_names:
        value = snap.array(name)
        assert value is not None
        arrays[name] = _sha(value)
    entry: dict[str, Any] = {"metadata": snap.snapshot_metadata, "arrays": arrays, "heads": heads}
    if any(spec.queries is not None for spec in snap.layers):
        entry["queries"] = _queries(snap)
    if any(_selects(spec) for spec in snap.layers):
        entry["selections"] = _selections(snap)
    return entry


@dataclass
class Result:
    """One vector's outcome: ``passed``, and what differed when not."""

    name: str
    passed: bool
    detail: str


def first_difference(expected: Any, actual: Any, where: str = "") -> str:
    """Where ``actual`` first differs from ``expected`` (a JSON path and what was found), or ""."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        return _dict_difference(expected, actual, where)
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return f"{where}: {len(actual)} items, expected {len(expected)}"
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return ""
    return "" if expected == actual else f"{where}: {actual!r}, expected {expected!r}"


def _dict_difference(expected: dict[str, Any], actual: dict[str, Any], where: str) -> str:
    for key in sorted(set(expected) | set(actual)):
        if key not in actual:
            return f"{where}.{key}: missing"
        if key not in expected:
            return f"{where}.{key}: unexpected"
        found = first_difference(expected[key], actual[key], f"{where}.{key}")
        if found:
            return found
    return ""


def run(directory: str | Path, reader: str | None = None, *, batch: bool = False) -> list[Result]:
    """Check every vector of ``directory/manifest.json`` with our reader or ``reader`` (a
    command; ``CMD FILE`` must print the description JSON). ``batch``: one process for every
    vector, ``CMD FILE...`` printing one description a line, in order (a vector without its
    line fails)."""
    directory = Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text("utf-8"))
    entries = manifest["vectors"]
    if reader is None:
        printed: list[object] = [describe(directory / entry["file"]) for entry in entries]
    elif batch:
        printed = _batch_descriptions(reader, [directory / entry["file"] for entry in entries])
    else:
        printed = [_reader_description(reader, directory / entry["file"]) for entry in entries]
    results = []
    for entry, actual in zip(entries, printed, strict=True):
        expected = entry["expect"]
        if not isinstance(actual, dict):  # a crash is not a refusal: it fails every vector
            results.append(Result(entry["file"], False, f"no JSON object from the reader ({actual})"))
        elif "error" in expected:
            ok = actual.get("error") == expected["error"]
            detail = "" if ok else f"expected error {expected['error']}, got {actual.get('error', 'a read')}"
            results.append(Result(entry["file"], ok, detail))
        else:
            detail = first_difference(expected, actual)
            results.append(Result(entry["file"], not detail, detail))
    return results


def _reader_description(reader: str, path: Path) -> object:
    """What ``reader FILE`` printed, parsed, or a string saying why there is no description."""
    completed = _reader_run(reader, [path])
    try:
        return json.loads(completed.stdout)
    except json.JSONDecodeError:
        return f"exit {completed.returncode}"


def _batch_descriptions(reader: str, paths: list[Path]) -> list[object]:
    """What ``reader FILE...`` printed, a line per file, parsed (a string where a line is missing
    or is not JSON)."""
    completed = _reader_run(reader, paths)
    lines = completed.stdout.splitlines()
    found: list[object] = []
    for index in range(len(paths)):
        try:
            found.append(json.loads(lines[index]))
        except (IndexError, json.JSONDecodeError):
            found.append(f"line {index + 1} of the batch, exit {completed.returncode}")
    return found


def _reader_run(reader: str, paths: list[Path]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [*shlex.split(reader), *map(str, paths)], capture_output=True, text=True, timeout=120 * len(paths)
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise InvalidArgumentError(f"reader command {reader!r} failed on {paths[0].name}: {error}") from None
