"""An independent writer of go-mlx block bundles, State logs and KVST containers
(../shared/formats/mlxkv001-bundles.md), and the golden and hostile files built with it.

    python -m tests.mlxkv.bundles      # rewrites tests/mlxkv/bundles/* and its expected.json

Blocks are split by go-mlx's rules (boundaries every ``block_size`` tokens plus each sliding
window's start; a layer outside a block's window written with ``head_count = 0``; ``generated``
and logits only in the last block), each block an MLXKV001 snapshot from `generate.Snapshot`.
A later turn reuses its parent's refs where range and SHA-256 agree, as go-mlx's ``ReusePrefix``
does. Deterministic (fixed seeds): a test holds the committed files equal to a fresh run.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.mlxkv.generate import Layer, Snapshot

HERE = Path(__file__).resolve().parent / "bundles"
LOG_MAGIC = b"go-inference-state-file-log-v1\n"
LEGACY_MAGIC = b"go-mlx-memvid-file-log-v1\n"
SEGMENT = "/Users/someone/.go-mlx/state/session.mvlog"
ARCH, LAYERS, HEADS, DIM, QUERY_HEADS = "qwen3", 3, 2, 4, 4
WINDOWS = {1: 6}  # layer 1 is a sliding-window layer of 6 tokens
TOTAL = 14  # tokens of the longest turn


@dataclass
class Model:
    """The full K/V of a generation: ``k[layer]`` / ``v[layer]`` ``(heads, TOTAL, DIM)``, and the
    token ids; a turn of ``n`` tokens holds the first ``n`` of each (the cache of a prefix)."""

    k: list[np.ndarray]
    v: list[np.ndarray]
    tokens: list[int]
    dtype: str  # "float32" or a native name: how the blocks store the tensors


def model(seed: int = 0, dtype: str = "float32") -> Model:
    rng = np.random.default_rng(seed)
    k = [rng.standard_normal((HEADS, TOTAL, DIM)).astype(np.float32) for _ in range(LAYERS)]
    v = [rng.standard_normal((HEADS, TOTAL, DIM)).astype(np.float32) for _ in range(LAYERS)]
    return Model(k, v, [int(t) for t in rng.integers(0, 50_000, TOTAL)], dtype)


def boundaries(seq_len: int, block_size: int) -> list[int]:
    cuts = set(range(0, seq_len, block_size)) | {seq_len}
    cuts |= {seq_len - w for w in WINDOWS.values() if 0 < w < seq_len}
    return sorted(cuts)


def block_snapshot(m: Model, seq_len: int, start: int, end: int, generated: list[int]) -> Snapshot:
    """The MLXKV001 snapshot of tokens ``[start, end)`` of a turn of ``seq_len`` tokens."""
    encoding = "float32" if m.dtype == "float32" else f"native:{m.dtype}"
    layers = []
    for i in range(LAYERS):
        window = WINDOWS.get(i, 0)
        low = max(start, seq_len - window) if window else start
        heads = [(m.k[i][h, start:end], m.v[i][h, start:end]) for h in range(HEADS)] if low < end else []
        layers.append(Layer(i, heads, (encoding,), max_size=window))
    last = end == seq_len
    logits = np.linspace(-1, 1, 8, dtype=np.float32) if last else None
    return Snapshot(
        6,
        ARCH,
        LAYERS,
        HEADS,
        end - start,
        DIM,
        QUERY_HEADS,
        m.tokens[start:end],
        layers,
        token_offset=end,
        generated=generated if last else [],
        logit_shape=[1, 8] if last else [],
        logits=logits,
    )


class LogWriter:
    """An append-only State log: records ``MVF1 | u64 chunk_id | u64 size | u32 meta | meta | payload``."""

    def __init__(self, magic: bytes = LOG_MAGIC) -> None:
        self.data = bytearray(magic)
        self.next_id = 1

    def put(self, payload: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """Append a record; returns its ChunkRef."""
        raw = json.dumps(meta, separators=(",", ":")).encode() if meta else b"{}"
        offset = len(self.data)
        self.data += b"MVF1" + struct.pack("<QQI", self.next_id, len(payload), len(raw)) + raw + payload
        ref = {
            "chunk_id": self.next_id,
            "frame_offset": offset,
            "has_frame_offset": True,
            "codec": "state/file-log",
            "segment": SEGMENT,
        }
        self.next_id += 1
        return ref


def bundle_hash(manifest: dict[str, Any], hashes: list[str]) -> str:
    head = [
        manifest["architecture"],
        manifest["kv_encoding"],
        manifest["token_count"],
        manifest["token_offset"],
        manifest["block_size"],
    ]
    return hashlib.sha256(("|".join(map(str, head)) + "".join(f"|{h}" for h in hashes)).encode()).hexdigest()


def save_bundle(
    log: LogWriter,
    m: Model,
    seq_len: int,
    uri: str,
    *,
    block_size: int = 4,
    parent: dict[str, Any] | None = None,
    envelope: bool = False,
    generated: list[int] | None = None,
    unpadded: bool = False,
) -> dict[str, Any]:
    """Write a turn's blocks (reusing ``parent``'s refs where range and hash agree) and its
    manifest; returns the manifest."""
    cuts = boundaries(seq_len, block_size)
    kv_encoding = "float32" if m.dtype == "float32" else "native"
    refs, reused = [], 0
    parents = {(b["token_start"], b["token_count"]): b for b in (parent or {}).get("blocks", [])}
    for index, (start, end) in enumerate(itertools.pairwise(cuts)):
        payload = block_snapshot(m, seq_len, start, end, generated or []).to_bytes()
        digest = hashlib.sha256(payload).hexdigest()
        old = parents.get((start, end - start))
        if old is not None and old["kv_hash"] == digest:
            refs.append({**old, "index": index})
            reused += 1
            continue
        tags = {
            "kv_hash": digest,
            "kv_encoding": kv_encoding,
            "block_index": index,
            "token_start": start,
            "token_count": end - start,
        }
        meta = {
            "uri": f"mlx://kv-snapshot-blocks/block/{index}",
            "title": f"go-mlx KV block {index}",
            "kind": "go-mlx/kv-snapshot-block",
            "track": "session-kv-blocks",
            "tags": tags,
            "labels": ["go-mlx", "kv-snapshot-block"],
        }
        if envelope:
            text = base64.b64encode(payload).decode()
            body = {
                "version": 1,
                "kind": "go-mlx/kv-snapshot-block",
                "block_index": index,
                "token_start": start,
                "token_count": end - start,
                "kv_hash": digest,
                "kv_encoding": kv_encoding,
                "binary_encoding": "base64",
                "payload_byte_count": len(payload),
                "data": text.rstrip("=") if unpadded else text,
            }
            ref = log.put(json.dumps(body).encode(), meta)
        else:
            ref = log.put(payload, meta)
        refs.append(
            {
                "index": index,
                "token_start": start,
                "token_count": end - start,
                "kv_hash": digest,
                "payload_encoding": "json-base64" if envelope else "raw",
                "payload_byte_count": len(payload),
                "state": ref,
                "memvid": ref,
            }
        )
    manifest = {
        "version": 1,
        "kind": "go-mlx/kv-snapshot-block-bundle",
        "snapshot_hash": "",
        "kv_encoding": kv_encoding,
        "architecture": ARCH,
        "token_count": seq_len,
        "token_offset": seq_len,
        "block_size": block_size,
        "num_layers": LAYERS,
        "num_heads": HEADS,
        "seq_len": seq_len,
        "head_dim": DIM,
        "reused_blocks": reused,
        "blocks": refs,
    }
    manifest["snapshot_hash"] = bundle_hash(manifest, [r["kv_hash"] for r in refs])
    log.put(
        json.dumps(manifest).encode(),
        {
            "uri": uri,
            "title": "go-mlx State block bundle",
            "kind": "go-mlx/kv-snapshot-block-bundle",
            "track": "session-kv-blocks",
            "labels": ["go-mlx", "kv-snapshot-block-bundle"],
        },
    )
    return manifest


def container(log: bytes, *, big_endian: bool = True, header: dict[str, Any] | None = None) -> bytes:
    """A ``KVST`` container around ``log``."""
    fields = {
        "kind": "go-mlx/state-kv",
        "content_type": "application/vnd.go-mlx.state-log",
        "payload_file": "session.mvlog",
        "payload_bytes": len(log),
        "marker_file": "session.marker",
        "state_store_path": SEGMENT,
        "index_uri": "mlx://index",
        "entry_uri": "mlx://index/entry/0",
        "bundle_uri": "mlx://bundle/turn-2",
        "token_count": TOTAL,
        "created_at_unix_nano": 1,
    }
    raw = json.dumps(header or fields).encode()
    return b"KVST" + bytes([2]) + len(raw).to_bytes(4, "big" if big_endian else "little") + raw + log


TURNS = (10, TOTAL)  # tokens of turn 1 and turn 2 (turn 2 continues turn 1)
GENERATED = ([7, 8], [7, 8, 9, 10])


def two_turns(
    magic: bytes = LOG_MAGIC, envelope: bool = False, dtype: str = "float32", unpadded: bool = False
) -> tuple[bytes, list[dict[str, Any]]]:
    """A log with two bundles: turn 2 reuses turn 1's first blocks."""
    m = model(0, dtype)
    log = LogWriter(magic)
    first = save_bundle(
        log, m, TURNS[0], "mlx://bundle/turn-1", envelope=envelope, generated=GENERATED[0], unpadded=unpadded
    )
    second = save_bundle(
        log,
        m,
        TURNS[1],
        "mlx://bundle/turn-2",
        parent=first,
        envelope=envelope,
        generated=GENERATED[1],
        unpadded=unpadded,
    )
    return bytes(log.data), [first, second]


