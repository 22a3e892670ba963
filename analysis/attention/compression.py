"""KV-compression what-ifs on a saved generation: per query head, how much the attention output
would have changed had the cache been compressed by a method at a budget.

The cache is compressed once, after the compressed span (as kvpress and the papers' evaluations
do): with ``compress="prompt"`` (default) the whole prompt, with ``compress="context"`` the keys
before ``question_start`` (kvpress compresses the context and leaves the question that follows it
uncompressed). A method keeps ``max(1, floor(budget * n))`` of the span's ``n`` keys (kvpress's
rounding); every later key stays. The decode queries (positions at or after the prompt's end;
without any, those from the span's end, or the last ``window`` queries before it) then attend to
what is left, with the layer's recorded scale, mask, softcap and sinks
(`kvformat.attention.weights` over the kept keys: the full softmax renormalized over them). Each
head's inputs are exact (the file's own queries, keys and values), so the error is per head; an
end-to-end figure, where each layer's error feeds the next, compounds and is larger. Per (method,
budget, layer, head):

- ``relative_error``: ``||o' - o||_F / ||o||_F`` over those queries (``o = weights @ V``);
- ``top1_agreement``: the fraction of those queries whose most-attended key is the same;
- ``keys_evicted``: how many keys an eviction method left out (null for quantization); 0 where
  the budget keeps the whole span (a short prompt), whose error is then 0 by construction and
  says nothing of the method: the command's summary marks it.

Eviction methods (which keys of the span stay; ties between equal scores go to the earlier key):

- ``streaming``: StreamingLLM (Xiao et al. 2023) as kvpress's ``StreamingLLMPress``: the first 4
  keys and the most recent ones;
- ``snapkv``: SnapKV (Li et al. 2024) as kvpress's ``SnapKVPress``: the observation window (the
  last ``window`` queries of the span, default 64) is always kept; every earlier key is scored by
  the window's attention to it, averaged over the window's queries, pooled over ``kernel`` (5)
  neighbouring keys (``pooling="avg"``: zero-padded average, as ``avg_pool1d``; ``"max"``: the
  maximum, as some SnapKV ports do), then averaged over the query heads that share the KV head;
- ``pyramidkv``: PyramidKV (Cai et al. 2024) as kvpress's ``PyramidKVPress``
  (``presses/pyramidkv_press.py``, ``get_layer_budget``): SnapKV's choice with a budget per layer,
  largest in the first layer and falling linearly to the last (``beta`` 20), the layers' mean the
  budget given;
- ``adakv``: AdaKV (Feng et al. 2024) as kvpress's ``AdaKVPress`` (``presses/adakv_press.py``,
  ``compress``) over a scorer (``adakv_scorer``, default ``snapkv``): the layer's budget shared
  among its KV heads: each head keeps its top 20% of its share (``alpha_safeguard``), then the
  layer's lowest-scoring keys over all its heads go, so a head whose scores are concentrated keeps
  fewer keys and a diffuse one more;
- ``observed``: kvpress's ``ObservedAttentionPress``: each key's attention summed over every query
  of the span and divided by how many of them see it (``n - j`` for key ``j``), averaged over the
  group; needs every query of the span (``--queries all``);
- ``tova``: TOVA (Oren et al. 2024) as kvpress's ``TOVAPress`` (``presses/tova_press.py``,
  ``score``): the last query of the span's attention, averaged over every query head of the layer
  (not only the group's), the same for every KV head; the last key always stays;
- ``expected_attention``: kvpress's ``ExpectedAttentionPress``
  (``presses/expected_attention_press.py``, ``get_query_statistics``, ``apply_avg_rope`` and
  ``score``; Devoto et al. 2025) with its defaults: each query head's pre-RoPE queries (the file's
  own, RoPE undone with the rotation the file records) over the span after the 4 sinks give a mean
  and covariance, both carried through the mean rotation of the next 512 positions; each key
  scores ``softmax(k . mu / sqrt(d) + k^T Sigma k / 2d)``, averaged over the group, times
  ``||v||``; the sinks always stay. Needs every query of the span (``--queries all``) and a RoPE
  the file describes;
- ``knorm``: kvpress's ``KnormPress`` (``presses/knorm_press.py``; Devoto et al. 2024): the keys of
  smallest L2 norm;
- ``keydiff``: KeyDiff (Park et al. 2025) as kvpress's ``KeyDiffPress``
  (``presses/keydiff_press.py``): the keys least similar (cosine) to the mean of the span's
  normalized keys;
- ``lagkv``: LagKV (Liang et al. 2025) as kvpress's ``LagKVPress`` (``presses/lagkv_press.py``,
  ``score`` and ``_get_states_score``): the 4 sinks and the last partitions stay; in each earlier
  partition of ``lag`` keys (128), keys ranked by the spread (standard deviation over channels) of
  their K and V scaled by the next partition's per-channel range, a softmax over the partition,
  K's and V's averaged; a span shorter than ``4 + 2 lag`` keeps the sinks and the most recent;
- ``cur``: CurDKV (Sengupta et al. 2025) as kvpress's ``CURPress`` (``presses/cur_press.py``,
  defaults): each key's squared K norm times its squared V norm, each normalized within its block
  of 16 keys; the 4 sinks always stay;
- ``h2o``: H2O (Zhang et al. 2023) as the paper defines it (kvpress has no H2O press): half the
  budget the most recent keys, half the heavy hitters, the keys with the most attention
  accumulated (summed) over every query of the span the file holds and over the group;
- ``random``: a uniform sample (seeded), the baseline.

Quantization methods (every key kept; ``budget`` is bits / 16, against float16):

- ``kivi2``, ``kivi4`` (KIVI): K quantized per channel in groups of 32 tokens, V per token;
- ``token2``, ``token4``: K and V both per token. Asymmetric min-max integer quantization.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvformat
from kvformat import pages
from kvformat.attention import BLOCK, context_keys
from kvformat.attention import logits as attention_logits
from kvformat.attention import weights as attention_weights

from ..dependencies import futures_process, pl, tqdm
from ..engine import executors, processes
from ..engine.parallel import single_threaded_blas
from ..errors import AnalysisError
from ..kernels import attention as attention_kernel
from ..kernels import native
from ..kernels.arrays import float32_rows
from ..machine import cores
from ..stats.rope import Rope
from .head_importance import (
    FINITE,
    NoQueriesError,
    block_rows,
    layers_with_queries,
    prompt_end,
    query_layers,
)
from .names import EVICTION, METHODS, NOT_FROM_A_FILE, QUANTIZATION

BUDGETS = (0.1, 0.25, 0.5)
ADAKV_SCORERS = ("snapkv", "tova", "expected_attention", "knorm", "keydiff", "lagkv", "cur")
"""The scorers AdaKV shares a layer's budget by (kvpress's ScorerPresses that kvsnap computes)."""
SAFEGUARD = 0.2
"""AdaKV's ``alpha_safeguard``: the share of its budget every head keeps by its own ranking."""
OBSERVATION = 64  # SnapKV's observation window, queries (kvpress's default)
SINKS = 4
POOL = 5  # SnapKV's pooling kernel, keys
POOLINGS = ("avg", "max")
COMPRESS = ("prompt", "context")
GROUP = 32  # KIVI's group of tokens for per-channel K


class CompressionError(AnalysisError):
    """A what-if the file or the options cannot give: a method it lacks the queries for, options
    out of range, a kvpress method that needs more than a file (one line naming it)."""


class CompressionWarning(UserWarning):
    """A what-if whose result says little about the method (a budget no larger than SnapKV's
    observation window), or queries left out (keys the file no longer holds)."""


