"""KV-compression what-ifs on a saved generation: per query head, how much the attention output
would have changed had the cache been compressed by a method at a budget.

The cache is compressed once, after the prompt (as kvpress and the papers' evaluations do): a
method keeps ``budget`` of the prompt's keys (at least one); every key of a generated token stays.
The decode queries (positions at or after the prompt's end; without any, the last ``window``
prompt queries) then attend to what is left, with the layer's recorded scale, mask, softcap and
sinks (`kvformat.attention.weights` over the kept keys, which is the full softmax renormalized over
them). Per (method, budget, layer, head):

- ``relative_error``: ``||o' - o||_F / ||o||_F`` over those queries (``o = weights @ V``);
- ``top1_agreement``: the fraction of those queries whose most-attended key is the same.

Eviction methods (which prompt keys stay):

- ``streaming`` (StreamingLLM): the first 4 keys and the most recent ones;
- ``snapkv`` (SnapKV): the observation window (the last ``window`` prompt queries) kept, the other
  keys ranked by the window's attention to them, summed over the query heads that share the KV
  head and max-pooled over 5 neighbouring keys;
- ``h2o`` (H2O): half the budget the most recent keys, half the heavy hitters: the keys with the
  most attention accumulated over every prompt query the file holds;
- ``random``: a uniform sample (seeded), the baseline.

Quantization methods (every key kept; ``budget`` is bits / 16, against float16):

- ``kivi2``, ``kivi4`` (KIVI): K quantized per channel in groups of 32 tokens, V per token;
- ``token2``, ``token4``: K and V both per token. Asymmetric min-max integer quantization.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvformat
from kvformat.attention import weights as attention_weights

from .arrays import float32_rows
from .head_importance import NoQueriesError, layers_with_queries, prompt_end, query_layers

EVICTION = ("streaming", "snapkv", "h2o", "random")
QUANTIZATION = {
    "kivi2": ("channel", 2),
    "kivi4": ("channel", 4),
    "token2": ("token", 2),
    "token4": ("token", 4),
}
METHODS = (*EVICTION, *QUANTIZATION)
BUDGETS = (0.1, 0.25, 0.5)
OBSERVATION = 32  # SnapKV's observation window, queries
SINKS = 4
POOL = 5
GROUP = 32  # KIVI's group of tokens for per-channel K


@dataclass(frozen=True)
class _Head:
    """One query head's inputs: queries (eval and all), its KV head's keys and values."""

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
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}: one of {', '.join(METHODS)}")
    return chosen


def _pool(scores: np.ndarray, width: int = POOL) -> np.ndarray:
    """Max over ``width`` neighbouring keys (centred), as SnapKV smooths its scores."""
    half = width // 2
    padded = np.pad(scores, half, mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)
    return windows.max(axis=1)


def _top(scores: np.ndarray, count: int, among: np.ndarray) -> np.ndarray:
    """Indices (into ``scores``) of the ``count`` highest among the boolean ``among``, later
    positions first among equal scores."""
    candidates = np.flatnonzero(among)
    if count <= 0 or not candidates.size:
        return np.empty(0, np.int64)
    order = np.lexsort((-candidates, -scores[candidates]))
    return candidates[order[:count]]


def kept_keys(
    method: str,
    budget: float,
    k_positions: np.ndarray,
    end: int,
    scores: dict[str, np.ndarray],
    rng: np.random.Generator,
    window: int = OBSERVATION,
) -> np.ndarray:
    """Boolean ``(n_keys,)``: the keys an eviction ``method`` keeps at ``budget`` (the prompt's keys
    are those at positions below ``end``; every later key stays). ``scores``: per method, a score
    per key (``snapkv``, ``h2o``)."""
    prompt = k_positions < end
    keep = ~prompt
    n_prompt = int(prompt.sum())
    count = min(n_prompt, max(1, round(budget * n_prompt)))
    index = np.flatnonzero(prompt)  # prompt keys in position order
    if method == "streaming":
        chosen = np.concatenate([index[: min(SINKS, count)], index[len(index) - max(0, count - SINKS) :]])
    elif method == "random":
        chosen = rng.choice(index, size=count, replace=False) if count else index[:0]
    elif method == "snapkv":
        observed = prompt & (k_positions >= end - window)
        fixed = np.flatnonzero(observed)[-count:]
        rest = _top(_pool(scores["snapkv"]), count - fixed.size, prompt & ~observed)
        chosen = np.concatenate([fixed, rest])
    elif method == "h2o":
        recent = index[len(index) - count // 2 :] if count // 2 else index[:0]
        heavy_among = prompt.copy()
        heavy_among[recent] = False
        chosen = np.concatenate([recent, _top(scores["h2o"], count - recent.size, heavy_among)])
    else:
        raise ValueError(f"{method!r} is not an eviction method")
    keep[chosen] = True
    return keep


def quantize(x: np.ndarray, bits: int, axis: int, group: int | None = None) -> np.ndarray:
    """``x`` ``(n, dim)`` float32 quantized and dequantized: asymmetric min-max to ``2^bits``
    levels, one scale and offset per row (``axis=1``: per token) or per column (``axis=0``: per
    channel, in groups of ``group`` rows)."""
    levels = (1 << bits) - 1
    out = np.empty_like(x, dtype=np.float32)
    step = group if (axis == 0 and group) else x.shape[0]
    for start in range(0, max(x.shape[0], 1), max(step, 1)):
        part = x[start : start + step].astype(np.float32)
        if not part.size:
            continue
        low = part.min(axis=axis, keepdims=True)
        high = part.max(axis=axis, keepdims=True)
        scale = np.where(high > low, (high - low) / levels, 1.0).astype(np.float32)
        out[start : start + step] = np.round((part - low) / scale) * scale + low
    return out


def _group_scores(heads: Sequence[_Head], end: int, window: int) -> dict[str, np.ndarray]:
    """Per key of ``kv_head``: SnapKV's score (attention of the last ``window`` prompt queries)
    and H2O's (attention accumulated over every prompt query), summed over the query heads that
    read this KV head."""
    size = heads[0].k.shape[0]
    snapkv, h2o = np.zeros(size), np.zeros(size)
    for h in heads:
        prompt_queries = h.q_positions < end
        if not prompt_queries.any():
            continue
        found = attention_weights(
            h.spec, h.head, h.q[prompt_queries], h.k, h.q_positions[prompt_queries], h.k_positions
        ).astype(np.float64)
        h2o += found.sum(axis=0)
        observed = h.q_positions[prompt_queries] >= end - window
        snapkv += found[observed].sum(axis=0)
    return {"snapkv": snapkv, "h2o": h2o}


def snapkv_scores(
    snap: kvformat.Snapshot, window: int = OBSERVATION
) -> dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]]:
    """SnapKV's score of every prompt key, per ``(seq, layer, kv_head)`` of the layers that hold
    queries: the attention of the last ``window`` prompt queries to the key, summed over them and
    over the query heads that read the KV head, max-pooled over `POOL` neighbouring keys (what
    ``simulate --method snapkv`` ranks keys by). Values ``(key positions, scores)``, NaN for
    keys after the prompt. Empty when the file holds no queries or no prompt queries."""
    found = query_layers(snap)
    end = prompt_end(snap)
    out: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
    for seq in range(snap.num_seqs):
        for layer in found:
            spec = snap.layers[layer].queries
            assert spec is not None
            for kv_head in sorted(set(spec.kv_heads)):
                heads = _group_heads(snap, layer, kv_head, seq)
                stop = end if end is not None else int(heads[0].q_positions.min(initial=0))
                if not (heads[0].q_positions < stop).any():
                    continue
                prompt = heads[0].k_positions < stop
                scores = _pool(_group_scores(heads, stop, window)["snapkv"][prompt])
                full = np.full(prompt.shape, np.nan)
                full[prompt] = scores
                out[(seq, layer, kv_head)] = (heads[0].k_positions, full)
    return out


def kept_mask(
    snap: kvformat.Snapshot,
    layer: int,
    head: int,
    method: str,
    budget: float,
    *,
    seq: int = 0,
    window: int = OBSERVATION,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """The keys of query head ``head``'s KV head that eviction ``method`` keeps at ``budget``, as
    `simulate` chooses them: ``(key positions (n_keys,), kept (n_keys,) bool)``. ``random``
    draws from ``default_rng(seed)`` for this head alone (`simulate` draws once per file)."""
    if method not in EVICTION:
        raise ValueError(f"{method!r} is not an eviction method: one of {', '.join(EVICTION)}")
    if not 0 < budget <= 1:
        raise ValueError(f"budget {budget} is not in (0, 1]")
    spec = snap.layers[layer].queries
    if spec is None:
        raise NoQueriesError(f"layer {layer} holds no queries")
    if not 0 <= head < spec.num_heads:
        raise ValueError(f"query head {head} is not in layer {layer} (it has {spec.num_heads})")
    heads = _group_heads(snap, layer, spec.kv_heads[head], seq)
    end = prompt_end(snap)
    stop = end if end is not None else int(heads[0].q_positions.min(initial=0))
    scores = _group_scores(heads, stop, window) if method in ("snapkv", "h2o") else {}
    rng = np.random.default_rng(seed)
    positions = heads[0].k_positions
    return positions, kept_keys(method, budget, positions, stop, scores, rng, window)


def _group_heads(snap: kvformat.Snapshot, layer: int, kv_head: int, seq: int) -> list[_Head]:
    """The query heads of ``layer`` that read ``kv_head``, each with that KV head's K and V."""
    spec = snap.layers[layer].queries
    assert spec is not None
    kv = snap.head(layer, kv_head, seq)
    assert kv is not None
    k, v = float32_rows(kv.k, compiled=True), float32_rows(kv.v, compiled=True)
    heads = []
    for head in (h for h in range(spec.num_heads) if spec.kv_heads[h] == kv_head):
        found = snap.queries(layer, head, seq)
        assert found is not None
        heads.append(_Head(spec, head, np.asarray(found.q, np.float32), found.positions, k, v, kv.positions))
    return heads


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
    output = found.astype(np.float64) @ np.asarray(v[columns], np.float64)
    reference = (full**2).sum()
    error = float(np.sqrt(((output - full) ** 2).sum() / reference)) if reference > 0 else float("nan")
    top = kept_positions[np.argmax(found, axis=1)] if found.shape[1] else np.full(len(full_top), -1)
    return error, float(np.mean(top == full_top)) if len(full_top) else float("nan")


