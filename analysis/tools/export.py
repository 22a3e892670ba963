"""Per-head export: one file per (layer, head[, sequence]) for tools that want plain tables.

The probe workflow researchers know from go-mlx writes one CSV per head, ``L{layer:02d}-H{head:02d}.csv``;
`export_heads` writes that (or ``.npy`` / ``.npz`` / ``.parquet``) head by head, so memory holds one head at a
time whatever the file size.

Columns: ``seq``, ``position``, then ``k_0 .. k_{k_dim-1}`` and ``v_0 .. v_{v_dim-1}`` as float32
(a quantized layer dequantized). ``keys="pre_rope"`` un-rotates K with the file's RoPE description.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import kvformat
from kvformat.errors import UnknownNameError
from kvformat.io.outputs import check_output_folder, files_into

from ..dependencies import pa, pa_csv, pq
from ..stats.rope import Rope

FORMATS = ("csv", "npy", "npz", "parquet")


def _selection(requested: Iterable[int] | None, available: int, what: str) -> list[int]:
    if requested is None:
        return list(range(available))
    chosen = sorted(set(requested))
    bad = [i for i in chosen if not 0 <= i < available]
    if bad:
        raise kvformat.OutOfRangeError(f"{what} {bad[0]} out of range 0..{available - 1}")
    return chosen


def _file_name(layer: int, head: int, seq: int, num_seqs: int, extension: str) -> str:
    suffix = f"-S{seq:02d}" if num_seqs > 1 else ""
    return f"L{layer:02d}-H{head:02d}{suffix}.{extension}"


def _write(path: Path, fmt: str, seq: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if fmt == "npy":  # three arrays beside each other: NAME.k.npy, NAME.v.npy, NAME.positions.npy
        stem = path.with_suffix("")
        for part, array in (("k", k), ("v", v), ("positions", positions)):
            np.save(f"{stem}.{part}.npy", array)
        return
    if fmt == "npz":
        np.savez(path, seq=np.full(positions.size, seq, np.int64), positions=positions, k=k, v=v)
        return

    columns: dict[str, Any] = {"seq": np.full(positions.size, seq, np.int64), "position": positions}
    columns.update({f"k_{i}": k[:, i] for i in range(k.shape[1])})
    columns.update({f"v_{i}": v[:, i] for i in range(v.shape[1])})
    table = pa.table(columns)
    if fmt == "csv":
        pa_csv.write_csv(table, path)
    else:
        pq.write_table(table, path)


def _names(name: str, fmt: str) -> list[str]:
    """The files one head's export writes (three for ``npy``)."""
    if fmt != "npy":
        return [name]
    stem = name.removesuffix(".npy")
    return [f"{stem}.{part}.npy" for part in ("k", "v", "positions")]


def export_heads(
    path: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    *,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    fmt: str = "csv",
    keys: str = "post_rope",
    snapshot: int = -1,
    storage_options: dict[str, Any] | None = None,
    force: bool = False,
) -> Iterator[Path]:
    """Write one file per (layer, head, sequence) of ``path`` into the folder ``directory``,
    yielding each file's final path as it is written; absent layers are skipped. ``fmt``:
    ``"csv"``, ``"npy"`` (``NAME.k.npy``, ``NAME.v.npy``, ``NAME.positions.npy``; the path
    yielded is ``NAME.npy``'s stem), ``"npz"`` or ``"parquet"``.

    ``directory`` may exist: only the files named above are written there, nothing else in it is
    touched. One of them that exists is refused unless ``force`` (which replaces those files
    only); the input itself is never replaced. The files are written into a temporary folder and
    moved into place once every head is written: a failure (or a generator closed early) leaves
    ``directory`` as it was."""
    if fmt not in FORMATS:
        raise UnknownNameError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if keys not in ("post_rope", "pre_rope"):
        raise UnknownNameError("keys must be 'post_rope' or 'pre_rope'")
    final = Path(directory)
    check_output_folder(final)
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        plan = _plan(snap, layers, heads, fmt)
        names = [file for *_, name in plan for file in _names(name, fmt)]
        with files_into(final, names, inputs=[path], force=force) as temporary:
            out = Path(temporary)
            ropes: dict[int, Rope | None] = {}
            for layer, head, seq, name in plan:
                if layer not in ropes:
                    ropes[layer] = _rope(snap, layer) if keys == "pre_rope" else None
                rope = ropes[layer]
                data = snap.head(layer, head, seq)
                assert data is not None
                k = np.asarray(data.k, dtype=np.float32)
                if rope is not None:
                    k = rope.rotate(k, data.positions, inverse=True)
                _write(out / name, fmt, seq, data.positions, k, np.asarray(data.v, dtype=np.float32))
                yield final / name


def _plan(
    snap: kvformat.Snapshot, layers: Iterable[int] | None, heads: Iterable[int] | None, fmt: str
) -> list[tuple[int, int, int, str]]:
    """``(layer, head, seq, file name)`` of every head to write: the present layers selected."""
    return [
        (layer, head, seq, _file_name(layer, head, seq, snap.num_seqs, fmt))
        for layer in _selection(layers, snap.num_layers, "layer")
        if snap.layers[layer].present
        for head in _selection(heads, snap.layers[layer].num_heads, "head")
        for seq in range(snap.num_seqs)
    ]


def _rope(snap: kvformat.Snapshot, layer: int) -> Rope | None:
    """The RoPE that un-rotates ``layer``'s keys (`Rope.from_metadata`)."""
    spec = snap.layers[layer]
    return Rope.from_metadata(snap.metadata, spec.attributes, spec.k_dim)
