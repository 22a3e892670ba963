"""The compiled pass behind the ``attention`` statistics group (C, `kernels.c`'s
``block_scores``, else numba): one walk over a block of
queries' logits that applies SPEC 10.1's scale, softcap, mask and sinks, takes the softmax, and
adds up every per-query score `head_importance` reports, with no ``(n_queries, n_keys)``
temporaries beyond the weights themselves.

`block_scores` takes the raw products ``q . k`` of a block (BLAS, float32) and overwrites them
with each row's unnormalized softmax numerators ``e_j = exp(x_j - m)`` (float32, exactly 0 where
masked; the weights are ``e_j * INVERSE``, so that the caller normalizes its ``(n, dim)``
products instead of dividing ``(n, n_keys)`` weights) and fills ``rows`` ``(n_queries,
ROW_FIELDS)`` float64 per query:

- ``SINK``, ``LOCAL``: the weight on key positions ``< sinks`` and on visible keys less than
  ``local`` positions back;
- ``ENTROPY`` (nats) from the identity ``log w_j = (x_j - m) - log T`` (``x`` the logit, ``m``
  the row's maximum, ``T`` the softmax denominator): no logarithm per key;
- ``VISIBLE``: how many keys the query sees; ``DISTANCE``: ``sum w_j (p - j)``;
- ``TOP``: the column of the largest weight (the first one on ties; 0 when every weight is 0);
- ``KEPT``: the sum of the weights a streaming head keeps (key positions ``< sinks`` or less
  than ``stream_window`` back); ``SINK_SHARE``: the share of the layer's own sink
  (``exp(sink - m) / T``, 0 without sinks): a streaming head keeps it too;
- ``INVERSE``: ``1 / T`` (``T`` rounded to float32, as the attention kernels divide by it).

The keys must be in position order (as caches hold them), so that what a query sees is at most
two column ranges found by binary search, and every masked sum is a sum over ranges. The
arithmetic per key is float32 as the attention kernels compute it, in loops over those ranges
that LLVM vectorizes: the logits' maximum (on the raw products: ``scale > 0`` keeps the order),
the search for its first column, and the exponentials (`_exp`, a polynomial within 1 ulp) of
``products * scale - m`` with their sums. Those sums are float32 within each `CHUNK` of keys (at
the float32 vector width) and float64 across chunks; the distance sums ``p - j`` directly (key
positions from the first key's, in float32: exact below 2**24 positions of span), not ``p T -
sum e_j j``, which cancels. It agrees with `kvformat.attention.weights` to float32 rounding,
which the tests hold it to; the largest weight is taken as the largest logit (they differ only
where two weights round to one float32). The passes assume finite logits: the caller sends blocks
whose keys are out of order, or whose logits could overflow or hold a NaN or inf, down the numpy
path. The functions below are the definition and numba's version; where the C library is built
(`native`) its ``block_scores`` runs instead and numba is never imported. Without either
(`AVAILABLE` false, or ``KVSNAP_KERNEL=numpy``) only the numpy path runs. Measured in
`python -m benchmarks.needle` and `python -m benchmarks.attention_group_bench`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from . import native

SELECTED = os.environ.get("KVSNAP_KERNEL", "compiled")
numba: Any = native.numba_fallback() if SELECTED != "numpy" else None
AVAILABLE = SELECTED != "numpy" and (native.AVAILABLE or numba is not None)

SINK, LOCAL, ENTROPY, VISIBLE, DISTANCE, TOP, KEPT, SINK_SHARE, INVERSE = range(9)
ROW_FIELDS = 9
CHUNK = 512  # keys per float32 partial sum (its rounding grows with it), and per search step


def _exp(d: np.float32) -> np.float32:
    """``exp(d)`` in float32 for ``d <= 0`` (Cephes ``expf``: range reduction by ln 2, a degree-6
    polynomial, the power of two built from its bits; within 1 ulp of the true value), 0 below
    float32's normal range. Plain arithmetic, so a loop calling it vectorizes."""
    x = np.float32(max(d, np.float32(-87.33654)))
    n = np.rint(x * np.float32(1.442695041))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    poly = np.float32(1.9875691500e-4)
    poly = poly * r + np.float32(1.3981999507e-3)
    poly = poly * r + np.float32(8.3334519073e-3)
    poly = poly * r + np.float32(4.1665795894e-2)
    poly = poly * r + np.float32(1.6666665459e-1)
    poly = poly * r + np.float32(5.0000001201e-1)
    value = poly * r * r + r + np.float32(1.0)
    scale = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
    return value * scale if d >= np.float32(-87.33654) else np.float32(0.0)


