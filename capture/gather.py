"""Joining many small device arrays with few kernel launches (CUDA): a snapshot's query pieces
(`join`) and its layers' new K/V rows (`rows`).

A snapshot every 16 tokens of a 36-layer model holds 36 x 16 = 576 decode query pieces ``(1, heads,
1, dim)``. ``mx.concatenate`` copies each input with a kernel of its own, launched from the calling
thread, the generating one: one launch per piece (`python -m benchmarks.query_join_bench`
times both ways). `join` copies up to `ARITY` pieces per launch with one small custom kernel instead
(``mx.fast.cuda_kernel``): one source for every count, so mlx compiles it once per dtype and shape
and keeps the binary in its on-disk cache (``$TMPDIR/mlx/<version>/ptx``, or ``MLX_PTX_CACHE_DIR``);
a process that finds it there loads it. Elsewhere (CPU, Metal), and wherever the kernel cannot be
built or run, `join` is ``mx.concatenate``.

The same holds for K/V: the 36 layers' new rows are 72 strided slices of the cache buffers, one
copy kernel each through ``mx.concatenate``. `rows` reads the rows out of up to `ARITY` whole
buffers per launch instead, where they lie, with the first row and the count given at run time
(so one binary serves every snapshot, whatever its position or size).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

ARITY = 64
"""Pieces one launch copies (the kernel's inputs; a shorter run repeats its last piece)."""


def on_cuda() -> bool:
    """True where mlx computes on an NVIDIA GPU (its CUDA backend, default device a GPU)."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and bool(cuda.is_available()) and mx.default_device() == mx.gpu


@functools.cache
def _kernel() -> Any:
    cases = "\n".join(f"        case {i}: src = p{i}; break;" for i in range(1, ARITY))
    source = f"""
    auto e = cooperative_groups::this_grid().thread_rank();
    int per = H * D;
    if (e >= {ARITY} * per) return;
    int i = e / per, r = e % per, h = r / D, d = r % D;
    const T* src = p0;
    switch (i) {{
{cases}
    }}
    out[(h * {ARITY} + i) * D + d] = src[r];
    """
    return mx.fast.cuda_kernel(
        name="kvsnap_query_gather",
        input_names=[f"p{i}" for i in range(ARITY)],
        output_names=["out"],
        source=source,
    )


def _gather(pieces: list[mx.array]) -> mx.array:
    """Up to `ARITY` pieces ``(1, heads, 1, dim)`` of one dtype -> ``(1, heads, n, dim)``."""
    count = len(pieces)
    _, heads, _, dim = pieces[0].shape
    inputs = pieces + [pieces[-1]] * (ARITY - count)
    (out,) = _kernel()(
        inputs=inputs,
        template=[("T", pieces[0].dtype), ("H", heads), ("D", dim)],
        grid=(ARITY * heads * dim, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(1, heads, ARITY, dim)],
        output_dtypes=[pieces[0].dtype],
    )
    return out if count == ARITY else out[:, :, :count]


_WORKS: dict[tuple[Any, int, int], bool] = {}
"""Per (dtype, heads, dim): whether the kernel compiled, ran and matched ``mx.concatenate``."""


def _gather_checked(pieces: list[mx.array]) -> mx.array:
    """`_gather`, tried once per dtype and shape (compiled, run, compared with
    ``mx.concatenate``) before it is trusted; where that fails (no NVRTC, no CUDA headers, an mlx
    without ``mx.fast.cuda_kernel``), ``mx.concatenate`` from then on. A failure found only
    later, in the snapshot's asynchronous evaluation, would fail the capture."""
    _, heads, _, dim = pieces[0].shape
    key = (pieces[0].dtype, heads, dim)
    works = _WORKS.get(key)
    if works is None:
        try:
            out = _gather(pieces)
            works = bool(mx.array_equal(out, mx.concatenate(pieces, axis=2)).item())
        except Exception:  # any failure to build or run the kernel: the plain join instead
            works = False
        _WORKS[key] = works
        if works:
            return out  # the checked result itself, not a second launch
    return _gather(pieces) if works else mx.concatenate(pieces, axis=2)


def _one_position(part: mx.array) -> bool:
    return part.shape[0] == 1 and part.shape[2] == 1


def join(parts: list[mx.array], gather: bool | None = None) -> mx.array:
    """``parts`` ``(batch, heads, n_i, dim)`` of one dtype joined along axis 2 (not evaluated).
    With ``gather`` (default: `on_cuda`), runs of one-position pieces of batch 1 are copied
    `ARITY` at a time by one kernel launch each."""
    if len(parts) == 1:
        return parts[0]
    if not (on_cuda() if gather is None else gather):
        return mx.concatenate(parts, axis=2)
    joined: list[mx.array] = []
    for single, group in itertools.groupby(parts, key=_one_position):
        run = list(group)
        if single:
            joined.extend(_gather_checked(run[i : i + ARITY]) for i in range(0, len(run), ARITY))
        else:
            joined.extend(run)
    return joined[0] if len(joined) == 1 else mx.concatenate(joined, axis=2)


@dataclass(frozen=True)
class Rows:
    """Rows ``start .. start + count - 1`` (axis 2) of a cache buffer ``(batch, heads, capacity,
    dim)``, not sliced yet: `rows` copies many of them in one launch."""

    buffer: mx.array
    start: int
    count: int

    @property
    def dtype(self) -> Any:
        return self.buffer.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, heads, count, dim)``."""
        batch, heads, _, dim = self.buffer.shape
        return (batch, heads, self.count, dim)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def array(self) -> mx.array:
        """The rows as a lazy slice of the buffer."""
        return self.buffer[:, :, self.start : self.start + self.count]


@functools.cache
def _rows_kernel() -> Any:
    cases = "\n".join(f"        case {i}: src = p{i}; break;" for i in range(1, ARITY))
    source = f"""
    long long e = cooperative_groups::this_grid().thread_rank();
    long long start = span[0], count = span[1], used = span[2];
    long long heads = p0_shape[1], capacity = p0_shape[2], dim = p0_shape[3];
    long long per = p0_shape[0] * heads * count * dim;
    if (e >= used * per) return;
    long long i = e / per, r = e % per;
    long long sequence_head = r / (count * dim), row = (r / dim) % count, d = r % dim;
    const T* src = p0;
    switch (i) {{
{cases}
    }}
    out[e] = src[(sequence_head * capacity + start + row) * dim + d];
    """
    return mx.fast.cuda_kernel(
        name="kvsnap_rows_gather",
        input_names=["span"] + [f"p{i}" for i in range(ARITY)],
        output_names=["out"],
        source=source,
    )


def _rows_launch(buffers: list[mx.array], start: int, count: int) -> mx.array:
    """Up to `ARITY` buffers of one shape and dtype -> their rows joined along axis 0."""
    used = len(buffers)
    batch, heads, _, dim = buffers[0].shape
    inputs = [mx.array([start, count, used], dtype=mx.int32), *buffers]
    inputs += [buffers[-1]] * (ARITY + 1 - len(inputs))
    (out,) = _rows_kernel()(
        inputs=inputs,
        template=[("T", buffers[0].dtype)],
        grid=(used * batch * heads * count * dim, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(used * batch, heads, count, dim)],
        output_dtypes=[buffers[0].dtype],
    )
    return out


def _sliced(buffers: list[mx.array], start: int, count: int) -> mx.array:
    return mx.concatenate([b[:, :, start : start + count] for b in buffers], axis=0)


_ROWS_WORK: dict[tuple[Any, int, int, int], bool] = {}
"""Per (dtype, batch, heads, dim): whether the rows kernel compiled, ran and matched slicing."""


def rows(buffers: list[mx.array], start: int, count: int, gather: bool | None = None) -> mx.array:
    """Rows ``start .. start + count - 1`` (axis 2) of each of ``buffers`` ``(batch, heads,
    capacity, dim)`` (one shape and dtype), joined along axis 0: ``(len(buffers) * batch, heads,
    count, dim)``, not evaluated (a new buffer, except one buffer's rows off CUDA: a slice). With
    ``gather`` (default: `on_cuda`), `ARITY` buffers a launch; checked once per dtype and
    geometry against slicing (as `join` is), which it falls back to where the kernel fails."""
    if not (on_cuda() if gather is None else gather):
        return _sliced(buffers, start, count)
    batch, heads, _, dim = buffers[0].shape
    key = (buffers[0].dtype, batch, heads, dim)
    works = _ROWS_WORK.get(key)
    parts: list[mx.array] = []
    if works is None:
        try:
            out = _rows_launch(buffers[:ARITY], start, count)
            works = bool(mx.array_equal(out, _sliced(buffers[:ARITY], start, count)).item())
        except Exception:  # any failure to build or run the kernel: slicing instead
            works = False
        _ROWS_WORK[key] = works
        if works:
            parts.append(out)  # the checked result itself, not a second launch
    if not works:
        return _sliced(buffers, start, count)
    for i in range(len(parts) * ARITY, len(buffers), ARITY):
        parts.append(_rows_launch(buffers[i : i + ARITY], start, count))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
