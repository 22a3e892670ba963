"""What the model answers from a compressed cache: the end-to-end what-if of `kvsnap simulate`.

kvpress's pipeline (``pipeline.py``, ``KVPressTextGenerationPipeline``) compresses the cache once,
at the end of the context, then reads the question uncompressed and decodes the answer greedily
from what is left. This does the same on MLX, from a capture: the cache is restored from the file
(`resume.restore`) and cut at the end of the compressed span; each eviction method keeps the keys
`kvsnap.analysis.attention.compression.kept_mask` chooses from the file's own queries, keys and
values (the same choice as the per-head what-ifs, held to kvpress's presses); the evicted keys are
masked out of every later attention call of their layer and KV head (kvpress's ``AdaKVPress``
masks them the same way; every other press removes them, which gives the same softmax). Later
tokens keep their positions, as kvpress's ``position_ids`` do. Then:

- the question (the prompt's tokens after the span, then the ``question`` text) is read; tokens
  the capture generated after its prompt are not: the answer is decoded afresh;
- the answer is decoded greedily from the full cache (the reference) and from each compressed one;
- teacher-forced along the reference answer, each compressed run's next-token distribution is
  compared with the full cache's: ``kl_mean`` / ``kl_max`` (``KL(full || compressed)``, nats, per
  answer token, float32 log-softmax) and ``top1_agreement`` (the fraction of answer tokens the
  compressed run also ranks first);
- ``greedy_agreement``: the fraction of the reference answer's tokens the compressed run's own
  greedy answer repeats at the same place; ``answer_found``: whether the known ``answer`` occurs
  in the generated text (case-insensitive, kvpress's RULER ``string_match_all``).

Every layer must be a plain ``KVCache`` whose attention runs through mlx-lm's
``scaled_dot_product_attention`` (where the mask goes in); other caches are refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

import kvformat

# mypy checks the stage as the top-level package `analysis`, so it cannot resolve this name.
from kvsnap.analysis.attention import compression  # type: ignore[import-not-found]

from .errors import UnsupportedModelError
from .queries import hook_attention, unhook_attention
from .resume import restore, tokens_of

DEFAULT_MAX_TOKENS = 32


@dataclass(frozen=True)
class Answer:
    """One run's outcome: ``method`` and ``budget`` (``"full"``, 1.0 for the uncompressed cache),
    ``kept`` (the fraction of the span's keys kept, mean over KV heads), the divergence from the
    full cache (`compressed_answers`), and the greedy answer's token ids and text."""

    method: str
    budget: float
    kept: float
    kl_mean: float
    kl_max: float
    top1_agreement: float
    greedy_agreement: float
    answer_found: bool | None
    tokens: list[int]
    text: str

    def row(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "budget": self.budget,
            "kept": self.kept,
            "kl_mean": self.kl_mean,
            "kl_max": self.kl_max,
            "top1_agreement": self.top1_agreement,
            "greedy_agreement": self.greedy_agreement,
            "answer_found": self.answer_found,
            "text": self.text,
        }


def compressed_answers(
    model: Any,
    tokenizer: Any,
    snap: kvformat.Snapshot,
    methods: Sequence[str],
    budgets: Sequence[float],
    *,
    question: str = "",
    answer: str | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    options: compression.Options | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Answer]:
    """The full cache's answer first, then one `Answer` per (method, budget): ``snap`` is a capture
    of ``model`` holding the queries the methods need (as for `simulate`); the span compressed is
    ``options.span_end(snap)`` (the prompt, or the context before ``question_start``)."""
    options = options or compression.Options()
    end, context, follow = _inputs(tokenizer, snap, methods, question, max_tokens, options)
    base = _restored(snap, model, end)
    _check_model(model, snap, base, context[: min(end, 32)])
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    reference, full = _decoded(model, base, follow, {}, max_tokens, eos, None)
    text = tokenizer.decode(reference)
    out = [Answer("full", 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, _found(answer, text), reference, text)]
    for method in methods:
        for budget in budgets:
            if progress is not None:
                progress(f"{method} {budget:g}")
            evicted, kept = _evicted(snap, method, budget, end, options)
            tokens, logits = _decoded(model, base, follow, evicted, max_tokens, eos, reference)
            got = Answer(method, budget, kept, 0.0, 0.0, 0.0, 0.0, None, tokens, tokenizer.decode(tokens))
            out.append(_compared(got, full, logits, reference, answer))
    return out


def _inputs(
    tokenizer: Any,
    snap: kvformat.Snapshot,
    methods: Sequence[str],
    question: str,
    max_tokens: int,
    options: compression.Options,
) -> tuple[int, list[int], list[int]]:
    """The span's end, the file's token ids and the ids read after the span (the prompt's rest,
    then ``question``); `CompressionError` for what cannot run."""
    for method in methods:
        if method not in compression.EVICTION:
            raise compression.CompressionError(
                f"{method!r}: end to end runs the eviction methods ({', '.join(compression.EVICTION)})"
            )
    if max_tokens < 1:
        raise compression.CompressionError(f"max_tokens must be at least 1, not {max_tokens}")
    end = options.span_end(snap)
    context = tokens_of(snap)[0]
    prompt = compression.prompt_end(snap) or len(context)
    if not 0 < end <= min(len(context), prompt):
        raise compression.CompressionError(
            f"the span's end {end} is not inside the file's {len(context)} tokens"
        )
    asked = list(tokenizer.encode(question, add_special_tokens=False)) if question else []
    follow = context[end:prompt] + asked
    if not follow:
        raise compression.CompressionError(
            "nothing follows the compressed span in the prompt: give the question (--question TEXT), "
            "or compress the context before it (--compress context --question-start P)"
        )
    return end, context, follow


def _decoded(
    model: Any,
    base: list[Any],
    follow: list[int],
    evicted: dict[int, np.ndarray],
    max_tokens: int,
    eos: set[int],
    reference: list[int] | None,
) -> tuple[list[int], np.ndarray]:
    """The greedy answer from ``base`` with ``evicted`` masked out, and the log-probabilities
    teacher-forced along ``reference`` (None: along that answer itself).

    Where the greedy answer runs along ``reference`` (always for None), the decode's own
    log-probabilities are the teacher-forced ones (the model read the same tokens after the same
    cache), and no second pass runs; otherwise one pass reads ``follow`` and ``reference``."""
    cache = _fresh(base)
    with _Masking(cache, evicted) as masking:
        tokens, decoded = _greedy(model, cache, follow, max_tokens, eos)
    missing = set(range(len(cache))) - masking.calls
    if missing:
        raise UnsupportedModelError(
            f"layer {min(missing)} computes attention without mlx-lm's scaled_dot_product_attention, "
            "where end to end masks the evicted keys"
        )
    along = reference or tokens
    if len(tokens) >= len(along) and tokens[: len(along) - 1] == along[:-1]:
        return tokens, decoded[: len(along)]
    cache = _fresh(base)
    with _Masking(cache, evicted):
        return tokens, _forced(model, cache, follow, reference or tokens)


def _found(answer: str | None, text: str) -> bool | None:
    return None if answer is None else answer.strip().lower() in text.lower()


def _compared(
    got: Answer, full: np.ndarray, logits: np.ndarray, reference: list[int], answer: str | None
) -> Answer:
    """``got`` with its divergence from the full cache: ``full`` and ``logits`` the float32
    log-probabilities ``(answer tokens, vocab)`` teacher-forced along ``reference``."""
    p = np.exp(full)
    kl = np.sum(p * (full - logits), axis=-1)
    agree = np.argmax(logits, axis=-1) == np.asarray(reference)
    shared = min(len(got.tokens), len(reference))
    greedy = sum(a == b for a, b in zip(got.tokens[:shared], reference[:shared], strict=True)) / len(
        reference
    )
    return replace(
        got,
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1_agreement=float(agree.mean()),
        greedy_agreement=float(greedy),
        answer_found=_found(answer, got.text),
    )


def _restored(snap: kvformat.Snapshot, model: Any, end: int) -> list[Any]:
    """The file's cache cut after position ``end - 1``: every layer a plain ``KVCache`` holding
    positions ``0 .. end - 1``, one for each of the model's layers."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = restore(snap)
    expected = make_prompt_cache(model)
    if len(cache) != len(expected):
        raise UnsupportedModelError(
            f"the file holds {len(cache)} cache layers, the model makes {len(expected)}: "
            "not a capture of this model"
        )
    for index, (layer, made) in enumerate(zip(cache, expected, strict=True)):
        if type(layer) is not KVCache or type(made) is not KVCache:
            raise UnsupportedModelError(
                f"end to end needs plain KVCache layers; layer {index} holds {type(made).__name__}"
            )
        if layer.offset < end:
            raise compression.CompressionError(
                f"layer {index} holds {layer.offset} positions, fewer than the span's {end}"
            )
        layer.trim(layer.offset - end)
    return cache


def _check_model(model: Any, snap: kvformat.Snapshot, cache: list[Any], tokens: list[int]) -> None:
    """Refuse a model that does not compute the file's K: the first layer's keys of the first
    ``tokens`` recomputed and compared with the file's (to the file's dtype's precision)."""
    from mlx_lm.models.cache import make_prompt_cache

    fresh = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=fresh)
    mine = np.array(fresh[0].keys[..., : len(tokens), :].astype(mx.float32))
    theirs = np.array(cache[0].keys[..., : len(tokens), :].astype(mx.float32))
    if mine.shape != theirs.shape:
        raise UnsupportedModelError(f"the model's keys have shape {mine.shape}, the file's {theirs.shape}")
    scale = float(np.abs(theirs).max()) or 1.0
    tolerance = 0.05 if snap.layers[0].dtype is not None and snap.layers[0].dtype.itemsize == 2 else 1e-3
    if float(np.abs(mine - theirs).max()) > tolerance * scale:
        raise UnsupportedModelError(
            "the model does not compute the file's keys: give the model it was captured from"
        )


