"""go-mlx block bundle manifests (``../shared/formats/mlxkv001-bundles.md``, section 3): the
manifest JSON and its block refs checked by go-mlx's rules, the bundle hash, and ``json-base64``
envelopes unwrapped. `kvformat.importers.bundles` imports what they describe."""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any

from kvformat.errors import CorruptFileError, UnsupportedFeatureError, UnsupportedVersionError
from kvformat.importers.statelog import BUNDLE_KIND, Log, Record

BLOCK_KIND = "go-mlx/kv-snapshot-block"
BUNDLE_VERSION = 1
FILE_LOG_CODECS = ("state/file-log", "memvid/file-log", "")
ENCODINGS = ("raw", "json-base64", "")


@dataclass(frozen=True)
class Block:
    """One ref of a bundle manifest: tokens ``[token_start, token_start + token_count)``."""

    index: int
    token_start: int
    token_count: int
    kv_hash: str
    payload_encoding: str
    byte_count: int
    chunk_id: int
    frame_offset: int | None

    @property
    def identity(self) -> tuple[int, int, str]:
        """What makes two refs the same block (go-mlx's reuse rule: range and content)."""
        return self.token_start, self.token_count, self.kv_hash

    @property
    def place(self) -> tuple[int, int | None]:
        return self.chunk_id, self.frame_offset


@dataclass
class Bundle:
    """A checked bundle manifest and the record that holds it."""

    uri: str
    record: Record
    manifest: dict[str, Any]
    blocks: list[Block]

    @property
    def token_count(self) -> int:
        return int(self.manifest["token_count"])


def _integer(manifest: dict[str, Any], key: str, what: str, default: int | None = 0) -> int:
    value = manifest.get(key, default)
    if type(value) is not int or value < 0:
        raise CorruptFileError(f"{what}: {key} {value!r} is not a non-negative integer")
    return value


def _ref(raw: dict[str, Any], what: str) -> tuple[int, int | None]:
    """``(chunk_id, frame_offset or None)`` of a block ref: ``state`` unless it is absent or all
    zero, then the deprecated ``memvid``; refs that are not file-log records are refused."""
    ref = raw.get("state")
    if not isinstance(ref, dict) or not any(ref.values()):
        ref = raw.get("memvid")
    if not isinstance(ref, dict) or not any(ref.values()):
        raise CorruptFileError(f"{what} has no chunk ref ('state' or 'memvid')")
    codec = ref.get("codec", "")
    if codec not in FILE_LOG_CODECS:
        raise UnsupportedFeatureError(
            f"{what} is stored with codec {codec!r} (e.g. a QR-video or in-memory store); only "
            "State log records ('state/file-log') can be imported"
        )
    chunk_id = _integer(ref, "chunk_id", what)
    has_offset = ref.get("has_frame_offset", False) or bool(ref.get("frame_offset"))
    return chunk_id, _integer(ref, "frame_offset", what) if has_offset else None


def parse_bundle(log: Log, record: Record) -> Bundle:
    """Check a bundle manifest record by the rules of section 3 (before any block is read)."""
    uri = str(record.meta.get("uri", ""))
    what = f"{log.name}: bundle {uri or '(no uri)'} (chunk {record.chunk_id})"
    manifest = log.json_payload(record, what)
    version = manifest.get("version")
    if version != BUNDLE_VERSION:
        raise UnsupportedVersionError(f"{what} is version {version!r}; this importer reads version 1")
    if manifest.get("kind") != BUNDLE_KIND:
        raise CorruptFileError(f"{what} has kind {manifest.get('kind')!r}, not {BUNDLE_KIND!r}")
    token_count = _integer(manifest, "token_count", what)
    raw_blocks = manifest.get("blocks")
    if token_count == 0 or not isinstance(raw_blocks, list) or not raw_blocks:
        raise CorruptFileError(f"{what} holds no tokens or no blocks")
    blocks, start = [], 0
    for i, raw in enumerate(raw_blocks):
        blocks.append(_block(raw, i, start, f"{what} block {i}"))
        start += blocks[-1].token_count
    if start != token_count:
        raise CorruptFileError(f"{what}: its blocks hold {start} tokens, token_count says {token_count}")
    _check_snapshot_hash(manifest, blocks, what)
    return Bundle(uri, record, manifest, blocks)