# The helpers below take a range of a row as a slice and loop from 0: with a loop start numba
# cannot prove non-negative, every index gets a negative-index check and nothing vectorizes.


def _largest(values: np.ndarray, top: np.float32) -> np.float32:
    """The largest of ``top`` and ``values`` (finite float32), taken on the floats' bits as
    order-preserving integers: an integer max vectorizes where a float one does not."""
    bits = values.view(np.int32)
    shift, magnitude = np.int32(31), np.int32(0x7FFFFFFF)
    start = np.float32(top).view(np.int32)
    best = np.int32(start ^ ((start >> shift) & magnitude))
    for c in range(bits.shape[0]):
        v = bits[c]
        best = np.int32(max(best, np.int32(v ^ ((v >> shift) & magnitude))))
    return np.int32(best ^ ((best >> shift) & magnitude)).view(np.float32)


def _first(values: np.ndarray, value: np.float32) -> int:
    """The index of the first of ``values`` equal to ``value``, else -1: a count per `CHUNK`
    (which vectorizes), then a scan of the chunk that holds it."""
    for start in range(0, values.shape[0], CHUNK):
        chunk = values[start : start + CHUNK]
        hits = 0
        for c in range(chunk.shape[0]):
            hits += chunk[c] == value
        if hits:
            for c in range(chunk.shape[0]):
                if chunk[c] == value:
                    return start + c
    return -1


def _exponentials(
    values: np.ndarray, scale: np.float32, top: np.float32, back: np.float32, positions: np.ndarray
) -> tuple[float, float, float]:
    """``values`` (products) become ``exp(logit - top)``, the logit ``values * scale``; returns
    the sums of ``e``, of ``e (logit - top)`` and of ``e (back - positions)`` (``positions``
    float32, ``back`` the query's position on the same scale). Each `CHUNK` is summed in float32
    (vectorized at the float32 width), the chunks in float64."""
    total = 0.0
    weighted = 0.0
    moment = 0.0
    for start in range(0, values.shape[0], CHUNK):
        chunk, at = values[start : start + CHUNK], positions[start : start + CHUNK]
        chunk_total = np.float32(0.0)
        chunk_weighted = np.float32(0.0)
        chunk_moment = np.float32(0.0)
        for c in range(chunk.shape[0]):
            d = chunk[c] * scale - top
            e = _exp(d)
            chunk[c] = e
            chunk_total += e
            chunk_weighted += e * d
            chunk_moment += e * (back - at[c])
        total += np.float64(chunk_total)
        weighted += np.float64(chunk_weighted)
        moment += np.float64(chunk_moment)
    return total, weighted, moment


def _sum(values: np.ndarray) -> float:
    total = 0.0
    for c in range(values.shape[0]):
        total += np.float64(values[c])
    return total


def _cap(values: np.ndarray, scale: float, softcap: float) -> None:
    """``values`` (raw products) become capped logits: ``softcap * tanh(values * scale / softcap)``."""
    scale32, cap = np.float32(scale), np.float32(softcap)
    for c in range(values.shape[0]):
        values[c] = cap * np.float32(math.tanh(values[c] * scale32 / cap))


def _logit_factor(first: np.ndarray, second: np.ndarray, scale: float, softcap: float) -> np.float32:
    """What the values of ``first`` and ``second`` are multiplied by to give logits: ``scale``
    (applied in the exponentials' pass; ``scale > 0`` keeps the largest product the largest
    logit), or 1 once a ``softcap > 0`` has made them capped logits here."""
    if softcap > 0:
        _cap(first, scale, softcap)
        _cap(second, scale, softcap)
        return np.float32(1.0)
    return np.float32(scale)