def simulate_rows(
    path: str | os.PathLike[str],
    methods: Iterable[str] = METHODS,
    budgets: Sequence[float] = BUDGETS,
    snapshot: int = -1,
    *,
    seq: int = 0,
    window: int = OBSERVATION,
    seed: int = 0,
    storage_options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per (method, budget, layer, query head); see the module's docstring."""
    chosen = check_methods(methods)
    for budget in budgets:
        if not 0 < budget <= 1:
            raise ValueError(f"budget {budget} is not in (0, 1]")
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        end = prompt_end(snap)
        for layer in layers_with_queries(snap):
            rows += _layer_rows(snap, layer, seq, chosen, budgets, end, window, rng)
    return rows


def _layer_rows(
    snap: kvformat.Snapshot,
    layer: int,
    seq: int,
    methods: list[str],
    budgets: Sequence[float],
    end: int | None,
    window: int,
    rng: np.random.Generator,
) -> list[dict[str, Any]]:
    spec = snap.layers[layer].queries
    assert spec is not None
    rows: list[dict[str, Any]] = []
    for kv_head in sorted(set(spec.kv_heads)):
        heads = _group_heads(snap, layer, kv_head, seq)
        stop = end if end is not None else int(heads[0].q_positions.min(initial=0))
        scores = _group_scores(heads, stop, window)
        for h in heads:
            rows += _head_rows(h, layer, kv_head, methods, budgets, stop, window, scores, rng)
    return rows


def _head_rows(
    h: _Head,
    layer: int,
    kv_head: int,
    methods: list[str],
    budgets: Sequence[float],
    end: int,
    window: int,
    scores: dict[str, np.ndarray],
    rng: np.random.Generator,
) -> list[dict[str, Any]]:
    decode = h.q_positions >= end
    rows_eval = decode if decode.any() else h.q_positions >= end - window
    if not rows_eval.any():
        return []
    full_weights = attention_weights(
        h.spec, h.head, h.q[rows_eval], h.k, h.q_positions[rows_eval], h.k_positions
    )
    full = full_weights.astype(np.float64) @ h.v.astype(np.float64)
    full_top = h.k_positions[np.argmax(full_weights, axis=1)]
    base = {"layer": layer, "head": h.head, "kv_head": kv_head, "n_queries": int(rows_eval.sum())}
    out = []
    for method in methods:
        if method in QUANTIZATION:
            axis, bits = QUANTIZATION[method]
            k = quantize(h.k, bits, axis=0 if axis == "channel" else 1, group=GROUP)
            v = quantize(h.v, bits, axis=1)
            error, agreement = _error(h, rows_eval, full, full_top, None, k, v)
            out.append(
                {
                    "method": method,
                    "budget": bits / 16,
                    **base,
                    "relative_error": error,
                    "top1_agreement": agreement,
                }
            )
            continue
        for budget in budgets:
            keep = kept_keys(method, budget, h.k_positions, end, scores, rng, window)
            error, agreement = _error(h, rows_eval, full, full_top, keep, h.k, h.v)
            out.append(
                {
                    "method": method,
                    "budget": budget,
                    **base,
                    "relative_error": error,
                    "top1_agreement": agreement,
                }
            )
    return out


def simulate(
    path: str | os.PathLike[str],
    methods: Iterable[str] = METHODS,
    budgets: Sequence[float] = BUDGETS,
    snapshot: int = -1,
    **options: Any,
) -> Any:
    """`simulate_rows` as a Polars DataFrame: ``method``, ``budget``, ``layer``, ``head``,
    ``kv_head``, ``n_queries``, ``relative_error``, ``top1_agreement``."""
    import polars as pl

    return pl.DataFrame(simulate_rows(path, methods, budgets, snapshot, **options))