def golden() -> dict[str, bytes]:
    log, _ = two_turns()
    return {
        "two-turns.mvlog": log,
        "legacy-envelopes.mvlog": two_turns(LEGACY_MAGIC, envelope=True, unpadded=True)[0],
        "float16.mvlog": two_turns(dtype="float16")[0],
        "container.kv": container(log),
        "container-little-endian.kv": container(log, big_endian=False),
    }


def _manifest_record(log: bytes, n: int) -> tuple[int, int, dict[str, Any]]:
    """(payload start, payload size, manifest) of the ``n``-th bundle record of ``log``."""
    offset, found = len(LOG_MAGIC), -1
    while offset < len(log):
        _, _, size, meta_size = struct.unpack_from("<4sQQI", log, offset)
        start = offset + 24 + meta_size
        meta = json.loads(log[offset + 24 : start])
        if meta.get("kind") == "go-mlx/kv-snapshot-block-bundle":
            found += 1
            if found == n:
                return start, size, json.loads(log[start : start + size])
        offset = start + size
    raise ValueError(n)


def _rebundled(edit: Any, rehash: bool = True) -> bytes:
    """The two-turn log with turn 2's manifest (its last record) edited."""
    log, _ = two_turns()
    start, size, manifest = _manifest_record(log, 1)
    edit(manifest)
    if rehash:
        manifest["snapshot_hash"] = bundle_hash(manifest, [b.get("kv_hash", "") for b in manifest["blocks"]])
    raw = json.dumps(manifest).encode()
    meta = json.dumps({"uri": "mlx://bundle/turn-2", "kind": "go-mlx/kv-snapshot-block-bundle"}).encode()
    # the record replaced in place (it is the log's last): same chunk id, new metadata and payload
    header_at = start - 24 - _meta_len(log, start)
    body = bytearray(log[:header_at])
    body += b"MVF1" + struct.pack("<QQI", _chunk_id(log, header_at), len(raw), len(meta)) + meta + raw
    body += log[start + size :]
    return bytes(body)