def _block_scores(
    logits: np.ndarray,
    rows: np.ndarray,
    query_positions: np.ndarray,
    key_positions: np.ndarray,
    scale: float,
    softcap: float,
    window: int,
    keep: int,
    sink: float,
    has_sink: bool,
    sinks: int,
    local: int,
    stream_window: int,
) -> None:
    """See the module docstring. ``logits`` ``(n, m)`` float32, finite; ``rows`` ``(n,
    ROW_FIELDS)`` float64; ``key_positions`` ``(m,)`` int64, increasing; ``softcap`` 0 for none;
    ``window`` -1 for no sliding window.

    The keys being in order, what a query at ``p`` sees is at most two column ranges, ``[0,
    early)`` and ``[late, end)`` (``end``: keys at ``j <= p``; with a window, ``early``: keys at
    ``j < keep``, ``late``: keys less than ``window - keep`` back), found by binary search; every
    sum over a mask of SPEC 10.1 or of the scores is a sum over such ranges."""
    n = logits.shape[0]
    # Positions from the first key's, in float32 (exact below 2**24 tokens of span).
    base = key_positions[0] if key_positions.shape[0] else 0
    as_float = (key_positions - base).astype(np.float32)
    sink_end = np.searchsorted(key_positions, sinks, "left")
    for i in range(n):
        p = query_positions[i]
        row = logits[i]
        out = rows[i]
        out[:] = 0.0
        end = np.searchsorted(key_positions, p, "right")
        early, late = end, end
        if window >= 0:
            early = min(np.searchsorted(key_positions, keep, "left"), end)
            late = max(np.searchsorted(key_positions, p - (window - keep), "right"), early)
        row[early:late] = 0.0
        row[end:] = 0.0
        first, second = row[:early], row[late:end]  # what the query sees
        factor = _logit_factor(first, second, scale, softcap)
        visible = early + (end - late)
        out[VISIBLE] = visible
        top = _largest(second, _largest(first, MASKED))
        best = _first(first, top)
        out[TOP] = best if best >= 0 else max(late + _first(second, top), 0)
        top = top * factor if visible else MASKED
        if has_sink:
            top = max(top, np.float32(sink))
        if not visible and not has_sink:
            continue
        back = np.float32(p - base)
        total, weighted, moment = _exponentials(first, factor, top, back, as_float[:early])
        more = _exponentials(second, factor, top, back, as_float[late:end])
        total, weighted, moment = total + more[0], weighted + more[1], moment + more[2]
        share = np.float64(_exp(np.float32(sink) - top)) if has_sink else 0.0
        total32 = np.float32(total + share)
        inverse = 1.0 / np.float64(total32)
        out[INVERSE] = inverse
        recent = max(np.searchsorted(key_positions, p - stream_window, "right"), min(sink_end, end))
        near = np.searchsorted(key_positions, p - local, "right")
        out[SINK] = _sum(row[: min(sink_end, end)]) * inverse
        out[LOCAL] = _sum(row[near:end]) * inverse
        out[KEPT] = out[SINK] + _sum(row[recent:end]) * inverse
        out[DISTANCE] = moment * inverse
        # -sum w log w with log w = (x - top) - log T: no logarithm per key.
        out[ENTROPY] = -weighted * inverse + math.log(np.float64(total32)) * total * inverse
        out[SINK_SHARE] = share * inverse


MASKED = np.float32(-3.0e38)
"""Below every logit the pass sees (they are finite and bounded by the caller)."""

# The logits are finite (`block_scores`' caller bounds them), so the passes may take the
# fast-math liberties that let LLVM vectorize their float64 sums.
_FLAGS = {"nnan", "ninf", "nsz", "reassoc", "contract"}
if numba is not None:
    _exp = numba.njit(cache=True, nogil=True, fastmath=_FLAGS, inline="always")(_exp)
    _largest = numba.njit(cache=True, nogil=True, fastmath=_FLAGS)(_largest)
    _first = numba.njit(cache=True, nogil=True)(_first)
    _exponentials = numba.njit(cache=True, nogil=True, fastmath=_FLAGS)(_exponentials)
    _sum = numba.njit(cache=True, nogil=True, fastmath=_FLAGS)(_sum)
    _cap = numba.njit(cache=True, nogil=True, fastmath=_FLAGS)(_cap)
    _logit_factor = numba.njit(cache=True, nogil=True, fastmath=_FLAGS)(_logit_factor)
    block_scores = numba.njit(cache=True, nogil=True, fastmath=_FLAGS)(_block_scores)
elif native.AVAILABLE:
    block_scores = native.block_scores
else:  # pragma: no cover
    block_scores = _block_scores
