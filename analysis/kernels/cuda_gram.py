"""The Gram product of a batch of pieces on a CUDA device, by kvsnap's own kernel, for the mlx
backend (`mlx`) where mlx computes on CUDA.

Why not mlx's matrix product: on CUDA that is cuBLAS, whose first use loads its kernel module
into each process's host memory. This kernel is one small module (a 12 KiB cubin) summing in
float32 FMAs: within 2e-5 of the largest entry of float64's product in
`tests/analysis/kernels/test_mlx_cuda.py`, where cuBLAS's float32 product on the same 8192-row pieces was 7e-5
off this kernel's.

Why precompiled: mlx 0.32's ``mx.fast.cuda_kernel`` compiles its source with NVRTC in every
process (it is not in mlx's PTX cache), with the compiler's time and memory each time. Here
NVRTC (the library mlx's CUDA build ships, through ctypes) compiles `SOURCE` once per machine
for the device's architecture; the binary is kept in `cache_dir` (written atomically) and
handed to ``mx.fast.precompiled_cuda_kernel``, so later processes only load it.
``KVSNAP_CUDA_GRAM=0`` turns it off (mlx's matrix product, as on Metal and the CPU).

Layout: ``gram_product(shifted)`` for ``shifted`` ``(B, n, dim)`` float32 returns ``(B, dim,
dim)`` float32. One thread block per ``(TILE, TILE)`` output tile and chunk of `CHUNK` rows of one
piece; each of its 256 threads sums a 4 x 4 block of entries over the chunk's rows in order
(float32); mlx adds the chunks' sums.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from kvformat import KVSnapError

from ..dependencies import mx
from . import cuda_driver

TILE = 64  # output tile of one thread block: (TILE, TILE) entries
CHUNK = 1024  # rows one thread block sums
NAME = "kvsnap_gram"

SOURCE = r"""
extern "C" __global__ void kvsnap_gram(const float* rows, float* out, int n, int dim) {
    // out[b, c] = rows[b, c*chunk : (c+1)*chunk].T @ the same rows, (dim, dim); grid
    // (tiles * tiles, chunks, pieces) of 256 threads; each thread sums 4 x 4 entries.
    constexpr int TILE = 64;
    constexpr int STEP = 16;  // rows staged in shared memory at a time
    __shared__ __align__(16) float left[STEP][TILE];
    __shared__ __align__(16) float right[STEP][TILE];
    const int tiles = (dim + TILE - 1) / TILE;
    const int ti = blockIdx.x / tiles, tj = blockIdx.x % tiles;
    const int chunk = (n + gridDim.y - 1) / gridDim.y;
    const int start = blockIdx.y * chunk;
    const int stop = min(n, start + chunk);
    const float* x = rows + (size_t)blockIdx.z * n * dim;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int r0 = start; r0 < stop; r0 += STEP) {
        for (int e = threadIdx.x; e < STEP * TILE; e += blockDim.x) {
            const int r = e / TILE, c = e % TILE, row = r0 + r;
            const int ci = ti * TILE + c, cj = tj * TILE + c;
            left[r][c] = (row < stop && ci < dim) ? x[(size_t)row * dim + ci] : 0.0f;
            right[r][c] = (row < stop && cj < dim) ? x[(size_t)row * dim + cj] : 0.0f;
        }
        __syncthreads();
        for (int r = 0; r < STEP; ++r) {
            const float4 a = *reinterpret_cast<const float4*>(&left[r][ty * 4]);
            const float4 b = *reinterpret_cast<const float4*>(&right[r][tx * 4]);
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[4] = {b.x, b.y, b.z, b.w};
            for (int i = 0; i < 4; ++i)
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
    float* o = out + ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * dim * dim;
    for (int i = 0; i < 4; ++i) {
        const int gi = ti * TILE + ty * 4 + i;
        for (int j = 0; j < 4; ++j) {
            const int gj = tj * TILE + tx * 4 + j;
            if (gi < dim && gj < dim) o[(size_t)gi * dim + gj] = acc[i][j];
        }
    }
}
"""


class CudaGramError(KVSnapError, RuntimeError):
    """The kernel could not be built here (no NVRTC or CUDA driver found, or NVRTC failed)."""


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$KVSNAP_CACHE/cuda`` (default ``~/.cache/kvsnap``)."""
    root = os.environ.get("KVSNAP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvsnap")
    return Path(root) / "cuda"


def _library(prefix: str, names: tuple[str, ...]) -> ctypes.CDLL:
    found = cuda_driver.library(prefix, names)
    if found is None:
        raise CudaGramError(f"{prefix} not found (mlx's CUDA build installs it)")
    return found


def architecture() -> tuple[int, int]:
    """Compute capability of CUDA device 0 (mlx's default GPU), from the driver."""
    cuda = _library("libcuda", ("libcuda.so.1", "libcuda.so"))
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    for call in (
        lambda: cuda.cuInit(0),
        lambda: cuda.cuDeviceGet(ctypes.byref(device), 0),
        lambda: cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device),  # ..._MAJOR
        lambda: cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device),  # ..._MINOR
    ):
        status = call()
        if status:
            raise CudaGramError(f"the CUDA driver answered {status} asking for the device's architecture")
    return major.value, minor.value


