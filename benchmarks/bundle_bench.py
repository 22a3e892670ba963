"""Bundle import benchmark: a go-mlx State log of ``--blocks`` blocks of 512 tokens (Qwen3-8B
layout: 36 layers x 8 KV heads x 128 dims, native float16) imported to `.kv`, against a plain copy
of the same bytes, in one run.

    python -m benchmarks.bundle_bench [--blocks 200] [--dir /tmp/kvsnap-bundle-bench] [--rounds 3]

The issue's case is 200 blocks (~100k tokens, 15.1 GB); ``--blocks 20`` is a 1.5 GB smoke run.
Each import is a fresh process (`kvsnap import-mlxkv`, default settings: raw codec, durable).
The peers, each a fresh process too: ``cp`` and ``cp`` + ``sync`` of the copy (GNU cp uses
``copy_file_range``: the kernel copies the pages, no user-space pass over the bytes), and a plain
user-space copy (``copy``: read into a 64 MiB buffer, write, fsync), the least any converter that
looks at the bytes does. The import fsyncs what it writes, so the durable peers are the fair ones.
The page cache is warm for all of them (the log was just written or read).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.mlxkv import bundles as gen

LAYERS, HEADS, DIM, BLOCK = 36, 8, 128, 512


def write_log(path: Path, blocks: int) -> int:
    """Write the log block by block (one block in memory); returns its size."""
    rng = np.random.default_rng(0)
    k = [rng.standard_normal((HEADS, BLOCK, DIM)).astype(np.float16) for _ in range(LAYERS)]
    tokens = blocks * BLOCK
    saved = (gen.LAYERS, gen.HEADS, gen.DIM, gen.TOTAL, gen.WINDOWS)
    gen.LAYERS, gen.HEADS, gen.DIM, gen.TOTAL, gen.WINDOWS = LAYERS, HEADS, DIM, tokens, {}
    try:
        log = _StreamingLog(path)
        refs = []
        for index in range(blocks):
            start = index * BLOCK
            model = gen.Model(k, k, [start + i for i in range(BLOCK)], "float16")
            snap = gen.block_snapshot(model, BLOCK, 0, BLOCK, [])
            snap.seq_len, snap.token_offset = BLOCK, start + BLOCK
            payload = snap.to_bytes()
            ref = log.put(payload, {"kind": "go-mlx/kv-snapshot-block"})
            refs.append(
                {
                    "index": index,
                    "token_start": start,
                    "token_count": BLOCK,
                    "kv_hash": hashlib.sha256(payload).hexdigest(),
                    "payload_encoding": "raw",
                    "payload_byte_count": len(payload),
                    "state": ref,
                }
            )
        manifest = {
            "version": 1,
            "kind": "go-mlx/kv-snapshot-block-bundle",
            "kv_encoding": "native",
            "architecture": "qwen3",
            "token_count": tokens,
            "token_offset": tokens,
            "block_size": BLOCK,
            "blocks": refs,
        }
        manifest["snapshot_hash"] = gen.bundle_hash(manifest, [r["kv_hash"] for r in refs])
        log.put(
            json.dumps(manifest).encode(), {"uri": "mlx://bench", "kind": "go-mlx/kv-snapshot-block-bundle"}
        )
        log.file.close()
    finally:
        gen.LAYERS, gen.HEADS, gen.DIM, gen.TOTAL, gen.WINDOWS = saved
    return path.stat().st_size


class _StreamingLog(gen.LogWriter):
    """`gen.LogWriter` that appends to a file instead of memory."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115
        self.file.write(gen.LOG_MAGIC)
        self.offset, self.next_id = len(gen.LOG_MAGIC), 1

    def put(self, payload: bytes, meta: dict[str, object]) -> dict[str, object]:
        raw = json.dumps(meta).encode()
        ref = {
            "chunk_id": self.next_id,
            "frame_offset": self.offset,
            "has_frame_offset": True,
            "codec": "state/file-log",
        }
        self.file.write(b"MVF1" + struct.pack("<QQI", self.next_id, len(payload), len(raw)) + raw + payload)
        self.offset += 24 + len(raw) + len(payload)
        self.next_id += 1
        return ref


COPY = r"""
import os, sys
with open(sys.argv[1], "rb") as f, open(sys.argv[2], "wb") as g:
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        g.write(view[:n])
    g.flush()
    os.fsync(g.fileno())
"""


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--dir", default="/tmp/kvsnap-bundle-bench")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    log, copy, out = folder / "session.mvlog", folder / "copy.mvlog", folder / "out.kv"
    size = write_log(log, args.blocks)
    print(
        f"log: {args.blocks} blocks x {BLOCK} tokens, Qwen3-8B layout float16, {size / 1e9:.2f} GB",
        flush=True,
    )
    kvsnap = [str(Path(sys.executable).parent / "kvsnap")]
    copy_name = "copy: read + write + fsync (user space)"
    results: dict[str, list[float]] = {
        "cp": [],
        "cp + sync": [],
        copy_name: [],
        "kvsnap import-mlxkv (fresh process)": [],
    }
    for _ in range(args.rounds):
        copy.unlink(missing_ok=True)
        results["cp"].append(timed(["cp", str(log), str(copy)]))
        copy.unlink()
        results["cp + sync"].append(timed(["sh", "-c", f"cp {log} {copy} && sync {copy}"]))
        copy.unlink()
        results[copy_name].append(timed([sys.executable, "-c", COPY, str(log), str(copy)]))
        copy.unlink()
        out.unlink(missing_ok=True)
        results["kvsnap import-mlxkv (fresh process)"].append(
            timed([*kvsnap, "import-mlxkv", str(log), str(out)])
        )
    print(f"| {'what':42} | median s | min-max s | GB/s | speed vs cp + sync | vs user-space copy |")
    print(f"|{'-' * 44}|---|---|---|---|---|")
    base, plain = statistics.median(results["cp + sync"]), statistics.median(results[copy_name])
    for name, times in results.items():
        median = statistics.median(times)
        print(
            f"| {name:42} | {median:.2f} | {min(times):.2f}-{max(times):.2f} | {size / median / 1e9:.2f} | "
            f"{base / median:.2f}x | {plain / median:.2f}x |"
        )
    out.unlink(missing_ok=True)
    os.sync()


if __name__ == "__main__":
    main()