def _meta_len(log: bytes, start: int) -> int:
    offset = len(LOG_MAGIC)
    while True:
        _, _, size, meta_size = struct.unpack_from("<4sQQI", log, offset)
        if offset + 24 + meta_size == start:
            return meta_size
        offset += 24 + meta_size + size


def _chunk_id(log: bytes, header_at: int) -> int:
    return int(struct.unpack_from("<Q", log, header_at + 4)[0])


def _flip(log: bytes, at: int) -> bytes:
    data = bytearray(log)
    data[at] ^= 0x01
    return bytes(data)


def _block_payload_at(log: bytes) -> int:
    """A byte in the middle of the first record's payload (the first block)."""
    _, _, size, meta_size = struct.unpack_from("<4sQQI", log, len(LOG_MAGIC))
    return len(LOG_MAGIC) + 24 + meta_size + size // 2


def _bad_base64() -> bytes:
    """Envelopes whose first ``data`` starts with two characters outside base64 (same length)."""
    log = two_turns(envelope=True)[0]
    at = log.index(b'"data": "') + len(b'"data": "')
    return log[:at] + b"!!" + log[at + 2 :]


def hostile() -> dict[str, tuple[str, bytes]]:
    """name -> (expected error class, file bytes)."""
    log, (first, _) = two_turns()
    third_block_ref = first["blocks"][2]["state"]

    def ref(field: str, value: Any, block: int = 0) -> Any:
        def edit(manifest: dict[str, Any]) -> None:
            manifest["blocks"][block]["state"][field] = value
            manifest["blocks"][block]["memvid"][field] = value

        return edit

    def key(field: str, value: Any, block: int | None = None) -> Any:
        def edit(manifest: dict[str, Any]) -> None:
            (manifest if block is None else manifest["blocks"][block])[field] = value

        return edit

    m = model(0)
    quant_block = block_snapshot(m, 4, 0, 4, [])
    quant_block.layers[0].cache_mode, quant_block.layers[0].payloads = "turboquant", (b"\x00" * 8,)
    save_heads = block_snapshot(m, 4, 0, 4, [])
    save_heads.layers[2].heads = save_heads.layers[2].heads[:1]
    files = {
        "qr-video-ref.mvlog": ("UnsupportedFeatureError", _rebundled(ref("codec", "memvid/qr-video"))),
        "bundle-version-2.mvlog": ("UnsupportedVersionError", _rebundled(key("version", 2))),
        "hash-mismatch.mvlog": ("CorruptFileError", _flip(log, _block_payload_at(log))),
        "length-mismatch.mvlog": ("CorruptFileError", _rebundled(key("payload_byte_count", 7, 1))),
        "record-past-end.mvlog": ("TruncatedFileError", log[:-5]),
        "huge-payload-size.mvlog": ("TruncatedFileError", log[:43] + struct.pack("<Q", 1 << 60) + log[51:]),
        "frame-offset-outside.mvlog": ("CorruptFileError", _rebundled(ref("frame_offset", 1 << 40))),
        "frame-offset-wrong-chunk.mvlog": (
            "CorruptFileError",
            _rebundled(ref("frame_offset", third_block_ref["frame_offset"])),
        ),
        "not-contiguous.mvlog": ("CorruptFileError", _rebundled(key("token_start", 5, 1))),
        "snapshot-hash-mismatch.mvlog": (
            "CorruptFileError",
            _rebundled(key("token_offset", 99), rehash=False),
        ),
        "huge-container-header.kv": ("LimitExceededError", b"KVST\x02\xff\xff\xff\x7f{}" + log),
        "container-wrong-kind.kv": (
            "UnsupportedFeatureError",
            container(log, header={"kind": "other", "index_uri": "x"}),
        ),
        "bad-base64.mvlog": ("CorruptFileError", _bad_base64()),
    }
    for name, block in (("turboquant-layer.mvlog", quant_block), ("head-count.mvlog", save_heads)):
        writer = LogWriter()
        payload = block.to_bytes()
        digest = hashlib.sha256(payload).hexdigest()
        ref_ = writer.put(payload, {"kind": "go-mlx/kv-snapshot-block"})
        manifest = {
            "version": 1,
            "kind": "go-mlx/kv-snapshot-block-bundle",
            "kv_encoding": "float32",
            "architecture": ARCH,
            "token_count": 4,
            "token_offset": 4,
            "block_size": 4,
            "blocks": [
                {
                    "index": 0,
                    "token_start": 0,
                    "token_count": 4,
                    "kv_hash": digest,
                    "payload_encoding": "raw",
                    "payload_byte_count": len(payload),
                    "state": ref_,
                }
            ],
        }
        manifest["snapshot_hash"] = bundle_hash(manifest, [digest])
        writer.put(
            json.dumps(manifest).encode(),
            {"uri": "mlx://bundle/x", "kind": "go-mlx/kv-snapshot-block-bundle"},
        )
        files[name] = (
            "UnsupportedFeatureError" if "turbo" in name else "CorruptFileError",
            bytes(writer.data),
        )
    return files


def generate(directory: Path = HERE) -> dict[str, Any]:
    """Write every golden and hostile file under ``directory``; returns what expected.json holds."""
    (directory / "bad").mkdir(parents=True, exist_ok=True)
    for name, data in golden().items():
        (directory / name).write_bytes(data)
    expected: dict[str, Any] = {"golden": sorted(golden()), "hostile": {}}
    for name, (error, data) in hostile().items():
        (directory / "bad" / name).write_bytes(data)
        expected["hostile"][name] = error
    _, (first, _) = two_turns()
    (directory / "manifest-dir").mkdir(exist_ok=True)
    (directory / "manifest-dir" / "session.mvlog").write_bytes(golden()["two-turns.mvlog"])
    (directory / "manifest-dir" / "turn-1.json").write_text(json.dumps(first, indent=1) + "\n")
    return expected


if __name__ == "__main__":
    result = generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
    (Path(sys.argv[1]) if len(sys.argv) > 1 else HERE).joinpath("expected.json").write_text(
        json.dumps(result, indent=1, sort_keys=True) + "\n"
    )
