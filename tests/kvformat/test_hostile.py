"""Mutation tests: truncated, bit-flipped and field-overwritten files either read back exactly
or raise a `KVFormatError` (never another exception, never a hang); `verify()` catches every
flipped bit."""

from __future__ import annotations

import hashlib
import json
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat.checksum import crc32c
from kvformat.layout import DESCRIPTOR_DTYPE, DESCRIPTOR_SIZE, FOOTER_SIZE
from kvformat.rewrite import as_triples, rebuild_index
from tests.conftest import write_series


@contextmanager
def hang_guard(seconds: int = 10) -> Iterator[None]:
    """Fail (rather than hang) if the body runs longer than ``seconds``."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"reader took longer than {seconds}s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def read_all(path: Path, verify: bool = False) -> str:
    """Digest of everything a reader can see in the file (every snapshot, head, K/V, position)."""
    digest = hashlib.sha256()
    with kvformat.open(path) as snap:
        for index in range(snap.num_snapshots):
            view = snap.select(index)
            digest.update(json.dumps([view.metadata, view.snapshot_metadata], sort_keys=True).encode())
            for seq in range(view.num_seqs):
                for head in view.heads(seq):
                    for array in (head.k, head.v, head.positions):
                        digest.update(np.ascontiguousarray(array).tobytes())
        if verify:
            snap.verify()
    return digest.hexdigest()


def outcome(path: Path, verify: bool = False) -> str:
    with hang_guard():
        try:
            return read_all(path, verify)
        except kvformat.KVFormatError as exc:
            return f"error:{type(exc).__name__}"


@pytest.fixture(params=kvformat.codecs.NAMES)
def sample(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"sample-{request.param}.kv"
    write_series(path, request.param, chunk_bytes=96)
    return path


def record_boundaries(path: Path) -> list[int]:
    with kvformat.open(path) as snap:
        table = snap._file.table
        footer = snap._file.footer
    points = {0, 8, 63, 64, footer.index_offset, path.stat().st_size - FOOTER_SIZE}
    for offset, stored in zip(table["offset"].tolist(), table["stored_size"].tolist(), strict=True):
        points.update({offset, offset + DESCRIPTOR_SIZE, offset + DESCRIPTOR_SIZE + stored})
    points.update(footer.index_offset + DESCRIPTOR_SIZE * i for i in range(len(table) + 1))
    return sorted(p for p in points if p < path.stat().st_size)


def test_truncation_at_every_boundary_and_random_points(sample: Path, tmp_path: Path) -> None:
    data = sample.read_bytes()
    rng = np.random.default_rng(7)
    cuts = record_boundaries(sample) + rng.integers(0, len(data), 40).tolist() + [len(data) - 1]
    mutant = tmp_path / "cut.kv"
    for cut in cuts:
        mutant.write_bytes(data[:cut])
        result = outcome(mutant)
        assert result.startswith("error:"), f"truncated at {cut} of {len(data)} read as valid"


def test_every_flipped_bit_is_caught_by_verify(sample: Path, tmp_path: Path) -> None:
    data = bytearray(sample.read_bytes())
    original = outcome(sample, verify=True)
    assert not original.startswith("error:")
    rng = np.random.default_rng(11)
    mutant = tmp_path / "flip.kv"
    offsets = rng.integers(0, len(data), 300).tolist() + record_boundaries(sample)
    for offset in offsets:
        bit = int(rng.integers(0, 8))
        data[offset] ^= 1 << bit
        mutant.write_bytes(data)
        data[offset] ^= 1 << bit
        read = outcome(mutant)
        assert read == original or read.startswith("error:"), f"flip at {offset} read wrong data"
        assert outcome(mutant, verify=True).startswith("error:"), f"verify missed flip at byte {offset}"


EXTREMES = [0, 1, 63, 64, 65, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**64 - 1]


def field_limit(name: str) -> int:
    return 2 ** (8 * DESCRIPTOR_DTYPE.fields[name][0].itemsize) - 1


@pytest.mark.parametrize("field", [n for n in DESCRIPTOR_DTYPE.names if n != "magic"])
def test_extreme_descriptor_fields_are_rejected_or_harmless(sample: Path, tmp_path: Path, field: str) -> None:
    original = outcome(sample)
    mutant = tmp_path / "field.kv"
    signed = DESCRIPTOR_DTYPE.fields[field][0].kind == "i"
    for value in [*EXTREMES, -1, -(2**63)]:
        if (value < 0 and not signed) or value > field_limit(field) or (signed and value >= 2**63):
            continue
        for row in (0, -1):

            def edit(table: np.ndarray, row: int = row, value: int = value) -> None:
                table[field][row] = value

            rebuild_index(sample, mutant, edit_table=edit)
            result = outcome(mutant)
            assert result == original or result.startswith("error:"), f"{field}={value} row {row}"


@pytest.mark.parametrize(
    "footer",
    [{"index_offset": v} for v in EXTREMES]
    + [{"chunk_count": v} for v in EXTREMES]
    + [{"json_size": v} for v in EXTREMES],
)
def test_extreme_footer_fields_are_rejected(sample: Path, tmp_path: Path, footer: dict) -> None:
    mutant = tmp_path / "footer.kv"
    rebuild_index(sample, mutant, footer=footer)
    original = outcome(sample)
    result = outcome(mutant)
    assert result == original or result.startswith("error:")


def set_path(document: dict, path: tuple, value: object) -> None:
    node = document
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


JSON_EDITS: list[tuple[str, Callable[[dict], object]]] = [
    ("num_heads huge", lambda d: set_path(d, ("manifest", "layers", 0, "num_heads"), 2**40)),
    ("num_heads zero", lambda d: set_path(d, ("manifest", "layers", 0, "num_heads"), 0)),
    ("num_heads string", lambda d: set_path(d, ("manifest", "layers", 0, "num_heads"), "2")),
    ("num_heads bool", lambda d: set_path(d, ("manifest", "layers", 0, "num_heads"), True)),
    ("k_dim wrong", lambda d: set_path(d, ("manifest", "layers", 0, "k_dim"), 7)),
    ("dtype unknown", lambda d: set_path(d, ("manifest", "layers", 0, "dtype"), "float8")),
    ("dtype differs", lambda d: set_path(d, ("manifest", "layers", 0, "dtype"), "float16")),
    ("layer made absent", lambda d: set_path(d, ("manifest", "layers", 0, "present"), False)),
    ("layers dropped", lambda d: set_path(d, ("manifest", "layers"), [])),
    ("layers not a list", lambda d: set_path(d, ("manifest", "layers"), {"0": 1})),
    ("too many layers", lambda d: set_path(d, ("manifest", "layers"), [{"present": False}] * 70000)),
    (
        "quantization bits 3",
        lambda d: set_path(
            d, ("manifest", "layers", 0, "quantization"), {"mode": "affine", "bits": 3, "group_size": 32}
        ),
    ),
    (
        "quantization on wrong dims",
        lambda d: set_path(
            d, ("manifest", "layers", 0, "quantization"), {"mode": "affine", "bits": 4, "group_size": 32}
        ),
    ),
    ("quantization mode", lambda d: set_path(d, ("manifest", "layers", 0, "quantization"), {"mode": "nf4"})),
    ("num_seqs zero", lambda d: set_path(d, ("manifest", "num_seqs"), 0)),
    ("num_seqs float", lambda d: set_path(d, ("manifest", "num_seqs"), 1.5)),
    ("required feature", lambda d: set_path(d, ("manifest", "required_features"), ["time-travel"])),
    ("metadata list", lambda d: set_path(d, ("manifest", "metadata"), [1, 2])),
    ("no snapshots", lambda d: set_path(d, ("snapshots",), [])),
    ("snapshots not list", lambda d: set_path(d, ("snapshots",), "x")),
    ("segment past table", lambda d: set_path(d, ("snapshots", -1, "append", 0), 10**6)),
    ("segment negative", lambda d: set_path(d, ("snapshots", -1, "append", 1), -1)),
    ("segment huge int", lambda d: set_path(d, ("snapshots", -1, "append", 2), 10**30)),
    ("segment float", lambda d: set_path(d, ("snapshots", -1, "append", 2), 1.0)),
    ("segment rows past chunk", lambda d: set_path(d, ("snapshots", -1, "append", 2), 10**6)),
    ("segment count zero", lambda d: set_path(d, ("snapshots", -1, "append", 2), 0)),
    ("parent is self", lambda d: set_path(d, ("snapshots", -1, "parent"), len(d["snapshots"]) - 1)),
    ("parent in future", lambda d: set_path(d, ("snapshots", 0, "parent"), 2)),
    ("parent string", lambda d: set_path(d, ("snapshots", -1, "parent"), "1")),
    ("drop not a list", lambda d: set_path(d, ("snapshots", -1, "drop"), 5)),
    ("drop wrong arity", lambda d: set_path(d, ("snapshots", -1, "drop"), [[0, 0, 1]])),
    ("drop bad layer", lambda d: set_path(d, ("snapshots", -1, "drop"), [[9, 0, 1, 2]])),
    ("drop reversed", lambda d: set_path(d, ("snapshots", -1, "drop"), [[0, 0, 5, 2]])),
    (
        "append re-adds parent rows",
        lambda d: d["snapshots"][1]["append"].extend(d["snapshots"][0]["append"][:6]),
    ),
    ("array names a K chunk", lambda d: set_path(d, ("snapshots", -1, "arrays"), {"x": 0})),
    ("array index not int", lambda d: set_path(d, ("snapshots", -1, "arrays"), {"x": "0"})),
    ("segments not triples", lambda d: d["snapshots"][-1]["append"].pop()),
    ("K without V", lambda d: set_path(d, ("snapshots", -1, "append"), d["snapshots"][-1]["append"][:3])),
    (
        "duplicate segment",
        lambda d: d["snapshots"][-1]["append"].extend(d["snapshots"][-1]["append"][:6]),
    ),
    (
        "V points at K",
        lambda d: set_path(d, ("snapshots", -1, "append", 3), d["snapshots"][-1]["append"][0]),
    ),
    ("snapshot metadata list", lambda d: set_path(d, ("snapshots", -1, "metadata"), [])),
    ("not an object", lambda d: [1, 2, 3]),
    ("deep nesting", lambda d: ("[" * 100000 + "]" * 100000).encode()),
    ("invalid utf-8", lambda d: b'{"manifest": "\xff\xfe"}'),
    ("NaN constant", lambda d: b'{"manifest": NaN}'),
    ("huge number", lambda d: b'{"manifest": ' + b"9" * 5000 + b"}"),
]


def test_triples_and_ranges_read_the_same(sample: Path, tmp_path: Path) -> None:
    triples = tmp_path / "triples.kv"
    as_triples(sample, triples)
    for path, ranges in ((sample, True), (triples, False)):
        with kvformat.open(path) as snap:
            assert any(e.chunk_ranges.size for e in snap._file.entries) is ranges
    assert read_all(triples, verify=True) == read_all(sample, verify=True)


@pytest.mark.parametrize("name,edit", JSON_EDITS, ids=[n for n, _ in JSON_EDITS])
def test_hostile_index_json_is_rejected(sample: Path, tmp_path: Path, name: str, edit: Callable) -> None:
    triples, mutant = tmp_path / "triples.kv", tmp_path / "json.kv"
    as_triples(sample, triples)
    assert outcome(triples).startswith("error:") is False
    rebuild_index(triples, mutant, edit_json=edit)
    assert outcome(mutant).startswith("error:"), name


def _ranges(d: dict, index: int) -> list:
    return d["snapshots"][index]["append_chunks"]


RANGE_EDITS = [
    ("range past table", lambda d: set_path(d, ("snapshots", -1, "append_chunks", 1), 10**6)),
    ("range empty", lambda d: set_path(d, ("snapshots", -1, "append_chunks", 1), _ranges(d, -1)[0])),
    ("range reversed", lambda d: set_path(d, ("snapshots", -1, "append_chunks", 1), _ranges(d, -1)[0] - 1)),
    ("range negative", lambda d: set_path(d, ("snapshots", -1, "append_chunks", 0), -1)),
    ("range float", lambda d: set_path(d, ("snapshots", -1, "append_chunks", 0), 1.0)),
    ("range not pairs", lambda d: _ranges(d, -1).pop()),
    ("range not a list", lambda d: set_path(d, ("snapshots", -1, "append_chunks"), 3)),
    ("range K without V", lambda d: set_path(d, ("snapshots", 0, "append_chunks"), [0, 1])),
    ("range re-adds parent chunks", lambda d: _ranges(d, 1).extend(_ranges(d, 0))),
    ("range and triple name one chunk", lambda d: d["snapshots"][0]["append"].extend([0, 0, 1, 1, 0, 1])),
    ("ranges undeclared", lambda d: set_path(d, ("manifest", "required_features"), [])),
]


@pytest.mark.parametrize("name,edit", RANGE_EDITS, ids=[n for n, _ in RANGE_EDITS])
def test_hostile_append_chunks_are_rejected(sample: Path, tmp_path: Path, name: str, edit: Callable) -> None:
    mutant = tmp_path / "json.kv"
    rebuild_index(sample, mutant, edit_json=edit)
    assert outcome(mutant).startswith("error:CorruptFileError"), name


def test_not_a_kv_file(tmp_path: Path) -> None:
    for content in (b"", b"x", b"PK\x03\x04" + bytes(200), bytes(1000)):
        path = tmp_path / "junk.kv"
        path.write_bytes(content)
        with pytest.raises(kvformat.KVFormatError):
            kvformat.open(path)


def test_newer_major_version_is_rejected(sample: Path, tmp_path: Path) -> None:
    data = bytearray(sample.read_bytes())
    struct.pack_into("<H", data, 8, 2)
    struct.pack_into("<I", data, 60, crc32c(bytes(data[:60])))
    (tmp_path / "v2.kv").write_bytes(data)
    with pytest.raises(kvformat.UnsupportedVersionError):
        kvformat.open(tmp_path / "v2.kv")


def test_newer_minor_version_with_unknown_keys_is_read(sample: Path, tmp_path: Path) -> None:
    """Compatibility rule: a newer minor version is read; unknown keys and optional features
    are ignored."""
    data = bytearray(sample.read_bytes())
    struct.pack_into("<H", data, 10, 7)
    struct.pack_into("<I", data, 60, crc32c(bytes(data[:60])))
    newer = tmp_path / "newer-source.kv"
    newer.write_bytes(data)

    def extend(document: dict) -> None:
        document["manifest"]["optional_features"] = ["attention-stats"]
        document["manifest"]["future_key"] = {"x": 1}
        document["future_top"] = 3

    mutant = tmp_path / "v1.7.kv"
    rebuild_index(newer, mutant, edit_json=extend)  # index CRC over the v1.7 header, footer minor 7 (R3)
    assert outcome(mutant) == outcome(sample)
    with kvformat.open(mutant) as snap:
        assert snap.version == (1, 7)