def compile_binary(source: str, arch: tuple[int, int]) -> bytes:
    """``source`` compiled by NVRTC to a cubin for ``sm_{major}{minor}``."""
    nvrtc = _library("libnvrtc", ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"))
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(status: int, what: str) -> None:
        if status:
            raise CudaGramError(f"NVRTC {what}: {nvrtc.nvrtcGetErrorString(status).decode()}")

    program = ctypes.c_void_p()
    check(
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(program), source.encode(), f"{NAME}.cu".encode(), 0, None, None
        ),
        "create",
    )
    try:
        options = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}".encode()]
        array = (ctypes.c_char_p * len(options))(*options)
        status = nvrtc.nvrtcCompileProgram(program, len(options), array)
        if status:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise CudaGramError(f"NVRTC could not compile {NAME}: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "cubin size")
        binary = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(program, binary), "cubin")
        return binary.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _keep(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place; an unwritable
    cache is left alone (the next process compiles again)."""
    part = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".part") as part:
            part.write(data)
        os.replace(part.name, path)
    except OSError:
        if part is not None:
            Path(part.name).unlink(missing_ok=True)


_PROBLEM: list[str] = []


def usable() -> bool:
    """Whether to use the kernel: not where ``KVSNAP_CUDA_GRAM=0`` (mlx's matrix product then,
    as everywhere but CUDA), nor where it cannot be built (no NVRTC, a failed compile: warns once
    with the reason)."""
    if os.environ.get("KVSNAP_CUDA_GRAM") == "0":
        return False
    if _BINARY:
        return True
    if _PROBLEM:
        return False
    try:
        binary()
        return True
    except (CudaGramError, OSError, AttributeError) as error:
        _PROBLEM.append(str(error))
        warnings.warn(
            f"kvsnap's CUDA Gram kernel is not available ({error}); using mlx's matmul", stacklevel=2
        )
        return False


_BINARY: list[bytes] = []
_LOCK = threading.Lock()


def binary() -> bytes:
    """The kernel's cubin for this device: from `cache_dir` if an earlier process compiled it
    (the file's name holds a hash of the source and the architecture), else compiled now and
    kept there (written to a temporary file, then renamed: a reader never sees half a file)."""
    with _LOCK:
        if _BINARY:
            return _BINARY[0]
        arch = architecture()
        key = hashlib.sha256(f"{SOURCE}\n{arch}".encode()).hexdigest()[:16]
        path = cache_dir() / f"{NAME}-sm{arch[0]}{arch[1]}-{key}.cubin"
        try:
            compiled = path.read_bytes()
        except OSError:
            compiled = b""
        if not compiled.startswith(b"\x7fELF"):  # absent or not a cubin: build it
            compiled = compile_binary(SOURCE, arch)
            _keep(path, compiled)
        _BINARY.append(compiled)
        return compiled


def gram_product(shifted: Any) -> Any:
    """``(B, dim, dim)`` float32: ``shifted[b].T @ shifted[b]`` for the mlx array ``shifted``
    ``(B, n, dim)`` float32 on a CUDA device."""

    batch, n, dim = shifted.shape
    tiles = -(-dim // TILE)
    chunks = max(1, -(-n // CHUNK))
    (partial,) = mx.fast.precompiled_cuda_kernel(
        name=NAME,
        compiled_source=binary(),
        inputs=[shifted],
        output_shapes=[(batch, chunks, dim, dim)],
        output_dtypes=[mx.float32],
        scalars=[n, dim],
        grid=(tiles * tiles * 256, chunks, batch),
        threadgroup=(256, 1, 1),
        ensure_row_contiguous=True,
    )
    return partial.sum(axis=1)
