"""Rebuild the golden conformance vectors and ``manifest.json`` deterministically.

    python spec/vectors/generate.py [OUTPUT_DIR]      # default: this directory

Every file is written by `kvformat` from fixed seeds, so the output is byte-for-byte stable;
``tests/spec/test_conformance.py`` checks that the committed files equal a fresh run. Each vector
covers one feature of spec/SPEC.md; the manifest gives, per file, what it covers and the
description a conforming reader must produce (`kvsnap.cli.conformance.describe`).
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import kvformat
from kvformat.checksum import crc32c
from kvformat.layout import DESCRIPTOR_DTYPE, DESCRIPTOR_SIZE, FOOTER_SIZE, KIND_SNAPSHOT, Footer
from kvformat.manifest import Pooled, QuerySpec
from kvformat.quantization import Quantization
from kvformat.rewrite import as_triples, empty_chunks, rebuild_index
from kvsnap.cli.conformance import describe

HERE = Path(__file__).resolve().parent


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _kv(
    seed: int, heads: int, tokens: int, k_dim: int, v_dim: int, dtype: object
) -> tuple[np.ndarray, np.ndarray]:
    rng = _rng(seed)
    k = rng.standard_normal((heads, tokens, k_dim)).astype(dtype)
    v = rng.standard_normal((heads, tokens, v_dim)).astype(dtype)
    return k, v


def dtype_codec(dtype: object, codec: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        k, v = _kv(1, 2, 9, 8, 8, dtype)
        kvformat.save(path, [kvformat.Layer(k, v)], codec=codec, chunk_bytes=4 * 8 * np.dtype(dtype).itemsize)

    return build


def rotating(path: Path) -> None:
    """A sliding-window layer: keep 2 + window 5 after 40 tokens, beside a full layer."""
    k, v = _kv(2, 2, 40, 8, 8, np.float16)
    positions = np.concatenate([[0, 1], np.arange(35, 40)])
    kvformat.save(
        path,
        [
            kvformat.Layer(k, v, attributes={"kind": "full"}),
            kvformat.Layer(
                k[:, positions].copy(),
                v[:, positions].copy(),
                positions=positions,
                attributes={"kind": "sliding", "window": 5, "keep": 2},
            ),
        ],
    )


def batch(path: Path) -> None:
    """Two sequences of different lengths (left padding removed)."""
    k0, v0 = _kv(3, 2, 6, 8, 8, np.float32)
    k1, v1 = _kv(4, 2, 3, 8, 8, np.float32)
    kvformat.save(path, [kvformat.Layer([k0, k1], [v0, v1], positions=[np.arange(6), np.arange(3)])])


def absent_and_dims(path: Path) -> None:
    """An absent (recurrent) layer between layers whose K and V head dims differ."""
    k, v = _kv(5, 2, 4, 16, 8, ml_dtypes.bfloat16)
    kvformat.save(path, [kvformat.Layer(k, v), None, kvformat.Layer(k[:, :2].copy(), v[:, :2].copy())])


def empty_and_one(path: Path) -> None:
    """A layer holding one token and a layer holding none."""
    k, v = _kv(6, 1, 1, 8, 8, np.float32)
    spec = kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32)
    with kvformat.Writer(path, [spec, spec]) as writer:
        writer.append(0, k, v, [7])


def unicode_metadata(path: Path) -> None:
    k, v = _kv(7, 1, 2, 8, 8, np.float16)
    metadata = {"prompt": "Ünïcödé ✓ 日本語 \U0001f9ea", "nested": {"list": [1, 2.5, None, True]}}
    kvformat.save(path, [kvformat.Layer(k, v)], metadata=metadata)


def quantized(path: Path) -> None:
    """A natively quantized layer (4-bit affine, groups of 32, float16 scales and biases)."""
    q = Quantization(bits=4, group_size=32)
    rng = _rng(8)
    words, groups = q.widths(64)
    parts = tuple(
        (
            rng.integers(0, 2**32, (2, 5, words), dtype=np.uint32),
            rng.standard_normal((2, 5, groups)).astype(np.float16),
            rng.standard_normal((2, 5, groups)).astype(np.float16),
        )
        for _ in range(2)
    )
    spec = kvformat.LayerSpec(2, 64, 64, kvformat.FLOAT16, quantization=q)
    with kvformat.Writer(path, [spec]) as writer:
        writer.append(0, parts[0], parts[1])


def series(path: Path) -> None:
    """Three snapshots as deltas: append, append + window drop, and a last-logits array."""
    k, v = _kv(9, 2, 12, 8, 8, np.float32)
    spec = kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT32)
    with kvformat.Writer(path, [spec], metadata={"model": "tiny"}) as writer:
        writer.append(0, k[:, :6], v[:, :6])
        writer.snapshot({"step": 0})
        writer.append(0, k[:, 6:10], v[:, 6:10])
        writer.drop(0, 1, 4)
        writer.snapshot({"step": 1})
        writer.append(0, k[:, 10:], v[:, 10:])
        logits = _rng(10).standard_normal((1, 11)).astype(np.float32)
        writer.snapshot({"step": 2}, arrays={"last_logits": logits})


def recurrent_state(path: Path) -> None:
    """SPEC 15.4 (1.6): a hybrid model's file. Layer 0 is recurrent (absent, no K/V): its state
    is a convolution window ``(1, 3, 6)`` float32 and an SSM state ``(1, 2, 4, 3)`` bfloat16 with
    a head axis, stored as arrays ``state/0/0``, ``state/0/1/0`` and ``state/0/1/1`` attached to
    each snapshot; layer 1 holds K/V. Two snapshots, each with its own copy of the state."""
    rng = _rng(21)
    k, v = _kv(22, 2, 5, 8, 8, np.float16)
    described = [
        {"shape": [1, 3, 6], "dtype": "float32", "heads": None, "role": "conv"},
        {"shape": [1, 2, 4, 3], "dtype": "bfloat16", "heads": 2, "role": "ssm"},
    ]
    specs = [
        kvformat.LayerSpec.absent({"kind": "recurrent", "cache_class": "ArraysCache", "state": described}),
        kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT16, attributes={"kind": "full"}),
    ]

    def state() -> dict[str, np.ndarray]:
        conv = rng.standard_normal((3, 6)).astype(np.float32)
        ssm = rng.standard_normal((1, 2, 4, 3)).astype(ml_dtypes.bfloat16)
        return {"state/0/0": conv, **{f"state/0/1/{h}": ssm[:, h].reshape(4, 3) for h in range(2)}}

    with kvformat.Writer(path, specs, metadata={"model": {"architecture": "hybrid"}}) as writer:
        writer.append(1, k[:, :4], v[:, :4])
        writer.snapshot({"tokens": [[1, 2, 3, 4]]}, arrays=state())
        writer.append(1, k[:, 4:], v[:, 4:])
        writer.snapshot({"tokens_appended": [[5]]}, arrays=state())


def queries_chunked(path: Path) -> None:
    """1.6: chunked attention (Llama 4's local layers): 10 queries of a layer whose queries
    object has ``chunk`` 4 (each query sees the keys of its own block of 4 positions), with the
    required feature ``chunked-attention``."""
    k, v = _kv(23, 1, 10, 8, 8, np.float32)
    q = _rng(24).standard_normal((2, 10, 8)).astype(np.float32)
    chunked = QuerySpec(num_heads=2, dim=8, dtype=kvformat.FLOAT32, scale=0.25, kv_heads=(0, 0), chunk=4)
    attributes = {"kind": "chunked", "chunk_size": 4}
    spec = kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32, attributes=attributes, queries=chunked)
    with kvformat.Writer(path, [spec]) as writer:
        writer.append(0, k, v)
        writer.append_queries(0, q, np.arange(10))
        writer.snapshot({"step": 0})


def queries_latent(path: Path) -> None:
    """1.6: multi-head latent attention in absorbed form (DeepSeek-V3): one "head" whose K slot
    holds a 6-wide latent and V slot a 2-wide RoPE key; 3 query heads of 8 = 6 + 2, ``latent``
    true, and the required feature ``latent-attention``."""
    k, v = _kv(25, 1, 7, 6, 2, np.float32)
    q = _rng(26).standard_normal((3, 7, 8)).astype(np.float32)
    latent = QuerySpec(num_heads=3, dim=8, dtype=kvformat.FLOAT32, scale=0.3, kv_heads=(0, 0, 0), latent=True)
    attributes = {"kind": "latent", "k_holds": "kv_latent", "v_holds": "k_rope"}
    spec = kvformat.LayerSpec(1, 6, 2, kvformat.FLOAT32, attributes=attributes, queries=latent)
    with kvformat.Writer(path, [spec]) as writer:
        writer.append(0, k, v)
        writer.append_queries(0, q, np.arange(7))
        writer.snapshot({"step": 0})


def _sparse_spec() -> kvformat.LayerSpec:
    """One KV head of 8, two query heads reading it, key selections 3 wide (1.7)."""
    sparse = QuerySpec(num_heads=2, dim=8, dtype=kvformat.FLOAT32, scale=0.25, kv_heads=(0, 0), selection=3)
    return kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32, queries=sparse)


def queries_sparse(path: Path) -> None:
    """1.7: sparse attention (DeepSeek-V3.2's indexer): 9 keys, queries at every position, key
    selections 3 wide for positions 4..8 (positions 0..3 attend every visible key; position 4's
    row names a future key, which visibility leaves out), over two snapshots, with the required
    feature ``sparse-attention``."""
    k, v = _kv(27, 1, 9, 8, 8, np.float32)
    q = _rng(28).standard_normal((2, 9, 8)).astype(np.float32)
    rows = np.array([[0, 2, 5], [1, 3, 5], [0, 5, 6], [2, 4, 7], [0, 7, 8]])
    with kvformat.Writer(path, [_sparse_spec()]) as writer:
        writer.append(0, k[:, :6], v[:, :6])
        writer.append_queries(0, q[:, :6], np.arange(6))
        writer.append_selection(0, rows[:2], np.arange(4, 6))
        writer.snapshot({"step": 0})
        writer.append(0, k[:, 6:], v[:, 6:])
        writer.append_queries(0, q[:, 6:], np.arange(6, 9))
        writer.append_selection(0, rows[2:], np.arange(6, 9))
        writer.snapshot({"step": 1})


def queries_pooled(path: Path) -> None:
    """1.8: pooled keys (DeepSeek-V4.1's compressed attention): layer 0 holds 10 keys and a window
    of 4, with sinks; three query heads read KV head 0 there and, in one softmax, layer 1's pooled
    keys (5 groups of 2 positions, group g whole from position 2g + 1); selection rows 2 wide from
    position 3 name groups (position 4's names group 3, not yet whole; positions 0..2 read every
    whole group), over two snapshots, with the required feature ``pooled-attention``."""
    k, v = _kv(31, 1, 10, 8, 8, np.float32)
    pooled_k, pooled_v = _kv(32, 1, 5, 8, 8, np.float32)
    q = _rng(33).standard_normal((3, 10, 8)).astype(np.float32)
    spec = QuerySpec(
        num_heads=3,
        dim=8,
        dtype=kvformat.FLOAT32,
        scale=0.3,
        kv_heads=(0, 0, 0),
        window=4,
        sinks=(0.5, -1.0, 0.0),
        selection=2,
        pooled=Pooled(layer=1, ratio=2),
    )
    layers = [
        kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32, {"kind": "sliding", "window": 4}, queries=spec),
        kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32, {"kind": "pooled", "ratio": 2}),
    ]
    rows = np.array([[0, 1], [1, 3], [0, 2], [1, 2], [2, 3], [0, 3], [3, 4]])
    with kvformat.Writer(path, layers) as writer:
        writer.append(0, k[:, :6], v[:, :6])
        writer.append(1, pooled_k[:, :3], pooled_v[:, :3])
        writer.append_queries(0, q[:, :6], np.arange(6))
        writer.append_selection(0, rows[:3], np.arange(3, 6))
        writer.snapshot({"step": 0})
        writer.append(0, k[:, 6:], v[:, 6:])
        writer.append(1, pooled_k[:, 3:], pooled_v[:, 3:], np.arange(3, 5))
        writer.append_queries(0, q[:, 6:], np.arange(6, 10))
        writer.append_selection(0, rows[3:], np.arange(6, 10))
        writer.snapshot({"step": 1})


def _pooled_source(out: Path) -> Path:
    """The golden ``queries-pooled.kv`` beside ``bad/``."""
    return out.parent.parent / "queries-pooled.kv"


def _pooled_in_absent_layer(out: Path) -> None:
    """queries-pooled.kv whose ``pooled`` names a third layer, absent."""

    def edit(document: dict[str, Any]) -> None:
        document["manifest"]["layers"].append({"present": False, "attributes": {}})
        document["manifest"]["layers"][0]["queries"]["pooled"] = {"layer": 2, "ratio": 2}

    rebuild_index(_pooled_source(out), out, edit_json=edit)


def _raw_selection(path: Path, rows: np.ndarray, positions: np.ndarray, *, twice: bool = False) -> None:
    """A file of one sparse layer whose selection chunk holds ``rows`` exactly as given
    (bypassing the writer's sorting and checks); ``twice``: the chunk written twice."""
    from kvformat.layout import KIND_SELECTION

    k, v = _kv(29, 1, 6, 8, 8, np.float32)
    q = _rng(30).standard_normal((2, 6, 8)).astype(np.float32)
    spec = _sparse_spec()
    assert spec.queries is not None
    with kvformat.Writer(path, [spec]) as writer:
        writer.append(0, k, v)
        writer.append_queries(0, q, np.arange(6))
        table = rows.astype("<i4")[None]
        for _ in range(2 if twice else 1):
            writer._run(writer._query_parts(0, 0, spec.queries, table, positions, KIND_SELECTION))
        writer.snapshot({"step": 0})


def optional_feature(path: Path) -> None:
    """A file naming an optional feature this reader does not know: it must still read."""
    k, v = _kv(11, 1, 3, 8, 8, np.float32)
    spec = kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32)
    with kvformat.Writer(path, [spec], optional_features=["x-future-hint"]) as writer:
        writer.append(0, k, v)


def queries(path: Path) -> None:
    """Format 1.3: queries of a layer (GQA 4:2, float16, a window of 6 keeping 1, sink logits)
    over two snapshots (the second inherits the first's), and a layer without queries."""
    k, v = _kv(12, 2, 10, 8, 8, np.float16)
    q = _rng(13).standard_normal((4, 10, 8)).astype(np.float16)
    spec = kvformat.LayerSpec(
        2,
        8,
        8,
        kvformat.FLOAT16,
        queries=QuerySpec(
            num_heads=4,
            dim=8,
            dtype=kvformat.FLOAT16,
            scale=0.25,
            kv_heads=(0, 0, 1, 1),
            window=6,
            keep=1,
            softcap=None,
            sinks=(0.5, -0.25, 1.0, 0.0),
        ),
    )
    plain = kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT16)
    with kvformat.Writer(path, [spec, plain], metadata={"queries": "window:3"}) as writer:
        writer.append(0, k[:, :7], v[:, :7])
        writer.append(1, k[:1, :7], v[:1, :7])
        writer.append_queries(0, q[:, 4:7], np.arange(4, 7))
        writer.snapshot({"step": 0})
        writer.append(0, k[:, 7:], v[:, 7:])
        writer.append(1, k[:1, 7:], v[:1, 7:])
        writer.append_queries(0, q[:, 7:], np.arange(7, 10))
        writer.snapshot({"step": 1})


def _three_steps(path: Path) -> None:
    """One head over three snapshots (raw float32): tokens 0-2, then 3, then 4-5; chunks K, V of
    each in turn (0-1, 2-3, 4-5). The source of the empty-run vectors."""
    k, v = _kv(14, 1, 6, 4, 4, np.float32)
    spec = kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32)
    with kvformat.Writer(path, [spec], codec="raw") as writer:
        for first, stop in ((0, 3), (3, 4), (4, 6)):
            writer.append(0, k[:, first:stop], v[:, first:stop])
            writer.snapshot({"tokens": stop})


def _empty_runs(empty_at: int, drop: bool) -> Callable[[Path], None]:
    """`_three_steps` with snapshot 1's chunks made 0-row chunks at ``empty_at`` and snapshot 2's
    run moved to positions 3-4 (with ``drop``, snapshot 2 first drops positions 4-9)."""

    def build(path: Path) -> None:
        source = path.with_name(path.name + ".source")
        _three_steps(source)

        def add_drop(document: dict[str, Any]) -> None:
            if drop:
                document["snapshots"][2]["drop"] = [[0, 0, 4, 10]]

        try:
            empty_chunks(source, path, {2: empty_at, 3: empty_at}, moves={4: 3, 5: 3}, edit_json=add_drop)
        finally:
            source.unlink()

    return build


def empty_query_chunk(path: Path) -> None:
    """`queries` with the Q chunk of layer 0, query head 0 that snapshot 1 adds made a chunk of 0
    rows at position 5, which snapshot 0's chunk of that head covers (4-6)."""
    source = path.with_name(path.name + ".source")
    queries(source)
    try:
        with kvformat.open(source) as snap:
            table = snap._file.table
            ranges = snap._file.entries[1].query_ranges
            added = [c for first, stop in ranges.tolist() for c in range(first, stop)]
            chunk = next(c for c in added if table["head"][c] == 0 and table["layer"][c] == 0)
        empty_chunks(source, path, {chunk: 5})
    finally:
        source.unlink()


def _queries_key(**changes: object) -> Callable[[dict[str, Any]], None]:
    """Set (value not None) or remove (None) keys of layer 0's ``queries`` object."""

    def edit(document: dict[str, Any]) -> None:
        spec = document["manifest"]["layers"][0]["queries"]
        for key, value in changes.items():
            if value is None:
                spec.pop(key, None)
            else:
                spec[key] = None if value == "null" else value

    return edit


def _queries_variant(**changes: object) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        source = path.with_name(path.name + ".source")
        queries(source)
        try:
            rebuild_index(source, path, edit_json=_queries_key(**changes))
        finally:
            source.unlink()

    return build


def _absent_layer_with_queries(path: Path) -> None:
    """float32-raw with a second, absent layer whose (malformed) ``queries`` is ignored."""
    source = path.with_name(path.name + ".source")
    dtype_codec(np.float32, "raw")(source)

    def edit(document: dict[str, Any]) -> None:
        document["manifest"]["layers"].append({"present": False, "queries": {"num_heads": "many"}})

    try:
        rebuild_index(source, path, edit_json=edit)
    finally:
        source.unlink()


def _tiny_number(path: Path) -> None:
    """float32-raw with file metadata holding 1e-400: it rounds to 0, a double holds that."""
    source = path.with_name(path.name + ".source")
    dtype_codec(np.float32, "raw")(source)
    try:
        rebuild_index(source, path, edit_json=_with_metadata('{"tiny": 1e-400}'))
    finally:
        source.unlink()


VECTORS: list[tuple[str, str, Callable[[Path], None]]] = [
    ("float32-raw.kv", "float32, raw codec, 4-token chunks", dtype_codec(np.float32, "raw")),
    ("float16-zstd.kv", "float16, zstd codec", dtype_codec(np.float16, "zstd:3")),
    (
        "bfloat16-byteplane.kv",
        "bfloat16, byteplane-zstd codec",
        dtype_codec(ml_dtypes.bfloat16, "byteplane-zstd"),
    ),
    ("rotating.kv", "non-contiguous positions (sliding window with keep)", rotating),
    ("batch.kv", "two sequences of different lengths", batch),
    ("absent-and-dims.kv", "absent layer; K and V head dims differ; bfloat16", absent_and_dims),
    ("empty-and-one.kv", "a one-token layer and an empty layer", empty_and_one),
    ("unicode-metadata.kv", "unicode and nested JSON metadata", unicode_metadata),
    ("quantized.kv", "4-bit affine quantized layer (dequantized hashes)", quantized),
    ("series.kv", "three snapshots as deltas, a drop, an array", series),
    ("optional-feature.kv", "unknown optional feature: must read", optional_feature),
    (
        "recurrent-state.kv",
        "1.6: a recurrent layer's state as snapshot arrays (section 15.4)",
        recurrent_state,
    ),
    (
        "queries-chunked.kv",
        "1.6: chunked attention, queries 'chunk' 4 and its required feature",
        queries_chunked,
    ),
    (
        "queries-latent.kv",
        "1.6: latent (MLA) attention, queries 'latent' and its required feature",
        queries_latent,
    ),
    (
        "queries-sparse.kv",
        "1.7: sparse attention, queries 'selection' 3, selection chunks and the required feature",
        queries_sparse,
    ),
    (
        "queries-pooled.kv",
        "1.8: pooled keys, queries 'pooled' (layer 1, ratio 2) with a window, sinks and selection "
        "rows naming groups, and the required feature",
        queries_pooled,
    ),
    ("queries.kv", "format 1.3 queries: GQA, window with keep, sinks, two snapshots", queries),
    # SPEC 1.4 clarifications: one vector for each reading that could go either way.
    (
        "empty-runs.kv",
        "append_chunks ranges holding 0-row K and V chunks: an empty run at position 3, where a "
        "later run (3-4) starts",
        _empty_runs(3, drop=False),
    ),
    (
        "drop-removes-empty-run.kv",
        "a drop of positions 4-9 removes an empty run at 4; the run appended after it covers 3-4",
        _empty_runs(4, drop=True),
    ),
    (
        "empty-query-chunk.kv",
        "a 0-row Q chunk at a position another Q chunk of its head covers: it holds no position",
        empty_query_chunk,
    ),
    (
        "queries-defaults.kv",
        "a queries object without window, keep, softcap and sinks: null, 0, null, null",
        _queries_variant(window=None, keep=None, softcap=None, sinks=None),
    ),
    (
        "queries-keep-without-window.kv",
        "keep 3 with window null: allowed, without effect",
        _queries_variant(window=None, keep=3),
    ),
    ("queries-in-absent-layer.kv", "an absent layer's queries object is ignored", _absent_layer_with_queries),
    ("tiny-number.kv", "metadata holding 1e-400, which rounds to 0: valid", _tiny_number),
]


def _older(source: Path, out: Path, minor: int) -> None:
    """``source`` as a writer of version 1.``minor`` (before 1.2) wrote it: header and footer
    minor ``minor``, appends as triples."""
    patched = out.with_suffix(".tmp")
    _patched(source, patched, 10, struct.pack("<H", minor), header_crc=True)
    as_triples(patched, out)
    patched.unlink()


def _patched(source: Path, out: Path, offset: int, value: bytes, header_crc: bool = False) -> None:
    data = bytearray(source.read_bytes())
    data[offset : offset + len(value)] = value
    if header_crc:
        struct.pack_into("<I", data, 60, crc32c(bytes(data[:60])))
    out.write_bytes(bytes(data))


def _set(field: str, row: int, value: int) -> Callable[[np.ndarray], None]:
    def edit(table: np.ndarray) -> None:
        table[field][row] = value

    return edit


def _copy_offset(table: np.ndarray) -> None:
    table["offset"][1] = table["offset"][0]


def _last_ranges(document: dict[str, Any]) -> list[int]:
    ranges: list[int] = document["snapshots"][-1]["append_chunks"]
    return ranges


def _first_payload(path: Path) -> int:
    data = path.read_bytes()
    f = Footer.unpack(data[-FOOTER_SIZE:])
    table = np.frombuffer(data[f.index_offset :], DESCRIPTOR_DTYPE, count=f.chunk_count)
    return int(table["offset"][0]) + DESCRIPTOR_SIZE


def _with_metadata(text: str) -> Callable[[dict[str, Any]], bytes]:
    """An index JSON edit that puts raw JSON ``text`` as the file metadata (what json.dumps cannot
    write: repeated names, out-of-range numbers)."""

    def edit(document: dict[str, Any]) -> bytes:
        document["manifest"]["metadata"] = {"placeholder": 0}
        return json.dumps(document).replace('{"placeholder": 0}', text).encode()

    return edit


def _layer_key(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        document["manifest"]["layers"][0][key] = value

    return edit


def _json_record_flags(source: Path, out: Path) -> None:
    """The first snapshot record of the stream (kind 17) with ``flags`` 1 and its descriptor CRC
    recomputed: only a verification's check of JSON records can refuse it."""
    _json_record_field(source, out, "flags", 1)


def _json_record_field(source: Path, out: Path, name: str, value: int) -> None:
    """The first snapshot record of the stream (kind 17) with descriptor field ``name`` set to
    ``value`` and its descriptor CRC recomputed."""
    data = bytearray(source.read_bytes())
    f = Footer.unpack(bytes(data[-FOOTER_SIZE:]))
    offset = 64
    while offset < f.index_offset:
        descriptor = np.frombuffer(bytes(data[offset : offset + DESCRIPTOR_SIZE]), DESCRIPTOR_DTYPE).copy()
        if int(descriptor[0]["kind"]) == KIND_SNAPSHOT:
            descriptor[0][name] = value
            data[offset : offset + 60] = descriptor.tobytes()[:60]
            data[offset + 60 : offset + 64] = struct.pack("<I", crc32c(bytes(data[offset : offset + 60])))
            out.write_bytes(bytes(data))
            return
        end = offset + DESCRIPTOR_SIZE + int(descriptor[0]["stored_size"])
        offset = (end + 63) // 64 * 64
    raise AssertionError("no snapshot record")


def _two_faults(source: Path, out: Path, table_fault: Callable[[np.ndarray], None] | None) -> None:
    """A snapshot that names a chunk past the table (R13, found at step 8 of SPEC section 13.1)
    plus an earlier fault: a chunk table limit (step 5) when ``table_fault`` is given, else a
    flipped payload byte (step 7)."""
    rebuild_index(
        source,
        out,
        edit_table=table_fault,
        edit_json=lambda d: d["snapshots"][0].__setitem__("append", [10**6, 0, 1]),
    )
    if table_fault is None:
        _patched(out, out, _first_payload(out), bytes([out.read_bytes()[_first_payload(out)] ^ 0x10]))


def _without_feature(name: str) -> Callable[[Path, Path], None]:
    """The golden file ``name`` (beside ``bad/``) with ``required_features`` cut to
    ``["queries"]``."""

    def edit(document: dict[str, Any]) -> None:
        document["manifest"]["required_features"] = ["queries"]

    return lambda _s, out: rebuild_index(out.parent.parent / name, out, edit_json=edit)


BAD: list[tuple[str, str, Callable[[Path, Path], None]]] = [
    (
        "truncated-footer.kv",
        "the last 10 bytes are missing",
        lambda s, o: o.write_bytes(s.read_bytes()[:-10]),
    ),
    (
        "index-past-eof.kv",
        "footer index offset beyond the end of the file",
        lambda s, o: rebuild_index(s, o, footer={"index_offset": 10**9}),
    ),
    (
        "overlapping-chunks.kv",
        "chunk 1 claims chunk 0's bytes",
        lambda s, o: rebuild_index(s, o, edit_table=_copy_offset),
    ),
    (
        "shape-overflow.kv",
        "rows x width x itemsize far above the payload",
        lambda s, o: rebuild_index(s, o, edit_table=_set("rows", 0, 2**32 - 1)),
    ),
    (
        "decoded-size-mismatch.kv",
        "declared decoded size disagrees with rows x width",
        lambda s, o: rebuild_index(s, o, edit_table=_set("decoded_size", 0, 2**40)),
    ),
    (
        "checksum-mismatch.kv",
        "one payload byte flipped",
        lambda s, o: _patched(s, o, _first_payload(s), bytes([s.read_bytes()[_first_payload(s)] ^ 0x10])),
    ),
    (
        "major-version-2.kv",
        "format major version 2",
        lambda s, o: _patched(s, o, 8, struct.pack("<H", 2), header_crc=True),
    ),
    (
        "unknown-required-feature.kv",
        "a required feature this reader does not know",
        lambda s, o: rebuild_index(
            s, o, edit_json=lambda d: d["manifest"].__setitem__("required_features", ["time-travel"])
        ),
    ),
    (
        "duplicate-entries.kv",
        "the same chunks appended twice",
        lambda s, o: rebuild_index(
            s,
            o,
            edit_json=lambda d: _last_ranges(d).extend(_last_ranges(d)),
        ),
    ),
    (
        "duplicate-triples.kv",
        "the same segment listed twice as (chunk, row, count) triples",
        lambda s, o: rebuild_index(
            s, o, edit_json=lambda d: d["snapshots"][-1]["append"].extend([0, 0, 1, 1, 0, 1])
        ),
    ),
    (
        "append-chunks-undeclared.kv",
        "a snapshot uses append_chunks; required_features does not list append-chunks",
        lambda s, o: rebuild_index(
            s, o, edit_json=lambda d: d["manifest"].__setitem__("required_features", [])
        ),
    ),
    (
        "append-chunks-past-table.kv",
        "an append_chunks range ends past the chunk table",
        lambda s, o: rebuild_index(s, o, edit_json=lambda d: _last_ranges(d).__setitem__(1, 10**6)),
    ),
    (
        "invalid-utf8-metadata.kv",
        "index JSON that is not UTF-8",
        lambda s, o: rebuild_index(s, o, edit_json=lambda d: b'{"manifest": "\xff\xfe"}'),
    ),
    (
        "lone-surrogate-metadata.kv",
        "an unpaired UTF-16 surrogate escape in metadata",
        lambda s, o: rebuild_index(
            s,
            o,
            edit_json=lambda d: (
                json.dumps({**d, "manifest": {**d["manifest"], "metadata": {"note": "@"}}})
                .replace('"@"', '"\\ud800"')
                .encode()
            ),
        ),
    ),
    (
        "footer-version-mismatch.kv",
        "the footer says version 1.3, the header 1.2",
        lambda s, o: rebuild_index(s, o, footer={"minor": 3}),
    ),
    (
        "absurd-layer-count.kv",
        "70,000 layers declared",
        lambda s, o: rebuild_index(
            s, o, edit_json=lambda d: d["manifest"].__setitem__("layers", [{"present": False}] * 70000)
        ),
    ),
    (
        "absurd-head-count.kv",
        "300 layers of 65,536 heads: 19.7 million (layer, head, sequence) triples",
        lambda s, o: rebuild_index(
            s,
            o,
            edit_json=lambda d: d["manifest"].__setitem__(
                "layers",
                [{"present": True, "num_heads": 65536, "k_dim": 1, "v_dim": 1, "dtype": "float32"}] * 300,
            ),
        ),
    ),
    (
        "absurd-chunk-count.kv",
        "footer chunk count 2^40",
        lambda s, o: rebuild_index(s, o, footer={"chunk_count": 2**40}),
    ),
    (
        "queries-undeclared.kv",
        "a layer with queries, 'queries' missing from required_features",
        lambda s, o: rebuild_index(
            _queries_source(o), o, edit_json=lambda d: d["manifest"].__setitem__("required_features", [])
        ),
    ),
    (
        "queries-not-q-chunks.kv",
        "a snapshot's 'queries' range names K and V chunks",
        lambda s, o: rebuild_index(
            _queries_source(o), o, edit_json=lambda d: d["snapshots"][1].__setitem__("queries", [0, 2])
        ),
    ),
    (
        "queries-twice.kv",
        "the second snapshot adds the first one's queries again: positions twice",
        lambda s, o: rebuild_index(
            _queries_source(o),
            o,
            edit_json=lambda d: d["snapshots"][1].__setitem__(
                "queries", d["snapshots"][1]["queries"] + d["snapshots"][0]["queries"]
            ),
        ),
    ),
    (
        "queries-head-out-of-range.kv",
        "a Q chunk of query head 4 in a layer of 4 query heads",
        lambda s, o: rebuild_index(_queries_source(o), o, edit_table=_query_head(4)),
    ),
    # SPEC 1.4: rules the readers disagreed on, and the limit that counts query heads.
    (
        "empty-run-inside.kv",
        "an empty run at position 4, inside the run 3-4 appended after it: position 4 twice",
        lambda s, o: _empty_runs(4, drop=False)(o),
    ),
    (
        "position-overflow.kv",
        "head 0's last K and V chunk (1 row) at position 2^63 - 1: position + rows is past 2^53 "
        "(and wraps in 64 bits)",
        lambda s, o: _at_the_end_of_int64(s, o),
    ),
    (
        "queries-window-over-2-53.kv",
        "queries window 2^53 + 1",
        lambda s, o: _queries_variant(window=2**53 + 1)(o),
    ),
    (
        "queries-keep-over-2-53.kv",
        "queries keep 2^53 + 1 (a value outside 10.1's rules: corrupt, not a limit)",
        lambda s, o: _queries_variant(keep=2**53 + 1, window=None)(o),
    ),
    (
        "quantization-bits.kv",
        "a layer quantized with 3 bits (outside 6.1's set: corrupt, not a feature)",
        lambda s, o: rebuild_index(
            s, o, edit_json=_layer_key("quantization", {"mode": "affine", "bits": 3, "group_size": 32})
        ),
    ),
    (
        "quantized-dims-and-queries.kv",
        "a quantized layer whose dims are not multiples of the group (corrupt) and whose queries "
        "num_heads is 0 (a limit): the quantization is checked first",
        lambda s, o: _queries_layer_faults(o),
    ),
    (
        "query-heads-over-limit.kv",
        "2^20 sequences x (2 KV heads + 16 query heads): over 2^24 triples once query heads count",
        lambda s, o: _query_heads_over_limit(o),
    ),
    # Readings that could go either way (SPEC 1.3 clarifications): one vector each.
    (
        "short-bad-magic.kv",
        "100 bytes that do not start with the magic: the magic is checked before the size",
        lambda s, o: o.write_bytes(b"not a kv file, " + s.read_bytes()[15:100]),
    ),
    (
        "short-good-magic.kv",
        "the first 40 bytes of a file: magic right, too short",
        lambda s, o: o.write_bytes(s.read_bytes()[:40]),
    ),
    (
        "duplicate-name.kv",
        "file metadata holding the name 'note' twice",
        lambda s, o: rebuild_index(s, o, edit_json=_with_metadata('{"note": 1, "note": 2}')),
    ),
    (
        "number-overflow.kv",
        "file metadata holding 1e400, a number no double holds",
        lambda s, o: rebuild_index(s, o, edit_json=_with_metadata('{"scale": 1e400}')),
    ),
    (
        "unknown-quantization-mode.kv",
        "a layer quantized with mode 'nf4'",
        lambda s, o: rebuild_index(
            s, o, edit_json=_layer_key("quantization", {"mode": "nf4", "bits": 4, "group_size": 32})
        ),
    ),
    (
        "unknown-dtype-name.kv",
        "a layer of dtype 'float8'",
        lambda s, o: rebuild_index(s, o, edit_json=_layer_key("dtype", "float8")),
    ),
    (
        "zero-heads.kv",
        "a present layer of 0 heads (below the range)",
        lambda s, o: rebuild_index(s, o, edit_json=_layer_key("num_heads", 0)),
    ),
    (
        "json-record-flags.kv",
        "a snapshot record in the stream with flags 1 (its descriptor CRC valid)",
        _json_record_flags,
    ),
    (
        "table-and-snapshot-faults.kv",
        "a chunk of 2^32-1 rows (limit, step 5) and a snapshot naming a chunk past the table (step 8)",
        lambda s, o: _two_faults(s, o, _set("rows", 0, 2**32 - 1)),
    ),
    (
        "record-and-snapshot-faults.kv",
        "a flipped payload byte (checksum, step 7) and a snapshot naming a chunk past the table (step 8)",
        lambda s, o: _two_faults(s, o, None),
    ),
    # What a third reader of 1.4 found (kvformat read these otherwise than the SPEC's text).
    (
        "queries-scale-huge-integer.kv",
        "queries scale written as a 401-digit integer: a number no double holds, as 1e400 (section 2)",
        lambda s, o: _queries_variant(scale=10**400)(o),
    ),
    (
        "queries-sinks-huge-integer.kv",
        "a queries sinks entry written as a 401-digit integer",
        lambda s, o: _queries_variant(sinks=[0.5, -(10**400), 0.25, 0.0])(o),
    ),
    (
        "quantization-null.kv",
        "a present layer's quantization null: the key is typed object, null is no absence (section 10)",
        lambda s, o: rebuild_index(s, o, edit_json=_layer_key("quantization", None)),
    ),
    (
        "queries-null.kv",
        "a present layer's queries null, in a file that requires the queries feature",
        lambda s, o: _queries_null(o),
    ),
    (
        "record-and-arrays-faults.kv",
        "a flipped payload byte (checksum, step 7) and snapshot 0's arrays naming a K chunk, which "
        "materialization finds (step 9)",
        lambda s, o: _checksum_and_arrays(s, o),
    ),
    # Silences of 1.4 answered in 1.5 (section 14, "Changes in 1.5").
    (
        "quantization-mode-missing.kv",
        "a quantization object without 'mode': a shape fault, corrupt (an unknown mode is unsupported)",
        lambda s, o: rebuild_index(s, o, edit_json=_layer_key("quantization", {"bits": 4, "group_size": 32})),
    ),
    (
        "quantization-mode-number.kv",
        "a quantization 'mode' that is a number, not a string: corrupt",
        lambda s, o: rebuild_index(
            s, o, edit_json=_layer_key("quantization", {"mode": 1, "bits": 4, "group_size": 32})
        ),
    ),
    (
        "json-record-sizes.kv",
        "a snapshot record in the stream whose decoded_size is not its stored_size (descriptor CRC valid)",
        lambda s, o: _json_record_field(s, o, "decoded_size", 1),
    ),
    (
        "description-over-limit.kv",
        "queries.kv with 2^20 sequences: within the triple limit (6 x 2^20), valid, but its "
        "description would list 2 x 6 x 2^20 head entries, over 2^20 (section 17)",
        lambda s, o: _many_sequences(o),
    ),
    (
        "unknown-record-kind-minor-5.kv",
        "a record of kind 20 in the stream of a minor-5 file: a 1.5 reader knows every kind of "
        "1.5 and rejects it (R8); only a newer minor's unknown kinds are ignored",
        lambda s, o: _unknown_record(s, o, 5),
    ),
    (
        "queries-chunk-zero.kv",
        "1.6: queries-chunked.kv with 'chunk' 0 (outside 1..2^53: corrupt)",
        lambda s, o: rebuild_index(_chunked_source(o), o, edit_json=_queries_key(chunk=0)),
    ),
    (
        "queries-chunk-and-window.kv",
        "1.6: queries-chunked.kv with a 'window' beside its 'chunk' (never both: corrupt)",
        lambda s, o: rebuild_index(_chunked_source(o), o, edit_json=_queries_key(window=8)),
    ),
    (
        "queries-chunk-without-feature.kv",
        "1.6: queries-chunked.kv without 'chunked-attention' in required_features (a reader that "
        "ignored 'chunk' would misread it): corrupt",
        _without_feature("queries-chunked.kv"),
    ),
    (
        "queries-latent-dim.kv",
        "1.6: queries-latent.kv with queries 'dim' 6, not k_dim + v_dim = 8: corrupt",
        lambda s, o: rebuild_index(_latent_source(o), o, edit_json=_queries_key(dim=6)),
    ),
    (
        "queries-latent-without-feature.kv",
        "1.6: queries-latent.kv without 'latent-attention' in required_features: corrupt",
        _without_feature("queries-latent.kv"),
    ),
    (
        "queries-selection-without-feature.kv",
        "1.7: queries-sparse.kv without 'sparse-attention' in required_features (a reader that "
        "ignored 'selection' would compute attention over keys the model never read): corrupt",
        _without_feature("queries-sparse.kv"),
    ),
    (
        "queries-selection-zero.kv",
        "1.7: queries-sparse.kv with 'selection' 0 (outside 1..2^20: corrupt)",
        lambda s, o: rebuild_index(_sparse_source(o), o, edit_json=_queries_key(selection=0)),
    ),
    (
        "selection-width.kv",
        "1.7: queries-sparse.kv with 'selection' 4 while its selection chunks are 3 wide: corrupt",
        lambda s, o: rebuild_index(_sparse_source(o), o, edit_json=_queries_key(selection=4)),
    ),
    (
        "selection-head.kv",
        "1.7: a selection chunk with head 1 (selections are per layer: head 0): corrupt",
        lambda s, o: rebuild_index(_sparse_source(o), o, edit_table=_selection_chunk("head", 1)),
    ),
    (
        "selection-dtype.kv",
        "1.7: a selection chunk of dtype float32 (code 1, same size) instead of int32: corrupt",
        lambda s, o: rebuild_index(_sparse_source(o), o, edit_table=_selection_chunk("dtype", 1)),
    ),
    (
        "selection-row-order.kv",
        "1.7: a selection row [2, 0, 1], not in increasing order (CRCs valid): corrupt",
        lambda s, o: _raw_selection(o, np.array([[0, 1, 3], [2, 0, 1]]), np.arange(4, 6)),
    ),
    (
        "selection-position-twice.kv",
        "1.7: two selection chunks of layer 0 both holding positions 4 and 5: corrupt",
        lambda s, o: _raw_selection(o, np.array([[0, 1, 3], [0, 1, 2]]), np.arange(4, 6), twice=True),
    ),
    (
        "queries-pooled-without-feature.kv",
        "1.8: queries-pooled.kv without 'pooled-attention' in required_features (a reader that "
        "ignored 'pooled' would leave keys out of the softmax): corrupt",
        _without_feature("queries-pooled.kv"),
    ),
    (
        "queries-pooled-null.kv",
        "1.8: queries-pooled.kv with 'pooled' null (the key is typed object): corrupt",
        lambda s, o: rebuild_index(_pooled_source(o), o, edit_json=_queries_key(pooled="null")),
    ),
    (
        "queries-pooled-ratio-zero.kv",
        "1.8: queries-pooled.kv with 'pooled' ratio 0 (outside 1..2^53): corrupt",
        lambda s, o: rebuild_index(
            _pooled_source(o), o, edit_json=_queries_key(pooled={"layer": 1, "ratio": 0})
        ),
    ),
    (
        "queries-pooled-self.kv",
        "1.8: queries-pooled.kv whose 'pooled' names its own layer 0: corrupt",
        lambda s, o: rebuild_index(
            _pooled_source(o), o, edit_json=_queries_key(pooled={"layer": 0, "ratio": 2})
        ),
    ),
    (
        "queries-pooled-absent.kv",
        "1.8: queries-pooled.kv whose 'pooled' names a layer that is absent: corrupt",
        lambda s, o: _pooled_in_absent_layer(o),
    ),
    (
        "index-offset-below-64.kv",
        "footer index_offset 0: aligned, but inside the header (R4: corrupt, as a misaligned one)",
        lambda s, o: rebuild_index(s, o, footer={"index_offset": 0}),
    ),
]


def _with_minor(source: Path, out: Path, minor: int) -> None:
    """``source`` with header and footer minor ``minor`` (CRCs recomputed)."""
    staged = out.with_name(out.name + ".minor")
    _patched(source, staged, 10, struct.pack("<H", minor), header_crc=True)
    rebuild_index(staged, out, footer={"minor": minor})
    staged.unlink()


def _unknown_record(source: Path, out: Path, minor: int) -> None:
    """``source`` at minor ``minor`` with its stream's snapshot record turned into a record of
    kind 20, which no version defines (the index keeps the snapshot)."""
    staged = out.with_name(out.name + ".kind")
    _with_minor(source, staged, minor)
    _json_record_field(staged, out, "kind", 20)
    staged.unlink()


def _many_sequences(out: Path) -> None:
    rebuild_index(_queries_source(out), out, edit_json=lambda d: d["manifest"].__setitem__("num_seqs", 2**20))


def _queries_null(out: Path) -> None:
    def edit(document: dict[str, Any]) -> None:
        document["manifest"]["layers"][0]["queries"] = None

    rebuild_index(_queries_source(out), out, edit_json=edit)


def _checksum_and_arrays(source: Path, out: Path) -> None:
    rebuild_index(source, out, edit_json=lambda d: d["snapshots"][0].__setitem__("arrays", {"x": 0}))
    _patched(out, out, _first_payload(out), bytes([out.read_bytes()[_first_payload(out)] ^ 0x10]))


def _at_the_end_of_int64(source: Path, out: Path) -> None:
    """``source`` (float32-raw) with chunks 4 and 5, head 0's last K and V (1 row each), at
    position ``2^63 - 1``, in the stream and the table alike."""
    empty_chunks(source, out, {}, moves={4: 2**63 - 1, 5: 2**63 - 1})


def _queries_layer_faults(out: Path) -> None:
    def edit(document: dict[str, Any]) -> None:
        layer = document["manifest"]["layers"][0]
        layer["quantization"] = {"mode": "affine", "bits": 4, "group_size": 64}
        layer["queries"]["num_heads"] = 0

    rebuild_index(_queries_source(out), out, edit_json=edit)


def _query_heads_over_limit(out: Path) -> None:
    def edit(document: dict[str, Any]) -> None:
        document["manifest"]["num_seqs"] = 2**20
        spec = document["manifest"]["layers"][0]["queries"]
        spec.update(num_heads=16, kv_heads=[0] * 16, sinks=None)

    rebuild_index(_queries_source(out), out, edit_json=edit)


def _latent_source(out: Path) -> Path:
    """The golden ``queries-latent.kv`` beside ``bad/``."""
    return out.parent.parent / "queries-latent.kv"


def _chunked_source(out: Path) -> Path:
    """The golden ``queries-chunked.kv`` beside ``bad/``."""
    return out.parent.parent / "queries-chunked.kv"


def _sparse_source(out: Path) -> Path:
    """The golden ``queries-sparse.kv`` beside ``bad/``."""
    return out.parent.parent / "queries-sparse.kv"


def _selection_chunk(field: str, value: int) -> Callable[[np.ndarray], None]:
    def edit(table: np.ndarray) -> None:
        table[field][np.flatnonzero(table["kind"] == 4)[0]] = value

    return edit


def _queries_source(out: Path) -> Path:
    """The golden ``queries.kv`` beside ``bad/``."""
    return out.parent.parent / "queries.kv"


def _query_head(value: int) -> Callable[[np.ndarray], None]:
    def edit(table: np.ndarray) -> None:
        table["head"][np.flatnonzero(table["kind"] == 3)[0]] = value

    return edit


def newer_minor(directory: Path) -> Callable[[Path], None]:
    """Version 1.9 of the format with an unknown optional feature and unknown JSON keys: a 1.0
    reader must read it (SPEC section 14)."""

    def build(path: Path) -> None:
        source = path.with_suffix(".tmp")
        _patched(directory / "optional-feature.kv", source, 10, struct.pack("<H", 9), header_crc=True)

        def extend(document: dict[str, Any]) -> None:
            document["manifest"]["optional_features"] = ["x-future-hint", "x-attention-stats"]
            document["manifest"]["x_future_key"] = {"x": 1}
            document["x_future_top"] = 3

        rebuild_index(source, path, edit_json=extend)
        source.unlink()

    return build


def older_minor(directory: Path) -> Callable[[Path], None]:
    """A file as a 1.0 writer wrote it (header and footer minor 0, appends as triples): every
    later 1.x reader reads it (SPEC section 14)."""
    return lambda path: _older(directory / "float32-raw.kv", path, 0)


def older_series(directory: Path) -> Callable[[Path], None]:
    """``series.kv`` as a 1.1 writer wrote it: every append a (chunk, row, count) triple."""
    return lambda path: _older(directory / "series.kv", path, 1)


def generate(directory: Path) -> dict[str, object]:
    """Write every vector into ``directory`` and return the manifest (also written there)."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    vectors = [
        *VECTORS,
        (
            "newer-minor.kv",
            "format 1.9, unknown optional feature and keys: must read",
            newer_minor(directory),
        ),
        ("older-minor.kv", "format 1.0 (before the 1.1 rules): must read", older_minor(directory)),
        (
            "newer-minor-unknown-record.kv",
            "format 1.9 with a record of kind 20 in the stream: ignored (section 5.2)",
            lambda path: _unknown_record(directory / "float32-raw.kv", path, 9),
        ),
        ("series-1.1.kv", "series.kv as format 1.1 wrote it: appends as triples", older_series(directory)),
    ]
    for name, covers, build in vectors:
        path = directory / name
        path.unlink(missing_ok=True)
        build(path)
        entries.append({"file": name, "covers": covers, "expect": describe(path)})
    (directory / "bad").mkdir(exist_ok=True)
    source = directory / "float32-raw.kv"
    for name, breaks, build_bad in BAD:
        path = directory / "bad" / name
        build_bad(source, path)
        expect = describe(path)
        if "error" not in expect:
            raise AssertionError(f"bad vector {name} reads as valid")
        entries.append({"file": f"bad/{name}", "covers": breaks, "expect": expect})
    manifest = {"format_version": [1, 8], "hash": "sha256", "vectors": entries}
    (directory / "manifest.json").write_text(
        json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", "utf-8"
    )
    return manifest


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
