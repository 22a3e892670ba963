"""The mlx backend against the CPU kernel on this machine's mlx device, without pytest (for the
accelerator machine): the worst relative error per column over random files of three dtypes,
the mlx pass in one process and on worker processes (every core asked for).

    python -m benchmarks.mlx_agreement
"""

from __future__ import annotations

import collections
import itertools
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

import kvformat
from kvsnap.analysis.engine.tables import stats_rows
from kvsnap.analysis.kernels import mlx as mlx_backend

SKIP = {"file", "layer", "head", "seq", "tensor", "snapshot", "massive_positions"}


def random_file(path: Path, dtype: object, dim: int, tokens: int) -> Path:
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(2):
        k = rng.standard_normal((2, tokens, dim)).astype(np.float32) * rng.uniform(0.5, 3, dim)
        k[:, 0] *= 40
        k[:, tokens // 3, 5] = 300.0
        v = rng.standard_normal((2, tokens, dim)).astype(np.float32) + 0.3
        layers.append(kvformat.Layer(k.astype(dtype), v.astype(dtype)))
    rope = {"base": 10000.0, "dims": dim, "pairing": "half", "traditional": False}
    kvformat.save(path, layers, metadata={"rope": rope})
    return path


def main() -> None:
    from kvsnap.analysis.engine import processes
    from kvsnap.analysis.engine.parallel import cores

    print(f"mlx device: {mlx_backend.device_name()}")
    processes.PROCESS_MIN_BYTES = 0  # these small files on worker processes too
    with tempfile.TemporaryDirectory() as tmp:
        for (dtype, dim, tokens), jobs in itertools.product(
            ((np.float32, 128, 700), (np.float16, 80, 300), (ml_dtypes.bfloat16, 128, 20000)),
            sorted({1, cores()}),
        ):
            path = random_file(Path(tmp) / "r.kv", dtype, dim, tokens)
            got, expected = stats_rows(path, backend="mlx", jobs=jobs), stats_rows(path)
            worst: dict[str, float] = collections.defaultdict(float)
            for a, b in zip(got, expected, strict=True):
                for name, value in b.items():
                    if name in SKIP:
                        continue
                    x, y = np.asarray(a[name], float), np.asarray(value, float)
                    if name == "eigenvalues":
                        error = float(np.abs(x[:16] - y[:16]).max() / y.max())
                    elif name == "channel_kurtosis":
                        error = float(np.nanmax(np.abs(x - y) / np.abs(y + 3)))
                    elif name == "channel_mean":
                        error = float(np.nanmax(np.abs(x - y) / np.sqrt(np.asarray(b["channel_var"]))))
                    else:
                        scale = np.maximum(np.abs(y), 1e-12)
                        error = float(np.nanmax(np.abs(x - y) / scale)) if y.size else 0.0
                    worst[name] = max(worst[name], error)
            top = sorted(worst.items(), key=lambda item: -item[1])[:6]
            workers = processes.worker_count(jobs, "mlx")
            print(
                np.dtype(dtype).name,
                dim,
                tokens,
                f"{workers} process(es):",
                ", ".join(f"{k} {v:.1e}" for k, v in top),
            )


if __name__ == "__main__":
    main()