@dataclass(frozen=True)
class Options:
    """How the keys are chosen: SnapKV's observation ``window`` (queries; None: kvpress's 64, or
    as many queries as the file holds before the span's end where it holds fewer, said in a
    `CompressionWarning`: `resolve_window`), pooling ``kernel`` (keys, odd) and ``pooling``
    (`POOLINGS`); which span is compressed (``compress``, `COMPRESS`; ``"context"`` needs
    ``question_start``, the position where the uncompressed question begins); the ``seed`` of
    ``random``."""

    window: int | None = None
    kernel: int = POOL
    pooling: str = "avg"
    compress: str = "prompt"
    question_start: int | None = None
    seed: int = 0
    lag: int = 128
    adakv_scorer: str = "snapkv"

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise CompressionError(f"window must be a positive number of queries, not {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise CompressionError(f"kernel must be a positive odd number of keys, not {self.kernel}")
        if self.pooling not in POOLINGS:
            raise CompressionError(f"pooling must be one of {', '.join(POOLINGS)}, not {self.pooling!r}")
        if self.compress not in COMPRESS:
            raise CompressionError(f"compress must be one of {', '.join(COMPRESS)}, not {self.compress!r}")
        if self.adakv_scorer not in ADAKV_SCORERS:
            raise CompressionError(
                f"adakv_scorer must be one of {', '.join(ADAKV_SCORERS)}, not {self.adakv_scorer!r}"
            )
        if self.lag < 1:
            raise CompressionError(f"lag must be a positive number of keys, not {self.lag}")
        if self.compress == "context" and self.question_start is None:
            raise CompressionError(
                "compress='context' needs question_start: the position where the question begins"
            )

    @property
    def observation(self) -> int:
        """The observation window in queries (`OBSERVATION` until `resolve_window` sets it)."""
        return OBSERVATION if self.window is None else self.window

    def span_end(self, snap: kvformat.Snapshot) -> int:
        """The first position after the compressed span."""
        if self.compress == "context":
            assert self.question_start is not None
            return self.question_start
        end = prompt_end(snap)
        if end is None:
            raise CompressionError(
                f"{snap.name} records no prompt length: give the span with compress='context' and "
                "question_start (--compress context --question-start P)"
            )
        return end


@dataclass(frozen=True)
class _Head:
    """One query head's inputs: its complete queries (those that saw every one of their keys)
    and the keys and values its KV head's queries saw."""

    spec: Any
    head: int
    q: np.ndarray
    q_positions: np.ndarray
    k: np.ndarray
    v: np.ndarray
    k_positions: np.ndarray


def check_methods(methods: Iterable[str]) -> list[str]:
    """``methods`` as a list; ValueError naming an unknown one."""
    chosen = list(methods)
    for refused in (m for m in chosen if m in NOT_FROM_A_FILE):
        raise CompressionError(NOT_FROM_A_FILE[refused])
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise CompressionError(f"unknown method {unknown[0]!r}: one of {', '.join(METHODS)}")
    return chosen


def kept_count(budget: float, n: int) -> int:
    """Keys kept of ``n`` at ``budget``: ``max(1, floor(budget * n))`` (kvpress's ``compute_n_kept``),
    at most ``n``."""
    return min(n, max(1, math.floor(budget * n + 1e-9)))


def _pool(scores: np.ndarray, width: int, pooling: str) -> np.ndarray:
    """``scores`` ``(..., n)`` pooled over ``width`` neighbouring keys (centred, ``width`` odd):
    the zero-padded mean (``avg_pool1d`` with ``count_include_pad``) or the maximum."""
    half = width // 2
    if pooling == "avg":
        padded = np.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(half, half)])
        windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
        return windows.sum(axis=-1) / width
    padded = np.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(half, half)], constant_values=-np.inf)
    return np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1).max(axis=-1)


def _top(scores: np.ndarray, count: int, among: np.ndarray) -> np.ndarray:
    """Indices (into ``scores``) of the ``count`` highest among the boolean ``among``, the earlier
    key kept among equal scores and NaN the lowest (a set: in no particular order)."""
    candidates = np.flatnonzero(among)
    if count <= 0 or not candidates.size:
        return np.empty(0, np.int64)
    if count >= candidates.size:
        return candidates
    # The set a stable sort by score would keep (NaN last), found by partition: every candidate
    # better than the count-th best score, then the earliest of those equal to it.
    worse = -scores[candidates]
    kth = np.partition(worse, count - 1)[count - 1]
    if np.isnan(kth):
        held = ~np.isnan(worse)
        return np.concatenate([candidates[held], candidates[~held][: count - int(held.sum())]])
    better = candidates[worse < kth]
    return np.concatenate([better, candidates[worse == kth][: count - better.size]])