def _evicted(
    snap: kvformat.Snapshot, method: str, budget: float, end: int, options: compression.Options
) -> tuple[dict[int, np.ndarray], float]:
    """Per layer, ``(query heads, end)`` bool: the span's keys each query head no longer sees
    (its KV head's choice), and the fraction of the span's keys kept (mean over KV heads)."""
    evicted: dict[int, np.ndarray] = {}
    kept_total, groups = 0.0, 0
    for layer, spec in enumerate(snap.layers):
        queries = spec.queries
        if queries is None:
            raise compression.NoQueriesError(f"layer {layer} holds no queries: capture with --queries all")
        masks: dict[int, np.ndarray] = {}
        for head, kv_head in enumerate(queries.kv_heads):
            if kv_head not in masks:
                positions, keep = compression.kept_mask(snap, layer, head, method, budget, options=options)
                row = np.zeros(end, bool)
                inside = positions < end
                row[positions[inside]] = ~keep[inside]
                masks[kv_head] = row
                kept_total += 1 - row.mean()
                groups += 1
        evicted[layer] = np.stack([masks[kv] for kv in queries.kv_heads])
    return evicted, float(kept_total / max(groups, 1))


class _Masking:
    """While installed, every attention call of a layer in ``evicted`` through mlx-lm's
    ``scaled_dot_product_attention`` skips the keys its query heads no longer see."""

    def __init__(self, cache: list[Any], evicted: dict[int, np.ndarray]) -> None:
        self._layers = {id(c): i for i, c in enumerate(cache)}
        self._keep = {layer: mx.array(~rows) for layer, rows in evicted.items()}
        self._saved: list[tuple[Any, Any]] = []
        self.calls: set[int] = set()

    def __enter__(self) -> _Masking:
        from mlx_lm.models import base

        self._saved = hook_attention(self._wrap(base.scaled_dot_product_attention))
        return self

    def __exit__(self, *exc: object) -> None:
        unhook_attention(self._saved)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def scaled_dot_product_attention(
            queries: mx.array,
            keys: mx.array,
            values: mx.array,
            cache: Any,
            scale: float,
            mask: Any,
            sinks: Any = None,
        ) -> mx.array:
            layer = self._layers.get(id(cache))
            if layer is None:
                raise UnsupportedModelError(
                    "an attention call reads no layer's cache: end to end cannot mask it"
                )
            self.calls.add(layer)
            heads, count, total = queries.shape[1], queries.shape[2], keys.shape[2]
            query_positions = mx.arange(total - count, total)[:, None]
            allowed = mx.arange(total)[None, :] <= query_positions  # (count, total): causal
            if isinstance(mask, mx.array):
                allowed = allowed & (mask if mask.dtype == mx.bool_ else mask > -np.inf)
            elif mask not in (None, "causal"):
                raise UnsupportedModelError(
                    f"layer {layer}'s attention mask {mask!r} is not one end to end can extend"
                )
            keep = self._keep.get(layer)
            if keep is not None:
                if keep.shape[0] != heads:
                    raise UnsupportedModelError(
                        f"layer {layer}: the file holds {keep.shape[0]} query heads, "
                        f"the model's attention {heads}"
                    )
                pad = mx.ones((heads, total - keep.shape[1]), dtype=mx.bool_)
                allowed = allowed[None] & mx.concatenate([keep, pad], axis=1)[:, None, :]
            return original(queries, keys, values, cache=cache, scale=scale, mask=allowed, sinks=sinks)

        return scaled_dot_product_attention


