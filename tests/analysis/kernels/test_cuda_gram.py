"""`cuda_gram`'s build and cache logic, which runs anywhere (the kernel itself runs only on
CUDA: `tests/analysis/kernels/test_mlx_cuda.py`): the cubin is compiled once per machine and architecture,
kept atomically, recompiled when the kept file is not a cubin, and a machine where it cannot
be built falls back to mlx's matrix product with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsnap.analysis.kernels import cuda_gram

FAKE = b"\x7fELF fake cubin"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[int, int]]:
    """An empty cache in tmp_path, no binary in memory, a device of architecture 9.0 and a
    compiler that records its calls."""
    monkeypatch.setenv("KVSNAP_CACHE", str(tmp_path))
    monkeypatch.setattr(cuda_gram, "_BINARY", [])
    monkeypatch.setattr(cuda_gram, "_PROBLEM", [])
    monkeypatch.setattr(cuda_gram, "architecture", lambda: (9, 0))
    calls: list[tuple[int, int]] = []

    def compile_binary(source: str, arch: tuple[int, int]) -> bytes:
        assert source == cuda_gram.SOURCE
        calls.append(arch)
        return FAKE

    monkeypatch.setattr(cuda_gram, "compile_binary", compile_binary)
    return calls


def test_compiled_once_then_loaded(fresh: list[tuple[int, int]], tmp_path: Path) -> None:
    assert cuda_gram.binary() == FAKE and fresh == [(9, 0)]
    (kept,) = (tmp_path / "cuda").iterdir()
    assert kept.name.startswith("kvsnap_gram-sm90-") and kept.read_bytes() == FAKE
    cuda_gram._BINARY.clear()  # a new process: the file is read, nothing compiled
    assert cuda_gram.binary() == FAKE and fresh == [(9, 0)]
    assert not list((tmp_path / "cuda").glob("*.part"))


def test_another_architecture_or_source_is_another_file(
    fresh: list[tuple[int, int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda_gram.binary()
    cuda_gram._BINARY.clear()
    monkeypatch.setattr(cuda_gram, "architecture", lambda: (8, 0))
    cuda_gram.binary()
    assert fresh == [(9, 0), (8, 0)]
    assert len(list((tmp_path / "cuda").iterdir())) == 2


def test_a_kept_file_that_is_not_a_cubin_is_rebuilt(fresh: list[tuple[int, int]], tmp_path: Path) -> None:
    cuda_gram.binary()
    (kept,) = (tmp_path / "cuda").iterdir()
    kept.write_bytes(b"garbage")
    cuda_gram._BINARY.clear()
    assert cuda_gram.binary() == FAKE and len(fresh) == 2
    assert kept.read_bytes() == FAKE


def test_an_unwritable_cache_still_gives_the_binary(
    fresh: list[tuple[int, int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVSNAP_CACHE", str(blocker))
    assert cuda_gram.binary() == FAKE


def test_no_compiler_falls_back_with_a_warning(
    fresh: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(source: str, arch: tuple[int, int]) -> bytes:
        raise cuda_gram.CudaGramError("libnvrtc not found (mlx's CUDA build installs it)")

    monkeypatch.setattr(cuda_gram, "compile_binary", missing)
    with pytest.warns(UserWarning, match="libnvrtc not found"):
        assert cuda_gram.usable() is False
    assert cuda_gram.usable() is False  # asked once: no second warning, no second try


def test_a_missing_library_is_named() -> None:
    with pytest.raises(cuda_gram.CudaGramError, match="libkvsnap-absent not found"):
        cuda_gram._library("libkvsnap-absent", ("libkvsnap-absent.so.1",))


def test_turned_off_by_the_environment(fresh: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSNAP_CUDA_GRAM", "0")
    assert cuda_gram.usable() is False and fresh == []  # nothing compiled, no warning
    monkeypatch.setenv("KVSNAP_CUDA_GRAM", "1")
    assert cuda_gram.usable() is True and fresh == [(9, 0)]


@pytest.mark.parametrize("batched", [False, True])
def test_the_per_piece_function_takes_its_product_from_the_kernel(
    monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    """Where the kernel is used (CUDA), the compiled function hands its shifted rows to
    `gram_product` and returns its result as ``product``: here on CPU mlx with a stand-in
    kernel (mlx's matmul per piece), the outputs equal the plain function's, batched or not."""
    import mlx.core as mx
    import numpy as np

    from kvsnap.analysis.kernels import mlx as mlx_backend
    from kvsnap.analysis.kernels import mlx_fold, mlx_staging

    seen: list[tuple[int, ...]] = []

    def product(shifted: mx.array) -> mx.array:
        seen.append(tuple(shifted.shape))
        return mx.matmul(shifted.transpose(0, 2, 1), shifted)

    flags = (True, True, False, True, True, False)
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((2, 3000, 48)).astype(np.float32)
    rows[:, 7] *= 30.0
    bins = np.zeros((2, 3000), np.uint8)
    x, b = (mx.array(rows), mx.array(bins)) if batched else (mx.array(rows[0]), mx.array(bins[0]))
    plain = mlx_fold.to_host(mlx_backend.piece_function(*flags, batched=batched)(x, b))
    monkeypatch.setattr(mlx_staging, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda_gram, "usable", lambda: True)
    monkeypatch.setattr(cuda_gram, "gram_product", product)
    monkeypatch.setattr(mlx_backend, "_COMPILED", {})
    own = mlx_fold.to_host(mlx_backend.piece_function(*flags, batched=batched)(x, b))
    assert seen == [(2, 3000, 48) if batched else (1, 3000, 48)]
    assert own.keys() == plain.keys() and "shifted" not in own
    for name in plain:
        np.testing.assert_allclose(own[name], plain[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert (own["heavy"] == 1).all()
