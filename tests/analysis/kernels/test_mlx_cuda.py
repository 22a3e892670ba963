"""mlx on an NVIDIA GPU: what only runs there, kvsnap's own Gram kernel
(`cuda_gram.gram_product`, used in place of cuBLAS). Marked ``cuda``: run them on a machine
where mlx computes on CUDA (``pytest -m cuda tests``, with
`tests/analysis/kernels/test_mlx_backend.py` for the whole table); `make test` deselects them, CI
having no accelerator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsnap.analysis.kernels import cuda_gram, mlx_fold, mlx_staging
from kvsnap.analysis.kernels import mlx as mlx_backend

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(
    "batch,n,dim",
    [(3, 8192, 128), (2, 700, 80), (1, 5000, 256), (4, 1537, 64), (2, 1, 96), (1, 2048, 200)],
)
def test_gram_product_matches_float64(batch: int, n: int, dim: int) -> None:
    """Every entry within float32 rounding of sums of 1024 terms, for head dims that are not
    a multiple of the tile (80, 96, 200), rows that are not a multiple of the chunk or the
    step, and one row."""
    import mlx.core as mx

    rng = np.random.default_rng(n + dim)
    rows = rng.standard_normal((batch, n, dim)) * rng.uniform(0.1, 3.0, dim) + rng.uniform(-1, 1, dim)
    rows = rows.astype(np.float32)
    got = np.array(cuda_gram.gram_product(mx.array(rows)))
    wide = rows.astype(np.float64)
    expected = np.einsum("bni,bnj->bij", wide, wide)
    assert got.shape == expected.shape and got.dtype == np.float32
    scale = np.abs(expected).max(axis=(1, 2), keepdims=True)
    assert np.all(np.abs(got - expected) <= 2e-5 * scale)
    assert np.array_equal(got, got.transpose(0, 2, 1))  # each entry summed in the same order


def test_the_piece_function_uses_it_on_cuda() -> None:
    """On CUDA the compiled per-piece function's Gram product is the kernel's: the light rows
    less their center, within float32 rounding of float64; the massive row left to the host."""
    import mlx.core as mx

    assert mlx_staging.on_cuda() and cuda_gram.usable()
    rng = np.random.default_rng(0)
    pieces = rng.standard_normal((4, 8192, 128)).astype(np.float32) + 0.5
    pieces[:, 17] *= 40.0  # a massive row in each piece: left to the host
    flags = (False, False, False, False, True, False)
    out = mlx_fold.to_host(mlx_backend.piece_function(*flags, batched=True)(mx.array(pieces)))
    assert (out["heavy"] == 1).all() and (out["light"][:, 17] == 0).all()
    for b in range(4):
        light = np.delete(pieces[b], 17, axis=0).astype(np.float64) - out["center"][b]
        expected = light.T @ light
        assert np.abs(out["product"][b] - expected).max() <= 2e-5 * np.abs(expected).max()


def test_the_compiled_kernel_is_kept_for_the_next_process(tmp_path: Path) -> None:
    """A fresh process with an empty cache compiles and keeps the cubin; the next one loads it
    (and does not compile: its NVRTC is made to fail)."""
    script = (
        "import mlx.core as mx, numpy as np\n"
        "from kvsnap.analysis.kernels import cuda_gram\n"
        "import sys\n"
        "if sys.argv[1] == 'load':\n"
        "    def fail(*a): raise cuda_gram.CudaGramError('compiled again')\n"
        "    cuda_gram.compile_binary = fail\n"
        "x = mx.array(np.ones((1, 100, 64), np.float32))\n"
        "print(float(np.array(cuda_gram.gram_product(x))[0, 0, 0]))\n"
    )
    env = {**os.environ, "KVSNAP_CACHE": str(tmp_path)}
    for mode in ("compile", "load"):
        done = subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "100.0"
    (kept,) = (tmp_path / "cuda").glob("kvsnap_gram-sm*.cubin")
    assert kept.read_bytes().startswith(b"\x7fELF")


def test_query_gather_equals_concatenate() -> None:
    """`capture.gather.join` on CUDA (64 one-position pieces a launch) gives what
    ``mx.concatenate`` gives: runs shorter and longer than a launch, other pieces between them,
    three dtypes."""
    import mlx.core as mx

    from kvsnap.capture import gather

    assert gather.on_cuda()
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        window = mx.random.normal((1, 6, 5, 48)).astype(dtype)
        singles = [mx.random.normal((1, 6, 1, 48)).astype(dtype) for _ in range(150)]
        for parts in ([window, *singles], singles[:3], [*singles[:70], window, *singles[70:]]):
            expected = mx.concatenate(parts, axis=2)
            joined = gather.join(parts, gather=True)
            assert joined.shape == expected.shape and bool(mx.array_equal(joined, expected).item())
    # the kernel ran for each dtype: no silent fallback to mx.concatenate
    assert all(gather._WORKS[(dtype, 6, 48)] for dtype in (mx.bfloat16, mx.float16, mx.float32))


@pytest.mark.parametrize(
    "buffers,batch,start,count", [(72, 1, 48, 16), (3, 2, 0, 130), (64, 1, 255, 1), (1, 1, 5, 7)]
)
def test_rows_gather_equals_slicing(buffers: int, batch: int, start: int, count: int) -> None:
    """`capture.gather.rows` on CUDA (64 cache buffers a launch, first row and count given at
    run time) gives what slicing and ``mx.concatenate`` give, for three dtypes; then the same
    binary serves another span without a second check."""
    import mlx.core as mx

    from kvsnap.capture import gather

    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        held = [mx.random.normal((batch, 3, 256, 40)).astype(dtype) for _ in range(buffers)]
        mx.eval(held)
        for first, n in ((start, count), (start // 2, max(1, count // 3))):
            expected = mx.concatenate([b[:, :, first : first + n] for b in held], axis=0)
            found = gather.rows(held, first, n, gather=True)
            assert found.shape == expected.shape == (buffers * batch, 3, n, 40)
            assert bool(mx.array_equal(found, expected).item())
        assert gather._ROWS_WORK[(dtype, batch, 3, 40)]  # the kernel ran: no silent fallback


def test_captured_queries_on_cuda_equal_the_concatenated_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Qwen3 generating on CUDA with every query captured: the file's queries and every
    snapshot's K are the same with the gather kernels and with ``mx.concatenate``, and the
    tokens are those of a run without capture."""
    import kvformat
    from kvsnap.capture import gather
    from kvsnap.capture.generation import generate
    from kvsnap.capture.tiny import tiny_model
    from tests.capture.test_capture import _tiny_tokenizer

    model, tokenizer = tiny_model("qwen3"), _tiny_tokenizer()
    prompt = list(range(1, 40))
    plain = [r.token for r in generate(model, tokenizer, prompt, max_tokens=40)]
    found: dict[bool, list[Any]] = {}
    rows: dict[bool, list[Any]] = {}
    for use in (True, False):
        monkeypatch.setattr(gather, "on_cuda", lambda use=use: use)
        path = tmp_path / f"run-{use}.kv"
        run = generate(model, tokenizer, prompt, max_tokens=40, output=path, every=8, queries="all")
        tokens = [r.token for r in run]
        assert tokens == plain
        with kvformat.open(path) as snap:
            found[use] = [snap.queries(layer, 1) for layer in range(len(snap.layers))]
            rows[use] = [
                np.asarray(snap.select(index).head(layer, head).k)
                for index in range(snap.num_snapshots)
                for layer in range(snap.num_layers)
                for head in range(snap.layers[layer].num_heads)
            ]
    # the K/V rows the snapshots gathered (`gather.rows` against slicing), every snapshot
    assert len(rows[True]) == len(rows[False]) > 0
    for with_kernel, without in zip(rows[True], rows[False], strict=True):
        np.testing.assert_array_equal(with_kernel, without)
    for with_kernel, without in zip(found[True], found[False], strict=True):
        assert with_kernel is not None and without is not None
        np.testing.assert_array_equal(with_kernel.positions, without.positions)
        np.testing.assert_array_equal(np.asarray(with_kernel.q), np.asarray(without.q))