def _step(model: Any, cache: list[Any], tokens: list[int]) -> mx.array:
    """The model's float32 log-probabilities ``(len(tokens), vocab)`` after reading ``tokens``."""
    logits = model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _fresh(base: list[Any]) -> list[Any]:
    """``base``'s caches as new objects of the same state (mlx arrays are values: writing to a
    copy leaves ``base`` as it was)."""
    from mlx_lm.models.cache import KVCache

    copies = []
    for layer in base:
        fresh = KVCache()
        fresh.keys, fresh.values, fresh.offset = layer.keys, layer.values, layer.offset
        copies.append(fresh)
    return copies


def _greedy(
    model: Any, cache: list[Any], follow: list[int], max_tokens: int, eos: set[int]
) -> tuple[list[int], np.ndarray]:
    """Read ``follow``, then decode up to ``max_tokens`` greedily (stopping after an end token):
    the tokens, and the float32 log-probabilities ``(len(tokens), vocab)`` each was chosen from."""
    logits = _step(model, cache, follow)[-1]
    out: list[int] = []
    rows: list[np.ndarray] = []
    while True:
        rows.append(np.array(logits))
        token = int(np.argmax(rows[-1]))
        out.append(token)
        if token in eos or len(out) == max_tokens:
            return out, np.stack(rows)
        logits = _step(model, cache, [token])[-1]


def _forced(model: Any, cache: list[Any], follow: list[int], answer: list[int]) -> np.ndarray:
    """Log-probabilities ``(len(answer), vocab)`` predicting each token of ``answer`` after
    ``follow`` and the answer's earlier tokens (one pass)."""
    logits = _step(model, cache, follow + answer[:-1])
    return np.array(logits[len(follow) - 1 :])
