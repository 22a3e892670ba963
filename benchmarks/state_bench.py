"""Recurrent-state statistics of a long hybrid capture: time and memory of ``kvsnap stats FILE
--stats state`` in a fresh process, against a sequential read of the file (the machine's limit)
in the same run.

The file is synthetic, written with the public API in Qwen3-Next-80B's layout: 48 layers, every
4th full attention (2 KV heads of 256, bfloat16), the others gated-delta layers with a
convolution window ``(1, 3, 8192)`` and a state ``(1, 32, 128, 128)``, both float32 (2.1 MB a
layer); 8,192 tokens, a snapshot every ``--every`` tokens, each storing the whole state.

    python -m benchmarks.state_bench [--tokens 8192] [--every 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import kvformat

from .memory import run_sampled

LAYERS, ATTENTION_EVERY = 48, 4
VALUE_HEADS, HEAD_DIM, CONV_CHANNELS = 32, 128, 8192


def write(path: Path, tokens: int, every: int) -> int:
    """The synthetic file; returns its number of snapshots."""
    rng = np.random.default_rng(0)
    described = [
        {"shape": [1, 3, CONV_CHANNELS], "dtype": "float32", "heads": None, "role": "conv"},
        {
            "shape": [1, VALUE_HEADS, HEAD_DIM, HEAD_DIM],
            "dtype": "float32",
            "heads": VALUE_HEADS,
            "role": "recurrent",
        },
    ]
    specs = [
        kvformat.LayerSpec(2, 256, 256, kvformat.BFLOAT16, attributes={"kind": "full"})
        if (layer + 1) % ATTENTION_EVERY == 0
        else kvformat.LayerSpec.absent(
            {"kind": "recurrent", "cache_class": "ArraysCache", "state": described}
        )
        for layer in range(LAYERS)
    ]
    conv = rng.standard_normal((3, CONV_CHANNELS)).astype(np.float32)
    head = rng.standard_normal((HEAD_DIM, HEAD_DIM)).astype(np.float32)
    snapshots = 0
    with kvformat.Writer(
        path, specs, metadata={"model": {"architecture": "qwen3_next"}}, durable=False
    ) as writer:
        for start in range(0, tokens, every):
            count = min(every, tokens - start)
            for layer, spec in enumerate(specs):
                if spec.present:
                    k = rng.standard_normal((2, count, 256)).astype(ml_dtypes.bfloat16)
                    writer.append(layer, k, k)
            arrays = {}
            for layer, spec in enumerate(specs):
                if not spec.present:
                    arrays[f"state/{layer}/0"] = conv * (1 + start / tokens)
                    for h in range(VALUE_HEADS):
                        arrays[f"state/{layer}/1/{h}"] = head * (1 + h / VALUE_HEADS + start / tokens)
            writer.snapshot({"generated": start + count}, arrays=arrays)
            snapshots += 1
    return snapshots


def read_seconds(path: Path) -> float:
    """A sequential read of the whole file (the page cache warm, as for the command)."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    return time.perf_counter() - start


def math_seconds(snapshots: int) -> float:
    """The statistics' arithmetic alone on arrays already in memory (numpy, this process): every
    state matrix's Gram product and eigenvalues, as the command computes them."""
    rng = np.random.default_rng(1)
    head = rng.standard_normal((HEAD_DIM, HEAD_DIM))
    conv = rng.standard_normal((3, CONV_CHANNELS))
    start = time.perf_counter()
    for _ in range(snapshots * (LAYERS - LAYERS // ATTENTION_EVERY)):
        np.linalg.eigvalsh(conv @ conv.T)
        for _ in range(VALUE_HEADS):
            np.linalg.eigvalsh(head @ head.T)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--every", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hybrid.kv"
        snapshots = write(path, options.tokens, options.every)
        size = path.stat().st_size
        state = (LAYERS - LAYERS // ATTENTION_EVERY) * 4 * (3 * CONV_CHANNELS + VALUE_HEADS * HEAD_DIM**2)
        print(
            f"{path.name}: {size / 1e6:.0f} MB, {snapshots} snapshots, {options.tokens} tokens; "
            f"state {state / 1e6:.1f} MB a snapshot"
        )
        command = [sys.executable, "-m", "kvsnap.cli", "stats", str(path), "--stats", "state"]
        walls, reads, peaks = [], [], []
        for run in range(options.runs):
            reads.append(read_seconds(path))
            out = Path(folder) / f"state-{run}.parquet"
            start = time.perf_counter()
            sampled = run_sampled([*command, "-o", str(out)], env=dict(os.environ))
            walls.append(time.perf_counter() - start)
            peaks.append(sampled.largest_rss)
        ratios = [w / r for w, r in zip(walls, reads, strict=True)]
        math = math_seconds(snapshots)
        print(f"the eigenvalue arithmetic alone on arrays in memory: {math:.2f} s")
        print(
            f"kvsnap stats --stats state: {statistics.median(walls):.2f} s "
            f"({min(walls):.2f}-{max(walls):.2f}), "
            f"{min(ratios):.1f}-{max(ratios):.1f}x a read of the file ({statistics.median(reads):.2f} s), "
            f"{statistics.median(walls) / math:.2f}x the arithmetic alone; "
            f"peak resident {max(peaks) / 2**20:.0f} MiB = {max(peaks) / size:.3f} of the file"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
