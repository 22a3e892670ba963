"""Main job, format-only stage: build a synthetic snapshot, write it, read it back per head.

Until capture lands this packs a synthetic KV cache (with a planted outlier head) instead of a
real model's; it exercises the real writer, reader and verify.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

import kvformat


def main() -> None:
    rng = np.random.default_rng(0)
    layers = []
    for layer in range(4):
        k = rng.standard_normal((3, 256, 64)).astype(np.float16)
        v = rng.standard_normal((3, 256, 64)).astype(np.float16)
        if layer == 2:
            k[1] *= 6  # an outlier head
        layers.append(kvformat.Layer(k, v))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.kv"
        kvformat.save(path, layers, metadata={"model": {"name": "synthetic"}}, codec="byteplane-zstd")
        with kvformat.open(path) as snap:
            print(snap)
            report = snap.verify()
            print(f"verify: {report.chunks} chunks OK")
            norms = {
                (h.layer, h.head): float(np.linalg.norm(h.k.astype(np.float32), axis=1).mean())
                for h in snap.heads()
            }
    median = float(np.median(list(norms.values())))
    print("layer head  mean||K||")
    for (layer, head), value in norms.items():
        flag = "  <- outlier" if value > 2 * median else ""
        print(f"{layer:5d} {head:4d}  {value:9.3f}{flag}")


if __name__ == "__main__":
    main()