def _block(raw: Any, i: int, start: int, where: str) -> Block:
    """Block ref ``i`` of a manifest, checked: in index order, starting at ``start``, non-empty,
    a known payload encoding, a SHA-256 or none, a file-log chunk ref."""
    if not isinstance(raw, dict):
        raise CorruptFileError(f"{where} is not a JSON object")
    if raw.get("index", 0) != i:
        raise CorruptFileError(
            f"{where} has index {raw.get('index')!r}; blocks must be listed in index order"
        )
    first, count = _integer(raw, "token_start", where), _integer(raw, "token_count", where)
    if first != start or count == 0:
        raise CorruptFileError(
            f"{where} covers tokens {first}..{first + count - 1}; blocks must be non-empty and "
            f"contiguous from 0 (expected a start of {start})"
        )
    encoding = raw.get("payload_encoding", "")
    if encoding not in ENCODINGS:
        raise UnsupportedFeatureError(f"{where} has payload_encoding {encoding!r}; known: raw, json-base64")
    kv_hash = raw.get("kv_hash", "")
    if not isinstance(kv_hash, str) or (kv_hash and len(kv_hash) != 64):
        raise CorruptFileError(f"{where} has kv_hash {kv_hash!r}, not a hex SHA-256")
    chunk_id, offset = _ref(raw, where)
    size = _integer(raw, "payload_byte_count", where)
    return Block(i, first, count, kv_hash.lower(), encoding or "raw", size, chunk_id, offset)


def snapshot_hash(manifest: dict[str, Any], blocks: list[Block]) -> str:
    """go-mlx's ``kvSnapshotStateBlockBundleHash``: SHA-256 of ``architecture|kv_encoding|
    token_count|token_offset|block_size`` then ``|kv_hash`` per block."""
    fields = [manifest.get(k, "") for k in ("architecture", "kv_encoding")]
    fields += [manifest.get(k, 0) for k in ("token_count", "token_offset", "block_size")]
    text = "|".join(str(f) for f in fields) + "".join(f"|{b.kv_hash}" for b in blocks)
    return hashlib.sha256(text.encode()).hexdigest()


def _check_snapshot_hash(manifest: dict[str, Any], blocks: list[Block], what: str) -> None:
    stated = manifest.get("snapshot_hash", "")
    if stated and stated.lower() != snapshot_hash(manifest, blocks):
        raise CorruptFileError(
            f"{what}: snapshot_hash {stated} does not match its fields and block hashes "
            f"({snapshot_hash(manifest, blocks)})"
        )


def bundles_of(log: Log) -> list[Bundle]:
    """Every bundle manifest of the log, in write order."""
    return [parse_bundle(log, r) for r in log.records if r.meta.get("kind") == BUNDLE_KIND]


def _check_envelope(envelope: dict[str, Any], block: Block, what: str) -> None:
    """An envelope's fixed fields, and its block fields equal to the manifest's ref."""
    expected = {"version": 1, "kind": BLOCK_KIND, "binary_encoding": "base64"}
    for key, value in expected.items():
        if envelope.get(key) != value:
            raise CorruptFileError(f"{what}: envelope {key} is {envelope.get(key)!r}, expected {value!r}")
    ref = {"block_index": block.index, "token_start": block.token_start, "token_count": block.token_count}
    for key, value in ref.items():
        if envelope.get(key, value) != value:
            raise CorruptFileError(
                f"{what}: envelope {key} {envelope.get(key)!r} differs from the manifest ({value})"
            )


def unwrap(log: Log, record: Record, block: Block, what: str) -> bytes:
    """A ``json-base64`` envelope's MLXKV001 bytes (padded or unpadded base64)."""
    envelope = log.json_payload(record, f"{what} envelope")
    _check_envelope(envelope, block, what)
    stated = str(envelope.get("kv_hash", "")).lower()
    if block.kv_hash and stated != block.kv_hash:
        raise CorruptFileError(
            f"{what}: envelope kv_hash {stated} differs from the manifest's {block.kv_hash}"
        )
    text = envelope.get("data")
    if not isinstance(text, str):
        raise CorruptFileError(f"{what}: envelope has no base64 'data'")
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise CorruptFileError(f"{what}: envelope data is not base64") from None
    if stated and hashlib.sha256(data).hexdigest() != stated:
        raise CorruptFileError(f"{what}: SHA-256 of the envelope's data does not match its kv_hash")
    count = envelope.get("payload_byte_count", 0)
    if count and count != len(data):
        raise CorruptFileError(
            f"{what}: envelope holds {len(data)} bytes, its payload_byte_count says {count}"
        )
    return data