def kept_keys(
    method: str,
    budget: float,
    k_positions: np.ndarray,
    end: int,
    scores: dict[str, np.ndarray],
    rng: np.random.Generator,
    window: int = OBSERVATION,
    layer: tuple[int, int] = (0, 1),
) -> np.ndarray:
    """Boolean ``(n_keys,)``: the keys an eviction ``method`` keeps at ``budget`` (the span's keys
    are those at positions below ``end``; every later key stays). ``scores``: per method, a score
    per key (``snapkv``: pooled and averaged, NaN in the observation window; ``observed``,
    ``h2o``, ...; higher kept first). ``layer``: the layer's index and the model's layer count
    (``pyramidkv``'s budget)."""
    span = k_positions < end
    keep = ~span
    index = np.flatnonzero(span)  # the span's keys in position order
    count = kept_count(budget, index.size) if index.size else 0
    if method == "adakv":
        return scores[adakv_key(budget)] > 0  # chosen over the whole layer (`adakv_masks`)
    if method == "pyramidkv" and index.size:
        count = pyramid_count(budget, index.size, window, *layer)
        method = "snapkv"
    if method == "streaming":
        chosen = np.concatenate([index[: min(SINKS, count)], index[index.size - max(0, count - SINKS) :]])
    elif method == "random":
        chosen = rng.choice(index, size=count, replace=False) if count else index[:0]
    elif method == "snapkv":
        observed = span & (k_positions >= end - window)
        fixed = np.flatnonzero(observed)[:count]  # all of it, unless the budget is smaller
        chosen = np.concatenate([fixed, _top(scores["snapkv"], count - fixed.size, span & ~observed)])
    elif method == "observed":
        chosen = _top(scores["observed"], count, span)
    elif method in SCORED:
        chosen = _top(scores[method], count, span)
    elif method == "h2o":
        recent = index[index.size - count // 2 :] if count // 2 else index[:0]
        heavy_among = span.copy()
        heavy_among[recent] = False
        chosen = np.concatenate([recent, _top(scores["h2o"], count - recent.size, heavy_among)])
    else:
        raise CompressionError(f"{method!r} is not an eviction method")
    keep[chosen] = True
    return keep


SCORED = ("tova", "expected_attention", "knorm", "keydiff", "lagkv", "cur")
"""The methods that keep the span's keys of highest score, nothing else."""
BETA = 20
"""PyramidKV's ratio of its largest layer budget to its smallest (kvpress's default)."""


def adakv_key(budget: float) -> str:
    """Where `adakv_masks` puts a KV head's kept keys at ``budget`` among its scores."""
    return f"adakv@{budget!r}"


def adakv_keep(scores: np.ndarray, budget: float, safeguard: float = SAFEGUARD) -> np.ndarray:
    """``(kv_heads, n)`` bool: the keys AdaKVPress.compress keeps of a layer whose KV heads score
    their ``n`` keys ``scores``: each head's top ``int(safeguard * kept)`` (at least 1) first, then
    the ``kv_heads * (n - kept)`` lowest scores of the layer go (ties: the later key first)."""
    heads, n = scores.shape
    kept = kept_count(budget, n)
    safe = max(1, int(kept * safeguard)) if kept > 0 else 0
    ranked = scores.astype(np.float64).copy()
    for head in range(heads):
        ranked[head, _top(ranked[head], safe, np.ones(n, bool))] = np.inf
    pruned = heads * (n - kept)
    keep = np.ones(heads * n, bool)
    if pruned <= 0:
        return keep.reshape(heads, n)
    # The ``pruned`` first of the order (score, later key first, lower head first; NaN last),
    # found by partition: every score below the pruned-th lowest, then those equal to it in that
    # order.
    flat = ranked.reshape(-1)
    kth = np.partition(flat, pruned - 1)[pruned - 1]
    if np.isnan(kth):
        below, tied = ~np.isnan(flat), np.flatnonzero(np.isnan(flat))
    else:
        below, tied = flat < kth, np.flatnonzero(flat == kth)
    keep[below] = False
    needed = pruned - int(below.sum())
    keep[tied[np.lexsort((tied, -(tied % n)))][:needed]] = False
    return keep.reshape(heads, n)


def adakv_masks(
    snap: kvformat.Snapshot, layer: int, seq: int, end: int, budgets: Sequence[float], options: Options
) -> dict[int, dict[str, np.ndarray]]:
    """Per KV head of ``layer``, the keys `adakv` keeps at each of ``budgets`` (under
    `adakv_key`): the scorer's scores of every KV head of the layer (SnapKV's observation window:
    the layer's largest score, as SnapKVPress pads it), shared by `adakv_keep`."""
    inner = [options.adakv_scorer]
    whole_layer = _layer_scores(snap, layer, seq, end, inner)
    masks, _ = _adakv_pass(snap, layer, seq, end, budgets, options, inner, whole_layer)
    return masks


def _adakv_pass(
    snap: kvformat.Snapshot,
    layer: int,
    seq: int,
    end: int,
    budgets: Sequence[float],
    options: Options,
    methods: Sequence[str],
    whole_layer: _LayerScores,
) -> tuple[dict[int, dict[str, np.ndarray]], dict[int, dict[str, np.ndarray]]]:
    """`adakv_masks`, and per KV head the group scores of the eviction ``methods`` (which hold
    AdaKV's scorer) computed in the same pass over the layer's heads, for the methods beside it
    (``whole_layer``: the layer's `_LayerScores` of them)."""
    spec = snap.layers[layer].queries
    assert spec is not None
    inner = options.adakv_scorer
    rope = layer_rope(snap, layer, methods)
    kv_heads = sorted(set(spec.kv_heads))
    rows, positions = [], np.empty(0, np.int64)
    by_head: dict[int, dict[str, np.ndarray]] = {}
    for kv_head in kv_heads:
        heads, _ = _group_heads(snap, layer, kv_head, seq)
        positions = heads[0].k_positions
        scores = _group_scores(heads, end, methods, options, rope)
        by_head[kv_head] = dict(scores)
        scores.update(whole_layer.of(positions))
        rows.append(scores[inner][positions < end])
        pages.of(snap).release(snap._segments.of_head(layer, seq, kv_head))
    table = np.stack(rows)
    if inner == "snapkv":
        table = np.where(np.isnan(table), np.nanmax(table), table)
    out: dict[int, dict[str, np.ndarray]] = {kv_head: {} for kv_head in kv_heads}
    span = positions < end
    for budget in budgets:
        keep = adakv_keep(table, budget)
        for row, kv_head in enumerate(kv_heads):
            mask = np.ones(positions.size, np.float64)
            mask[span] = keep[row]
            out[kv_head][adakv_key(budget)] = mask
    return out, by_head


def pyramid_count(budget: float, n: int, window: int, layer: int, layers: int, beta: int = BETA) -> int:
    """PyramidKV's keys kept in ``layer`` of ``layers`` of a span of ``n`` keys: kvpress's
    ``PyramidKVPress.get_layer_budget`` (``presses/pyramidkv_press.py``, after KVCache-Factory):
    budgets falling linearly from the first layer to the last, their mean ``budget * n`` plus the
    observation ``window``; where the pyramid does not fit the span, the flat
    ``round(budget * n)``."""
    capacity = window + n * budget
    low = (capacity - window) / beta
    high = (capacity - window) * 2 - low
    if high >= n - window:
        high = n - window
        low = (capacity - window) * 2 - high
    if not n >= high >= low >= window:
        return max(1, round(n * budget))
    steps = (high - low) / (layers - 1) if layers > 1 else 0.0
    return min(n, max(1, round(high - layer * steps)))


def quantize(x: np.ndarray, bits: int, axis: int, group: int | None = None) -> np.ndarray:
    """``x`` ``(n, dim)`` float32 quantized and dequantized: asymmetric min-max to ``2^bits``
    levels, one scale and offset per row (``axis=1``: per token) or per column (``axis=0``: per
    channel, in groups of ``group`` rows; the whole groups at once, the last, shorter one alone)."""
    levels = (1 << bits) - 1
    x = np.asarray(x, np.float32)
    if not x.size:
        return np.empty_like(x)
    if axis == 1 or not group or group >= x.shape[0]:
        return _min_max_levels(x, axis, levels)
    whole = x.shape[0] - x.shape[0] % group
    out = np.empty_like(x)
    out[:whole] = _min_max_levels(x[:whole].reshape(-1, group, x.shape[1]), 1, levels).reshape(whole, -1)
    if whole < x.shape[0]:
        out[whole:] = _min_max_levels(x[whole:], 0, levels)
    return out


def _min_max_levels(part: np.ndarray, axis: int, levels: int) -> np.ndarray:
    """``part`` (float32) rounded to ``levels + 1`` levels between its minimum and maximum along
    ``axis`` (of a ``(n, dim)`` array, or axis 1 of ``(groups, group, dim)``): in one pass by the
    compiled kernel (`native.quantize_levels`, the same bits) where it is built and ``part`` is
    finite, else by numpy."""
    grouped = part  # (groups, rows reduced over, columns)
    if part.ndim == 2:
        grouped = part[:, :, None] if axis == 1 else part[None]
    compiled = native.quantize_levels(grouped, levels)
    if compiled is not None:
        return compiled.reshape(part.shape)
    low = part.min(axis=axis, keepdims=True)
    high = part.max(axis=axis, keepdims=True)
    scale = np.where(high > low, (high - low) / levels, 1.0).astype(np.float32)
    # ``round((part - low) / scale) * scale + low`` in one buffer: the same float32 operations
    # in the same order (so the same bits), without a temporary array for each step.
    out = np.subtract(part, low)
    out /= scale
    np.rint(out, out=out)
    out *= scale
    out += low
    return out


def _span_weights(h: _Head, end: int, low: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, positions)``: the attention ``(m, n_keys)`` of ``h``'s queries at positions in
    ``[low, end)``, and those positions."""
    rows = (h.q_positions >= low) & (h.q_positions < end)
    at = h.q_positions[rows]
    return attention_weights(h.spec, h.head, h.q[rows], h.k, at, h.k_positions), at


def _group_scores(
    heads: Sequence[_Head], end: int, methods: Iterable[str], options: Options, rope: Rope | None = None
) -> dict[str, np.ndarray]:
    """Per key of the group's KV head, the scores the eviction ``methods`` rank by (see the
    module's docstring), from the query heads ``heads`` that read it (``rope``: the layer's, for
    ``expected_attention``). ValueError where the file lacks the queries a method needs."""
    wanted = set(methods)
    size = heads[0].k.shape[0]
    positions = heads[0].k_positions
    out: dict[str, np.ndarray] = {}
    if wanted & {"snapkv", "pyramidkv"}:
        first = end - options.observation
        before = positions < first
        pooled = np.zeros(int(before.sum()))
        for h in heads:
            weights, at = _span_weights(h, end, first)
            if at.size != options.observation or first < 1:
                raise CompressionError(
                    f"snapkv's observation window is the {options.observation} queries before position "
                    f"{end}; "
                    f"the file holds {at.size} of them for query head {h.head} (capture with --queries "
                    f"window:{options.observation} or all, or pass a --window it holds, below {end})"
                )
            pooled += _pool(
                weights[:, before].astype(np.float64).mean(axis=0), options.kernel, options.pooling
            )
        out["snapkv"] = np.full(size, np.nan)
        out["snapkv"][before] = pooled / len(heads)
    sums = {h.head: _column_sums(h, end) for h in heads} if wanted & {"observed", "h2o"} else {}
    if "observed" in wanted:
        observed = np.zeros(size)
        for h in heads:
            total, count = sums[h.head]
            if count != end:
                raise CompressionError(
                    f"observed needs every query before position {end}; the file holds {count} for query "
                    f"head {h.head} (capture with --queries all)"
                )
            seen_by = np.maximum(end - positions, 1)
            observed += total / seen_by
        out["observed"] = observed / len(heads)
    if wanted & {"knorm", "keydiff", "lagkv", "cur"}:
        out.update(_key_scores(heads[0], end, wanted, options))
    if "expected_attention" in wanted:
        out["expected_attention"] = _expected_attention(heads, end, rope)
    if "h2o" in wanted:
        out["h2o"] = np.sum([sums[h.head][0] for h in heads], axis=0)
    return out


def _column_sums(h: _Head, end: int) -> tuple[np.ndarray, int]:
    """The attention each key receives summed over ``h``'s queries before ``end`` (float64,
    ``(n_keys,)``), and how many queries those are: a block of queries at a time, so memory holds
    one block's weights whatever the span's length."""
    rows = np.flatnonzero(h.q_positions < end)
    total = np.zeros(h.k.shape[0])
    ordered = bool(np.all(np.diff(h.k_positions) > 0))
    compiled = ordered and _compiled_fits(h)
    for start in range(0, rows.size, BLOCK):
        block = rows[start : start + BLOCK]
        # keys after the block's last query get no weight (causal): with the keys in position
        # order, the block reads only those up to it
        seen = h.k.shape[0]
        if ordered:
            seen = int(np.searchsorted(h.k_positions, h.q_positions[block].max(), side="right"))
        if compiled:
            total[:seen] += _compiled_column_sums(h, block, seen)
            continue
        weights = attention_weights(
            h.spec, h.head, h.q[block], h.k[:seen], h.q_positions[block], h.k_positions[:seen]
        )
        total[:seen] += weights.sum(axis=0, dtype=np.float64)
    return total, int(rows.size)


def _compiled_fits(h: _Head) -> bool:
    """Whether `_compiled_column_sums` may take ``h`` (keys in position order is the caller's):
    the compiled kernel built, no chunked attention, float32 inputs whose logits cannot overflow
    or be NaN (as `head_importance` sends blocks to it)."""
    if not attention_kernel.AVAILABLE or h.spec.chunk is not None or not h.k.size or not h.q.size:
        return False
    if h.q.dtype != np.float32 or h.k.dtype != np.float32:
        return False
    bound = float(np.abs(h.q).max()) * float(np.abs(h.k).max()) * h.k.shape[1] * float(h.spec.scale)
    return bound < FINITE


def _compiled_column_sums(h: _Head, block: np.ndarray, seen: int) -> np.ndarray:
    """The attention each of the first ``seen`` keys receives from the queries ``block`` (float64,
    summed over them), through the compiled softmax pass (`attention_kernel.block_scores`: SPEC
    10.1's scale, softcap, mask and sinks; it agrees with `kvformat.attention.weights` to float32
    rounding)."""
    exponentials = np.ascontiguousarray(h.q[block]) @ np.ascontiguousarray(h.k[:seen]).T
    rows = block_rows(exponentials, h.spec, [h.head], h.q_positions[block], h.k_positions[:seen], SINKS)
    return rows[:, attention_kernel.INVERSE] @ exponentials


def _key_scores(h: _Head, end: int, wanted: set[str], options: Options) -> dict[str, np.ndarray]:
    """The scores of the methods that read the span's keys and values alone, per key of ``h``'s
    KV head (NaN after the span): see the module's docstring for each."""
    span = h.k_positions < end
    count = int(span.sum())
    rows = slice(count) if span[:count].all() else span  # the span's keys: the first ones, as a rule
    k = h.k[rows].astype(np.float64)
    v = h.v[rows].astype(np.float64)
    out: dict[str, np.ndarray] = {}

    def padded(values: np.ndarray) -> np.ndarray:
        full = np.full(h.k_positions.size, np.nan)
        full[span] = values
        return full

    # ||k||^2 as np.linalg.norm sums it (and CURPress's squares are): the same bits
    k_squares = np.add.reduce(k * k, axis=1)
    k_norm = np.sqrt(k_squares)
    if "knorm" in wanted:  # KnormPress.score: -||k||
        out["knorm"] = padded(-k_norm)
    if "keydiff" in wanted:  # KeyDiffPress.score: -cos(k, mean of F.normalize(k))
        anchor = (k / np.maximum(k_norm, 1e-12)[:, None]).mean(axis=0)
        cosine = (k @ anchor) / np.maximum(k_norm * np.linalg.norm(anchor), 1e-8)
        out["keydiff"] = padded(-cosine)
    if "lagkv" in wanted:
        out["lagkv"] = padded(_lagkv(k, v, options.lag))
    if "cur" in wanted:
        out["cur"] = padded(_cur(k_squares, np.add.reduce(v * v, axis=1)))
    return out


FUTURE = 512
"""ExpectedAttention's future positions, over which the queries' rotation is averaged."""


def _expected_attention(
    heads: Sequence[_Head], end: int, rope: Rope | None, sinks: int = SINKS
) -> np.ndarray:
    """ExpectedAttentionPress.score (covariance and value norms on, epsilon 0) for one KV head,
    from its query heads' own queries over the span."""
    if rope is None:
        raise CompressionError(
            "expected_attention undoes RoPE on the file's queries: the file describes none"
        )
    h = heads[0]
    span = h.k_positions < end
    if int(span.sum()) <= sinks:
        raise CompressionError(f"expected_attention needs more than {sinks} keys before position {end}")
    dim = h.k.shape[1]
    if rope.dims != dim:
        raise CompressionError(
            f"expected_attention: a partial RoPE ({rope.dims} of {dim} channels) is not kvpress's"
        )
    k = h.k[span][sinks:].astype(np.float64)
    mean_rotation = _mean_rotation(rope, end, dim)
    total = np.zeros(k.shape[0])
    for head in heads:
        rows = (head.q_positions >= sinks) & (head.q_positions < end)
        if int(rows.sum()) != end - sinks:
            raise CompressionError(
                f"expected_attention needs every query from position {sinks} to {end - 1}; the file holds "
                f"{int(rows.sum())} for query head {head.head} (capture with --queries all)"
            )
        q = rope.rotate(head.q[rows], head.q_positions[rows], inverse=True).astype(np.float64)
        mu = q.mean(axis=0)
        centred = q - mu
        cov = centred.T @ centred / q.shape[0]
        mu, cov = mean_rotation @ mu, mean_rotation @ cov @ mean_rotation.T
        logits = k @ mu / math.sqrt(dim) + ((k @ cov) * k).sum(axis=1) / dim / 2  # k^T Sigma k
        weights = np.exp(logits - logits.max())
        total += weights / weights.sum()
    scores = total / len(heads) * np.linalg.norm(h.v[span][sinks:].astype(np.float64), axis=1)
    out = np.full(h.k_positions.size, np.nan)
    where = np.flatnonzero(span)
    out[where[:sinks]] = scores.max() + 1
    out[where[sinks:]] = scores
    return out


def _mean_rotation(rope: Rope, start: int, dim: int, count: int = FUTURE) -> np.ndarray:
    """``(dim, dim)``: RoPE's rotation averaged over positions ``start .. start + count - 1``
    (ExpectedAttentionPress.apply_avg_rope's ``R``)."""
    theta = rope.angles(np.arange(start, start + count))
    cos, sin = np.cos(theta).mean(axis=0), np.sin(theta).mean(axis=0)
    first, second = rope.pair_indices()
    rotation = np.eye(dim)
    rotation[first, first], rotation[second, second] = cos, cos
    rotation[first, second], rotation[second, first] = -sin, sin
    return rotation


def _lagkv(k: np.ndarray, v: np.ndarray, lag: int, sinks: int = SINKS) -> np.ndarray:
    """LagKVPress.score for one KV head's span ``k``, ``v`` ``(n, dim)``."""
    n = k.shape[0]
    if n < sinks + 2 * lag:
        score = np.ones(n)
        if n > sinks:
            score[sinks:] = np.arange(n - sinks) / (n - sinks)
        return score
    end = sinks + ((n - sinks) // lag) * lag

    def states(x: np.ndarray) -> np.ndarray:  # LagKVPress._get_states_score
        parts = x[sinks:end].reshape(-1, lag, x.shape[1])
        compiled = native.lagkv_spread(parts)  # the same bits in one pass, where it is built
        if compiled is not None:
            compiled = np.exp(compiled - compiled.max(axis=-1, keepdims=True))
            return compiled / compiled.sum(axis=-1, keepdims=True)
        reference, scored = parts[1:], parts[:-1]
        low, high = reference.min(axis=1, keepdims=True), reference.max(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            # ``((scored - low) / (high - low)).std(axis=-1, ddof=1)`` in one buffer: numpy's
            # own steps (the mean, the squared deviations, their sum over n - 1), so the same bits
            normed = np.subtract(scored, low)
            normed /= high - low
            width = normed.shape[-1]
            normed -= normed.sum(axis=-1, keepdims=True) / width
            np.multiply(normed, normed, out=normed)
            spread = np.sqrt(normed.sum(axis=-1) / (width - 1))
        spread = np.exp(spread - spread.max(axis=-1, keepdims=True))
        return spread / spread.sum(axis=-1, keepdims=True)

    score = (states(k) + states(v)) / 2
    ranks = score.argsort(axis=-1, kind="stable").argsort(axis=-1, kind="stable") / lag
    return np.concatenate([np.ones(sinks), ranks.reshape(-1), np.ones(n - end + lag)])


def _cur(k_squares: np.ndarray, v_squares: np.ndarray, sinks: int = SINKS, block: int = 16) -> np.ndarray:
    """CURPress.score (kv_product, local approximation over blocks of 16 keys) for one KV head's
    span, from its keys' and values' squared norms ``(n,)`` (``(x**2).sum(axis=1)``)."""
    n = k_squares.shape[0]

    def local(squares: np.ndarray) -> np.ndarray:
        squares = np.pad(squares, (0, (block - n % block) % block)).reshape(-1, block)
        with np.errstate(divide="ignore", invalid="ignore"):
            return (squares / squares.sum(axis=1, keepdims=True)).reshape(-1)[:n]

    scores = local(k_squares) * local(v_squares)
    scores = scores / scores.sum()
    scores[:sinks] = 1.0
    return scores


def tova_scores(snap: kvformat.Snapshot, layer: int, seq: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """TOVAPress.score for ``layer``: ``(key positions, scores)``, the attention of the query at
    ``end - 1`` to each earlier key averaged over every query head of the layer (the key at
    ``end - 1`` itself: the largest score plus 1, as kvpress pads it; NaN after the span).
    ValueError where the file does not hold that query."""
    spec = snap.layers[layer].queries
    assert spec is not None
    total: np.ndarray | None = None
    positions = np.empty(0, np.int64)
    for kv_head in sorted(set(spec.kv_heads)):
        keys = context_keys(snap, layer, kv_head, seq, np.array([end - 1]), values=False)
        k = float32_rows(keys.k, compiled=True)
        for head in (h for h in range(spec.num_heads) if spec.kv_heads[h] == kv_head):
            found = snap.queries(layer, head, seq, positions=(end - 1, end))
            if found is None or not found.positions.size or not keys.complete.all():
                raise CompressionError(
                    f"tova scores keys by the query at position {end - 1}, which the file does not hold "
                    f"whole for layer {layer} head {head} (capture with --queries window:W or all)"
                )
            row = attention_weights(
                spec, head, np.asarray(found.q, np.float32), k, found.positions, keys.positions
            )
            total = row[0].astype(np.float64) if total is None else total + row[0]
            positions = keys.positions
    assert total is not None
    scores = total / spec.num_heads
    span = positions < end - 1
    out = np.full(positions.size, np.nan)
    out[span] = scores[span]
    out[positions == end - 1] = scores[span].max(initial=0.0) + 1
    return positions, out


def _warn_small_budget(methods: Iterable[str], budgets: Sequence[float], n: int, options: Options) -> None:
    """A `CompressionWarning` naming every budget at which SnapKV keeps no more keys than its
    window."""
    if "snapkv" not in methods:
        return
    small = [b for b in budgets if kept_count(b, n) <= options.observation]
    if small:
        which = " and ".join(f"{b:g} keeps {kept_count(b, n)}" for b in small)
        several = len(small) > 1
        warnings.warn(
            f"snapkv at budget{'s' if several else ''} {which} of {n} keys, no more than its "
            f"observation window ({options.observation}): only window keys are kept, "
            f"{'these results say' if several else 'the result says'} nothing of SnapKV's scores "
            "(a smaller --window, or a longer prompt)",
            CompressionWarning,
            stacklevel=4,
        )


def _refuse_sparse(snap: kvformat.Snapshot) -> None:
    """`CompressionError` for a layer with sparse attention (key selections, format 1.7): its
    queries already read only the keys an indexer chose, and what evicting more would change is
    not what kvpress's methods measure on dense attention."""
    for layer, found in enumerate(snap.layers):
        spec = found.queries if found.present else None
        if spec is not None and spec.selection is not None:
            raise CompressionError(
                f"layer {layer} uses sparse attention (each query reads the {spec.selection} keys an "
                "indexer chose): simulate evicts from dense attention only"
            )


def resolve_window(snap: kvformat.Snapshot, end: int, options: Options, methods: Iterable[str]) -> Options:
    """``options`` with SnapKV's observation window settled for a span ending at ``end``: a
    ``window`` given is kept (a file that lacks its queries is refused when they are read); the
    default is kvpress's `OBSERVATION` (64), or, where the file holds fewer consecutive queries
    right before ``end`` (a short prompt, a capture with ``--queries window:16``), all of those,
    with a `CompressionWarning` saying so. `NoQueriesError` where SnapKV is asked for and the file
    holds no query right before ``end``."""
    if options.window is not None:
        return options
    wanted = set(methods) | ({options.adakv_scorer} if "adakv" in set(methods) else set())
    if not {"snapkv", "pyramidkv"} & wanted:
        return dataclasses.replace(options, window=OBSERVATION)
    found = query_layers(snap)
    held = snap.queries(found[0], 0) if found else None
    window = _tail(held.positions, end, OBSERVATION) if held is not None else 0
    if window == 0:
        raise NoQueriesError(
            f"snapkv scores keys by the queries right before position {end}; the file holds none "
            "(capture with --queries window:W or all)"
        )
    if window < OBSERVATION:
        warnings.warn(
            f"snapkv: the file holds {window} consecutive queries before position {end}, fewer than "
            f"kvpress's {OBSERVATION}: its observation window is those {window} (--window sets it)",
            CompressionWarning,
            stacklevel=3,
        )
    return dataclasses.replace(options, window=window)


def snapkv_scores(
    snap: kvformat.Snapshot, options: Options | None = None
) -> dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]]:
    """SnapKV's score of every key before the observation window, per ``(seq, layer, kv_head)``
    of the layers that hold queries, as ``simulate --method snapkv`` ranks them (see the module's
    docstring). Values ``(key positions, scores)``, NaN for keys in or after the window. Without
    ``options``, the window is the last 64 prompt queries, or as many of them as the file holds
    (the token table's ``snapkv_score``). Empty when the file records no prompt length or holds no
    prompt query."""
    found = query_layers(snap)
    end = prompt_end(snap) if options is None or options.compress == "prompt" else options.span_end(snap)
    if end is None or not found:
        return {}
    options = options if options is not None else _default_options(snap, found[0], end)
    if options is None:  # no prompt query held
        return {}
    out: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
    for seq, layer, kv_head in _kv_groups(snap, found):
        heads, _ = _group_heads(snap, layer, kv_head, seq)
        scores = _group_scores(heads, end, ["snapkv"], options)["snapkv"]
        out[(seq, layer, kv_head)] = (heads[0].k_positions, scores)
    return out


def _kv_groups(snap: kvformat.Snapshot, layers: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(seq, layer, kv_head)`` of every KV head whose query heads ``layers`` hold."""
    for seq in range(snap.num_seqs):
        for layer in layers:
            spec = snap.layers[layer].queries
            assert spec is not None
            for kv_head in sorted(set(spec.kv_heads)):
                yield seq, layer, kv_head


def _default_options(snap: kvformat.Snapshot, layer: int, end: int) -> Options | None:
    """SnapKV's options for the token table: the window the last `OBSERVATION` prompt queries
    ``layer`` holds before ``end``, or as many as it holds; None where it holds none."""
    held = snap.queries(layer, 0)
    assert held is not None
    window = _tail(held.positions, end, OBSERVATION)
    return Options(window=window) if window else None


def _tail(positions: np.ndarray, end: int, most: int) -> int:
    """How many of the positions ``end - 1, end - 2, ...`` (at most ``most``, none below 1) are
    in ``positions`` without a gap."""
    count = 0
    held = set(positions.tolist())
    while count < most and end - count - 1 >= 1 and end - count - 1 in held:
        count += 1
    return count


def kept_mask(
    snap: kvformat.Snapshot,
    layer: int,
    head: int,
    method: str,
    budget: float,
    *,
    seq: int = 0,
    options: Options | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The keys of query head ``head``'s KV head that eviction ``method`` keeps at ``budget``, as
    `simulate` chooses them: ``(key positions (n_keys,), kept (n_keys,) bool)``."""
    options = options or Options()
    if method not in EVICTION:
        raise CompressionError(f"{method!r} is not an eviction method: one of {', '.join(EVICTION)}")
    if not 0 < budget <= 1:
        raise CompressionError(f"budget {budget} is not in (0, 1]")
    if not 0 <= layer < snap.num_layers:
        raise kvformat.OutOfRangeError(f"layer {layer} out of range 0..{snap.num_layers - 1}")
    spec = snap.layers[layer].queries
    if spec is None:
        raise NoQueriesError(f"layer {layer} holds no queries")
    if not 0 <= head < spec.num_heads:
        raise kvformat.OutOfRangeError(
            f"query head {head} out of range 0..{spec.num_heads - 1} in layer {layer}"
        )
    heads, _ = _group_heads(snap, layer, spec.kv_heads[head], seq)
    end = options.span_end(snap)
    options = resolve_window(snap, end, options, [method])
    scores = _group_scores(heads, end, [method], options, layer_rope(snap, layer, [method]))
    positions = heads[0].k_positions
    scores.update(_layer_scores(snap, layer, seq, end, [method]).of(positions))
    if method == "adakv":
        scores.update(adakv_masks(snap, layer, seq, end, [budget], options)[spec.kv_heads[head]])
    rng = head_rng(options.seed, layer, head, budget)
    where = (layer, model_layers(snap))
    return positions, kept_keys(method, budget, positions, end, scores, rng, options.observation, where)


def head_rng(seed: int, layer: int, head: int, budget: float) -> np.random.Generator:
    """``random``'s draws for query head ``head`` of ``layer`` at ``budget``: a generator of its
    own, seeded by ``(seed, layer, head, budget's float64 bits)``, so that a head's kept keys do
    not depend on which heads or budgets were simulated before, nor on the process that
    simulated them (`kept_mask` draws the same)."""
    return np.random.default_rng((seed, layer, head, int(np.float64(budget).view(np.uint64))))


def layer_rope(snap: kvformat.Snapshot, layer: int, methods: Iterable[str]) -> Rope | None:
    """The RoPE of ``layer`` as the file describes it, where a method needs it; None otherwise
    (or where the file describes none: the method then says so)."""
    if "expected_attention" not in set(methods):
        return None
    spec = snap.layers[layer]
    try:
        return Rope.from_metadata(snap.metadata, spec.attributes, spec.k_dim)
    except AnalysisError as exc:
        raise CompressionError(f"expected_attention: {exc}") from None


def model_layers(snap: kvformat.Snapshot) -> int:
    """The model's layer count: the file's layers less those holding a further cache of a model
    layer (``of_layer``, SPEC 1.6)."""
    return sum(1 for spec in snap.layers if "of_layer" not in spec.attributes)


@dataclass(frozen=True)
class _LayerScores:
    """The scores of the methods that read every query head of a layer (``tova``), computed once
    per layer: ``positions`` (the keys they score, None when no such method is asked for) and the
    scores by method."""

    layer: int
    positions: np.ndarray | None
    scores: dict[str, np.ndarray]

    def of(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """The scores for a KV head holding keys at ``positions`` (the layer's scores are one
        ranking for all its KV heads, so they must hold the same positions)."""
        if self.positions is not None and not np.array_equal(self.positions, positions):
            raise CompressionError(
                f"layer {self.layer}: its KV heads hold different positions; tova scores them alike"
            )
        return self.scores


def _layer_scores(
    snap: kvformat.Snapshot, layer: int, seq: int, end: int, methods: Iterable[str]
) -> _LayerScores:
    """`_LayerScores` of ``layer`` for ``methods``."""
    if "tova" not in set(methods):
        return _LayerScores(layer, None, {})
    at, scores = tova_scores(snap, layer, seq, end)
    return _LayerScores(layer, at, {"tova": scores})


def _group_heads(snap: kvformat.Snapshot, layer: int, kv_head: int, seq: int) -> tuple[list[_Head], int]:
    """The query heads of ``layer`` that read ``kv_head``, each with the keys and values their
    queries saw (`kvformat.attention.context_keys`), and how many queries were left out because
    they saw keys the file no longer holds."""
    spec = snap.layers[layer].queries
    assert spec is not None
    group = [h for h in range(spec.num_heads) if spec.kv_heads[h] == kv_head]
    found = [snap.queries(layer, head, seq) for head in group]
    at = np.unique(np.concatenate([f.positions for f in found if f is not None]))
    keys = context_keys(snap, layer, kv_head, seq, at)
    k, v = float32_rows(keys.k, compiled=True), float32_rows(keys.v, compiled=True)
    heads, left_out = [], 0
    for head, queries in zip(group, found, strict=True):
        assert queries is not None
        complete = keys.complete[np.searchsorted(at, queries.positions)]
        left_out += int((~complete).sum())
        q = np.asarray(queries.q, np.float32)[complete]
        heads.append(_Head(spec, head, q, queries.positions[complete], k, v, keys.positions))
    return heads, left_out


def _error(
    h: _Head,
    rows: np.ndarray,
    full: np.ndarray,
    full_top: np.ndarray,
    keep: np.ndarray | None,
    k: Any,
    v: Any,
) -> tuple[float, float]:
    """``(relative error, top-1 agreement)`` of the eval queries ``rows`` with keys ``keep`` (all
    when None) of ``k``/``v`` (possibly quantized)."""
    columns = slice(None) if keep is None else keep
    kept_positions = h.k_positions[columns]
    found = attention_weights(h.spec, h.head, h.q[rows], k[columns], h.q_positions[rows], kept_positions)
    return _compared(found, np.asarray(v[columns], np.float64), kept_positions, full, full_top)


def _compared(
    found: np.ndarray, v: np.ndarray, kept_positions: np.ndarray, full: np.ndarray, full_top: np.ndarray
) -> tuple[float, float]:
    """``(relative error, top-1 agreement)`` of weights ``found`` over values ``v`` (float64) at
    ``kept_positions`` against the uncompressed output ``full`` and top-1 keys ``full_top``."""
    output = found.astype(np.float64) @ v
    reference = (full**2).sum()
    error = float(np.sqrt(((output - full) ** 2).sum() / reference)) if reference > 0 else float("nan")
    top = kept_positions[np.argmax(found, axis=1)] if found.shape[1] else np.full(len(full_top), -1)
    return error, float(np.mean(top == full_top)) if len(full_top) else float("nan")


def available(snap: kvformat.Snapshot, end: int) -> list[str]:
    """`METHODS` less ``observed`` where the file does not hold every query of the span, and less
    ``snapkv`` where it holds no query right before the span's end (a `CompressionWarning` says
    so): the methods a default `simulate` runs."""
    methods = list(METHODS)
    found = query_layers(snap)
    held = snap.queries(found[0], 0) if found else None
    if held is None:
        return methods
    if int((held.positions < end).sum()) < end:
        warnings.warn(
            f"{snap.name}: observed and expected_attention left out: they need every query before "
            f"position {end} (capture with --queries all)",
            CompressionWarning,
            stacklevel=3,
        )
        methods.remove("observed")
        methods.remove("expected_attention")
    elif not isinstance(snap.metadata.get("rope"), dict) or end <= SINKS + 1:
        why = (
            "the file describes no RoPE to undo on its queries"
            if end > SINKS + 1
            else (f"its statistics need more than {SINKS + 1} prompt queries, the file's prompt is {end}")
        )
        warnings.warn(f"{snap.name}: expected_attention left out: {why}", CompressionWarning, stacklevel=3)
        methods.remove("expected_attention")
    if _tail(held.positions, end, 1) == 0:
        warnings.warn(
            f"{snap.name}: snapkv, pyramidkv, adakv and tova left out: they score keys by the queries right "
            f"before position {end}, which the file does not hold (capture with --queries window:W or all)",
            CompressionWarning,
            stacklevel=3,
        )
        for method in ("snapkv", "pyramidkv", "adakv", "tova"):
            methods.remove(method)
    return methods


def simulate_rows(
    path: str | os.PathLike[str],
    methods: Iterable[str] | None = None,
    budgets: Sequence[float] = BUDGETS,
    snapshot: int = -1,
    *,
    seq: int = 0,
    options: Options | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
    workers: int | None = None,
) -> list[dict[str, Any]]:
    """One row per (method, budget, layer, query head); see the module's docstring. ``methods``:
    default, every method the file's queries allow. ``progress``: a bar per layer on standard
    error (where it is a terminal). ``workers``: processes the layers are spread over (default:
    this process's cores), for a local file of at least `SPREAD_MIN_WORK` query heads x
    positions (`engine.processes.usable`); the rows are the same whatever their number (BLAS on
    one thread in each, layers joined in order)."""
    options = options or Options()
    chosen = check_methods(methods) if methods is not None else None
    for budget in budgets:
        if not 0 < budget <= 1:
            raise CompressionError(f"budget {budget} is not in (0, 1]")
    rows: list[dict[str, Any]] = []
    left_out = 0
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        _refuse_sparse(snap)
        end = options.span_end(snap)
        if not 0 < end <= snap.seq_len:
            raise CompressionError(
                f"the compressed span ends at {end}, outside the file's positions 0..{snap.seq_len}"
            )
        if chosen is None:
            chosen = available(snap, end)
        options = resolve_window(snap, end, options, chosen)
        layers = layers_with_queries(snap)
        name, index = snap.name, snap.index
        task = _Task(os.fspath(path), index, seq, end, tuple(chosen), tuple(budgets), options, layers[0])
        count = min(workers or cores(), len(layers))
        heads = sum(spec.queries.num_heads for spec in snap.layers if spec.queries is not None)
        worth = heads * snap.seq_len >= SPREAD_MIN_WORK
        spread = storage_options is None and count > 1 and processes.usable(path, count, "cpu", worth)
        bar = tqdm.tqdm(
            total=len(layers), unit="layer", file=sys.stderr, disable=None if progress else True, leave=False
        )
        with bar:
            if spread:
                processes.start(count)
                pool = processes.pool(count)
                try:
                    for layer_rows, dropped, said in pool.map(_layer_task, layers, task):
                        for message, category in said:
                            warnings.warn(message, category, stacklevel=2)
                        rows += layer_rows
                        left_out += dropped
                        bar.update()
                except futures_process.BrokenProcessPool:
                    executors.discard(pool)
                    raise
            else:
                with single_threaded_blas():
                    for layer in layers:
                        layer_rows, dropped = _layer_rows(snap, layer, task)
                        rows += layer_rows
                        left_out += dropped
                        bar.update()
    if left_out:
        warnings.warn(
            f"{name}: {left_out} queries left out: they attended keys no snapshot of the file holds",
            CompressionWarning,
            stacklevel=2,
        )
    return rows


SPREAD_MIN_WORK = 100_000
"""Query heads x positions from which `simulate_rows` spreads its layers over worker processes
(from any size where they run already): below it, starting them costs more than they save. A
906-position capture of 30 layers of 9 query heads (245k) takes 2.1-2.5 s on 2 workers against
3.1-3.7 s in one process (2-core VM)."""


@dataclass(frozen=True)
class _Task:
    """What `simulate_rows` asks of every layer: the file (its path and snapshot index), the
    sequence, the compressed span's end, the methods and budgets, the options, and the first
    layer (which alone warns of budgets too small)."""

    path: str
    snapshot: int
    seq: int
    end: int
    methods: tuple[str, ...]
    budgets: tuple[float, ...]
    options: Options
    first_layer: int


def _layer_task(layer: int, task: _Task) -> tuple[list[dict[str, Any]], int, list[tuple[str, type[Warning]]]]:
    """In a worker process: `_layer_rows` of ``layer`` from this worker's own map of the file
    (`engine.processes.worker_snapshot`), and the warnings it gave."""
    snap = processes.worker_snapshot(task.path, task.snapshot)
    with warnings.catch_warnings(record=True) as said, single_threaded_blas():
        warnings.simplefilter("always")
        rows, dropped = _layer_rows(snap, layer, task)
    return rows, dropped, [(str(w.message), w.category) for w in said]


def _layer_rows(snap: kvformat.Snapshot, layer: int, task: _Task) -> tuple[list[dict[str, Any]], int]:
    """`simulate_rows`' rows of one layer, KV group by KV group, and the queries left out (they
    attended keys no snapshot holds); the task's first layer says first where a budget keeps
    too few keys."""
    seq, end, options, budgets = task.seq, task.end, task.options, task.budgets
    chosen, warn = list(task.methods), layer == task.first_layer
    spec = snap.layers[layer].queries
    assert spec is not None
    eviction = [m for m in chosen if m in EVICTION]
    shared: dict[int, dict[str, np.ndarray]] = {}
    group_scores: dict[int, dict[str, np.ndarray]] = {}  # computed beside AdaKV's, once
    if "adakv" in chosen:
        scored = [*eviction, *([options.adakv_scorer] if options.adakv_scorer not in eviction else [])]
        whole_layer = _layer_scores(snap, layer, seq, end, [*chosen, options.adakv_scorer])
        shared, group_scores = _adakv_pass(snap, layer, seq, end, budgets, options, scored, whole_layer)
    else:
        whole_layer = _layer_scores(snap, layer, seq, end, chosen)
    rope = None if group_scores else layer_rope(snap, layer, chosen)
    where, ends = (layer, model_layers(snap)), (end, prompt_end(snap))
    rows: list[dict[str, Any]] = []
    left_out = 0
    for kv_head in sorted(set(spec.kv_heads)):
        heads, dropped = _group_heads(snap, layer, kv_head, seq)
        left_out += dropped
        if warn:
            _warn_small_budget(chosen, budgets, int((heads[0].k_positions < end).sum()), options)
            warn = False
        scores = group_scores.get(kv_head) or _group_scores(heads, end, eviction, options, rope)
        scores.update(whole_layer.of(heads[0].k_positions))
        scores.update(shared.get(kv_head, {}))
        quantized: dict[str, np.ndarray] = {}  # the group's float64 V, quantized K and V: shared
        for h in heads:
            rows += _head_rows(h, where, kv_head, chosen, budgets, ends, options, scores, quantized)
        # this KV head's pages leave the process, as in `head_importance`: a file larger than
        # memory keeps a bounded resident set (views stay valid; pages fault back in if read)
        pages.of(snap).release(snap._segments.of_head(layer, seq, kv_head))
    return rows, left_out


def _head_rows(
    h: _Head,
    where: tuple[int, int],
    kv_head: int,
    methods: list[str],
    budgets: Sequence[float],
    ends: tuple[int, int | None],
    options: Options,
    scores: dict[str, np.ndarray],
    quantized: dict[str, np.ndarray],
) -> list[dict[str, Any]]:
    """``h``'s rows; ``where``: the layer and the model's layer count; ``ends``: the compressed
    span's end and the prompt's (None if unknown); ``quantized``: the quantized K and V
    (`_quantized_error`), filled by the group's first head and shared by the others (they read
    one KV head).
    ``random`` draws from `head_rng`."""
    end, _ = ends
    layer = where[0]
    rows_eval = _evaluated_queries(h, ends, options.observation)
    if not rows_eval.any():
        return []
    # the eval queries' logits over every key, once: an eviction's weights are the softmax of
    # their kept columns (a column subset of the logits is the logits of that subset of keys)
    logits = attention_logits(h.spec, h.q[rows_eval], h.k, h.q_positions[rows_eval], h.k_positions)
    if "v" not in quantized:
        quantized["v"] = h.v.astype(np.float64)
    values = quantized["v"]
    softmax = _Softmax.of(h, logits, values)
    full = softmax.output(softmax.whole)
    first = np.argmax(logits, axis=1)  # each eval query's top-1 column
    full_top = h.k_positions[first]
    base = {"layer": layer, "head": h.head, "kv_head": kv_head, "n_queries": int(rows_eval.sum())}
    out: list[dict[str, Any]] = []
    evictions: list[tuple[int, np.ndarray]] = []  # (row index, kept keys), measured together
    for method in methods:
        if method in QUANTIZATION:
            bits = QUANTIZATION[method][1]
            measured = _quantized_error(h, method, rows_eval, full, full_top, quantized)
            out.append(_row(method, bits / 16, base, measured, None))
            continue
        for budget in budgets:
            rng = head_rng(options.seed, layer, h.head, budget)
            keep = kept_keys(method, budget, h.k_positions, end, scores, rng, options.observation, where)
            evictions.append((len(out), keep))
            out.append(_row(method, budget, base, (math.nan, math.nan), int((~keep).sum())))
    masks = [keep for _, keep in evictions]
    for (index, _), (error, agreement) in zip(
        evictions, _evictions_measured(h, logits, softmax, masks, values, full, first), strict=True
    ):
        out[index]["relative_error"], out[index]["top1_agreement"] = error, agreement
    return out


@dataclass(frozen=True)
class _Softmax:
    """The eval queries' softmax over every key, unnormalized, in float64: ``exps`` ``(e, n)``
    ``x_j = exp(logit_j - m)`` (``m`` the row's largest logit, or the sink's; 0 for a key the
    query does not see), the ``whole`` row's `_Sums` and the ``sink``'s ``exp(s - m)`` ``(e,)``
    (0 without sinks)."""

    exps: np.ndarray
    whole: _Sums
    sink: np.ndarray

    @classmethod
    def of(cls, h: _Head, logits: np.ndarray, values: np.ndarray) -> _Softmax:
        """Of ``h``'s eval queries' ``logits`` ``(e, n)`` (float32) over ``values`` ``(n, d)``
        (float64)."""
        top = logits.max(axis=1, initial=-np.inf)
        sink = np.zeros(len(logits))
        if h.spec.sinks is not None:
            top = np.maximum(top, np.float32(h.spec.sinks[h.head]))
        top = np.where(np.isfinite(top), top, np.float32(0)).astype(np.float64)
        if h.spec.sinks is not None:
            sink = np.exp(float(h.spec.sinks[h.head]) - top)
        exps = np.exp(logits.astype(np.float64) - top[:, None])  # a key the query does not see: 0
        return cls(exps, _Sums(exps @ values, exps.sum(axis=1)), sink)

    def output(self, sums: _Sums) -> np.ndarray:
        """The attention output ``(e, d)`` of the keys summed in ``sums``: ``sum x_j v_j / (sum
        x_j + sink)``; 0 for a query that sees none of them."""
        denominator = sums.denominator + self.sink
        return np.divide(
            sums.numerator,
            denominator[:, None],
            out=np.zeros_like(sums.numerator),
            where=denominator[:, None] > 0,
        )


def _evictions_measured(
    h: _Head,
    logits: np.ndarray,
    softmax: _Softmax,
    masks: list[np.ndarray],
    values: np.ndarray,
    full: np.ndarray,
    first: np.ndarray,
) -> list[tuple[float, float]]:
    """``(relative error, top-1 agreement)`` of each eviction (a mask of the keys kept) for the
    eval queries whose ``logits`` ``(e, n)`` over every key, `_Softmax`, uncompressed output
    ``full`` and top-1 columns ``first`` are given. An eviction's weights are the softmax of its
    kept columns: its output is ``sum_kept x_j v_j / (sum_kept x_j + sink)``, in float64.
    The sums run over the kept keys, or, where more than half are kept, are the whole row's less
    the evicted keys' (rows whose kept share is below 1e-9 of the whole are summed directly), or,
    where that is fewer keys, are those of a smaller eviction summed directly whose keys it keeps
    plus the keys it adds (`_subset_order`: a method's budgets keep nested sets). A
    query's top-1 key is the row's unless that key is evicted (the first kept key where it sees
    none of them). A mask keeping every key is the uncompressed cache: error 0, agreement 1."""
    if not masks:
        return []
    exps, whole = softmax.exps, softmax.whole
    full_top = h.k_positions[first]
    reference = float((full**2).sum())
    found: list[tuple[float, float]] = [(math.nan, math.nan)] * len(masks)
    done: dict[int, _Sums] = {}  # sums of masks summed without a subtraction
    for index, within in _subset_order(masks):
        mask = masks[index]
        kept = np.flatnonzero(mask)
        if kept.size == mask.size:
            found[index] = (0.0, 1.0 if len(full_top) else math.nan)
            continue
        base = None if within is None else done.get(within)
        added = None if base is None else np.flatnonzero(mask & ~masks[within])  # type: ignore[index]
        if base is not None and added is not None and added.size < min(kept.size, mask.size - kept.size):
            part = exps[:, added]
            sums = done[index] = _Sums(
                base.numerator + part @ values[added], base.denominator + part.sum(axis=1)
            )
        else:
            sums = _kept_sums(exps, values, mask, kept, whole)
            if 2 * kept.size <= mask.size:
                done[index] = sums
        output = softmax.output(sums)
        error = math.sqrt(float(((output - full) ** 2).sum()) / reference) if reference > 0 else math.nan
        columns = _kept_top(logits, mask, kept, first)
        top_positions = np.where(columns >= 0, h.k_positions[np.maximum(columns, 0)], -1)
        agreement = float(np.mean(top_positions == full_top)) if len(full_top) else math.nan
        found[index] = (error, agreement)
    return found


def _subset_order(masks: list[np.ndarray]) -> list[tuple[int, int | None]]:
    """The masks in the order `_evictions_measured` sums them (fewest kept keys first), each with
    the largest mask before it that it contains (None where none does): a method's budgets keep
    nested sets, so each one's sums are the smaller one's plus the keys it adds (additions of
    non-negative weights, no cancellation)."""
    stacked = np.stack(masks).astype(np.float32)
    counts = stacked.sum(axis=1)  # exact: counts below 2^24
    shared = stacked @ stacked.T  # keys both of two masks keep
    contains = (shared == counts[:, None]) & (counts[:, None] < counts[None, :])  # [a, b]: a in b
    sizes = np.where(contains, counts[:, None], -1)
    largest = sizes.argmax(axis=0)  # the first of the largest where several are as large
    found = sizes.max(axis=0) >= 0
    order = np.argsort(counts, kind="stable")
    return [(int(b), int(largest[b]) if found[b] else None) for b in order]


@dataclass(frozen=True)
class _Sums:
    """Softmax sums of a set of keys, per eval query: ``numerator`` ``(e, d)`` ``sum x_j v_j``,
    ``denominator`` ``(e,)`` ``sum x_j`` (float64)."""

    numerator: np.ndarray
    denominator: np.ndarray


def _kept_sums(
    exps: np.ndarray, values: np.ndarray, mask: np.ndarray, kept: np.ndarray, whole: _Sums
) -> _Sums:
    """`_Sums` of the ``kept`` columns (``mask``) of ``exps`` ``(e, n)``: summed directly where
    they are at most half the keys, else the ``whole`` less the evicted ones; rows where that
    difference keeps less than 1e-9 of the whole are summed directly (no cancellation)."""
    if 2 * kept.size <= mask.size:
        part = exps[:, kept]
        return _Sums(part @ values[kept], part.sum(axis=1))
    gone = np.flatnonzero(~mask)
    part = exps[:, gone]
    numerator = whole.numerator - part @ values[gone]
    denominator = whole.denominator - part.sum(axis=1)
    small = denominator <= 1e-9 * whole.denominator
    if small.any():
        direct = exps[np.ix_(np.flatnonzero(small), kept)]
        numerator[small] = direct @ values[kept]
        denominator[small] = direct.sum(axis=1)
    return _Sums(numerator, denominator)


def _kept_top(logits: np.ndarray, mask: np.ndarray, kept: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Each eval query's top-1 column among the kept keys: its top-1 over every key (``first``)
    where that is kept, else the largest kept logit's (the first kept column where it sees none
    of them); -1 where nothing is kept."""
    if not kept.size:
        return np.full(len(first), -1)
    columns = first.copy()
    lost = np.flatnonzero(~mask[first])
    if lost.size:
        candidates = logits[np.ix_(lost, kept)]
        best = np.argmax(candidates, axis=1)
        sees = np.isfinite(candidates[np.arange(lost.size), best])
        columns[lost] = np.where(sees, kept[best], kept[0])
    return columns


def _row(
    method: str, budget: float, base: dict[str, Any], measured: tuple[float, float], evicted: int | None
) -> dict[str, Any]:
    """One row of `simulate_rows`: the method and budget, the head (``base``), the relative error
    and top-1 agreement ``measured``, the keys evicted (None for a quantization)."""
    error, agreement = measured
    return {
        "method": method,
        "budget": budget,
        **base,
        "relative_error": error,
        "top1_agreement": agreement,
        "keys_evicted": evicted,
    }


def _evaluated_queries(h: _Head, ends: tuple[int, int | None], observation: int) -> np.ndarray:
    """The queries ``h``'s error is measured over (a mask of ``h.q_positions``): those past the
    compressed span and the prompt (``ends``), else past the span, else the span's observation
    window."""
    end, prompt = ends
    decode = h.q_positions >= max(end, prompt or 0)
    if not decode.any():
        decode = h.q_positions >= end
    window = (h.q_positions >= end - observation) & (h.q_positions < end)
    return decode if decode.any() else window


def _quantized_error(
    h: _Head,
    method: str,
    rows_eval: np.ndarray,
    full: np.ndarray,
    full_top: np.ndarray,
    quantized: dict[str, np.ndarray],
) -> tuple[float, float]:
    """The relative error and top-1 agreement of quantization ``method`` (`QUANTIZATION`) for
    ``h``'s queries ``rows_eval``; its K quantized once per group, its V (per token at every
    method: the same for every method of the same bits) once per group and bits, in float64 for
    the output's sums (kept in ``quantized``)."""
    axis, bits = QUANTIZATION[method]
    k_key, v_key = f"k {method}", f"v {bits}"
    if k_key not in quantized:
        quantized[k_key] = quantize(h.k, bits, axis=0 if axis == "channel" else 1, group=GROUP)
    if v_key not in quantized:
        quantized[v_key] = quantize(h.v, bits, axis=1).astype(np.float64)
    return _error(h, rows_eval, full, full_top, None, quantized[k_key], quantized[v_key])


def simulate(
    path: str | os.PathLike[str],
    methods: Iterable[str] | None = None,
    budgets: Sequence[float] = BUDGETS,
    snapshot: int = -1,
    **options: Any,
) -> Any:
    """`simulate_rows` as a Polars DataFrame: ``method``, ``budget``, ``layer``, ``head``,
    ``kv_head``, ``n_queries``, ``relative_error``, ``top1_agreement``, ``keys_evicted``. Keyword
    arguments:
    ``seq``, ``storage_options``, ``progress``, ``workers``, and the fields of `Options` (``window``,
    ``kernel``, ``pooling``, ``compress``, ``question_start``, ``seed``, ``lag``,
    ``adakv_scorer``)."""

    passed = {name: options.pop(name) for name in list(options) if name in Options.__dataclass_fields__}
    return pl.DataFrame(simulate_rows(path, methods, budgets, snapshot, options=Options(**passed), **options))
