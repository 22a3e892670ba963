"""Joining many one-position query pieces on the device with few kernel launches (CUDA).

A snapshot every 16 tokens of a 36-layer model holds 36 x 16 = 576 decode query pieces
``(1, heads, 1, dim)``. ``mx.concatenate`` copies each input with a kernel of its own, launched
from the calling thread, the generating one: about 4 us a launch on CUDA, 2.5 ms a snapshot
(`benchmarks/probes/query_join_probe.py`). `join` copies up to `ARITY` pieces per launch with
one small custom kernel instead (``mx.fast.cuda_kernel``): one source for every count, so mlx
compiles it once per dtype and shape and keeps the binary in its on-disk cache
(``$TMPDIR/mlx/<version>/ptx``, or ``MLX_PTX_CACHE_DIR``); a process that finds it there loads
it. Elsewhere (CPU, Metal), and wherever the kernel cannot be built or run, `join` is
``mx.concatenate``.
"""

from __future__ import annotations

import functools
import itertools
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
