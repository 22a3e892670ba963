"""Helper for test_crash: write a long series forever-ish; the test kills this process."""

from __future__ import annotations

import sys

import numpy as np

import kvformat
from tests.conftest import pattern


def main(path: str, steps: int, codec_and_mode: str) -> None:
    """Write ``steps`` snapshots of 24 tokens (2 layers x 2 heads x 32 dims) to ``path``;
    ``codec_and_mode``: ``raw``, ``zstd`` or ``raw+pipelined``."""
    spec = kvformat.LayerSpec(2, 32, 32, kvformat.FLOAT32)
    codec, _, mode = codec_and_mode.partition("+")
    with kvformat.Writer(path, [spec, spec], codec=codec, chunk_bytes=1024) as w:
        if mode == "pipelined":
            w.pipeline_bytes = 0  # every append is prepared on the helper thread
        for step in range(steps):
            positions = np.arange(step * 24, (step + 1) * 24)
            for layer in range(2):
                k = np.stack([pattern(layer, h, positions, 32, "k") for h in range(2)])
                v = np.stack([pattern(layer, h, positions, 32, "v") for h in range(2)])
                w.append(layer, k, v, positions)
            w.snapshot({"step": step})
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
