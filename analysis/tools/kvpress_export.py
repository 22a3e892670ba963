"""Artifacts NVIDIA's kvpress loads unchanged, written from captures.

- **DuoAttention's head pattern** (`duo_attention_pattern`, `write_duo_attention`): the layout of
  the DuoAttention repository's ``attn_patterns`` folders that kvpress's ``DuoAttentionPress``
  reads (``presses/duo_attention_press.py``, ``load_attention_pattern``):
  ``full_attention_heads.tsv``, one row per layer and one tab-separated column per KV head, each a
  value in [0, 1] (high: the head needs its whole context; kvpress makes the lowest
  ``head_compression_ratio`` of them streaming heads), and ``config.json`` with ``sink_size`` and
  ``recent_size``. kvsnap's value for a KV head is the largest, over the query heads reading it, of
  its ``streaming_error`` (the relative error of the head's output with only the 4 sinks and the
  last ``window`` keys: DuoAttention's own question), divided by the largest over the model, and
  its ``retrieval_score`` (Wu et al. 2024): a head that copies from far back stays whole. Sinks 4
  and recent ``window``: the streaming heads kvpress then makes are the ones measured.
- **ExpectedAttention's query statistics** (`expected_attention_stats`,
  `write_expected_attention_stats`): what ``ExpectedAttentionStatsPress(stats_folder=DIR)``
  loads (``presses/expected_attention_with_stats.py``, ``ExpectedAttentionStats``): a
  ``model.safetensors`` holding ``query_mean`` ``(layers, query heads, head_dim)`` and
  ``query_cov`` ``(layers, query heads, head_dim, head_dim)`` float32, and a ``config.json`` of
  the module's arguments. As ``collect_queries`` forms them: the pre-RoPE queries (the file's
  own, RoPE undone with the rotation it records) at every stored position from ``n_sink`` on,
  pooled over every file given, their mean and their covariance over ``N - 1``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvformat
from kvformat.io.outputs import files_into

from ..attention.head_importance import attention_rows
from ..errors import AnalysisError
from ..stats.rope import Rope

DUO_FILES = ["full_attention_heads.tsv", "config.json"]
STATS_FILES = ["model.safetensors", "config.json"]
SINKS = 4


class ExportError(AnalysisError):
    """A capture that cannot give the artifact asked for (no queries, no RoPE, layers that
    differ)."""


def duo_attention_pattern(path: str | os.PathLike[str], *, window: int = 256) -> np.ndarray:
    """``(layers, kv_heads)`` float64 in [0, 1]: each KV head's need of its whole context (see the
    module's docstring). Every layer of the model is a row; a layer the file holds no queries for
    is all 1 (kept whole)."""
    with kvformat.open(path) as snap:
        layers = [spec for spec in snap.layers if "of_layer" not in spec.attributes]
        heads = {spec.num_heads for spec in layers if spec.present}
        if len(heads) != 1:
            raise ExportError(
                f"{snap.name}: layers of {sorted(heads)} KV heads; kvpress's pattern is one table"
            )
        kv_heads = heads.pop()
    rows = list(attention_rows(path, window=window))
    if not rows:
        raise ExportError(f"{path}: no queries: capture with --queries window:W or all")
    largest = max((_finite(r["streaming_error"]) for r in rows), default=0.0)
    pattern = np.ones((len(layers), kv_heads))
    seen = np.zeros(pattern.shape, bool)
    for row in rows:
        streaming = _finite(row["streaming_error"]) / largest if largest > 0 else 0.0
        value = min(1.0, max(streaming, _finite(row["retrieval_score"])))
        at = (row["layer"], row["kv_head"])
        pattern[at] = value if not seen[at] else max(pattern[at], value)
        seen[at] = True
    return pattern


def _finite(value: float | None) -> float:
    """``value``, or 0 where a score is missing or NaN (no streaming error, no retrieval event)."""
    return value if value is not None and math.isfinite(value) else 0.0


def write_duo_attention(
    path: str | os.PathLike[str], folder: str | os.PathLike[str], *, window: int = 256, force: bool = False
) -> list[str]:
    """Write DuoAttention's ``full_attention_heads.tsv`` and ``config.json`` for the capture
    ``path`` into ``folder`` (created if missing; only these two names are written there, an
    existing one only with ``force``). Returns the paths written."""
    pattern = duo_attention_pattern(path, window=window)
    config = {
        "sink_size": SINKS,
        "recent_size": window,
        "source": "kvsnap: max over a KV head's query heads of streaming_error / the model's largest and "
        "retrieval_score",
        "capture": os.path.basename(os.fspath(path)),
    }
    with files_into(folder, DUO_FILES, inputs=[path], force=force) as temporary:
        np.savetxt(os.path.join(temporary, DUO_FILES[0]), pattern, fmt="%.6f", delimiter="\t")
        with open(os.path.join(temporary, DUO_FILES[1]), "x", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    return [os.path.join(os.fspath(folder), name) for name in DUO_FILES]


@dataclass
class _Moments:
    """Running sums of one query head's pre-RoPE queries: count, sum ``(d,)``, ``q q^T`` ``(d, d)``."""

    count: int
    total: np.ndarray
    outer: np.ndarray


def expected_attention_stats(
    paths: Sequence[str | os.PathLike[str]], *, n_sink: int = SINKS
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """``(query_mean (layers, heads, d), query_cov (layers, heads, d, d), config)`` float32 over
    every stored query at positions ``>= n_sink`` of every file in ``paths`` (one model), a head
    at a time (memory: one head's queries). ``config``: ``ExpectedAttentionStats``'s arguments."""
    moments: dict[tuple[int, int], _Moments] = {}
    shape: tuple[int, int, int] | None = None
    model_name, longest = "", 0
    for path in paths:
        with kvformat.open(path) as snap:
            layers, here = _query_layers(snap)
            if shape is not None and here != shape:
                raise ExportError(
                    f"{snap.name}: {here} (layers, query heads, dim), not the first file's {shape}"
                )
            shape = here
            model = snap.metadata.get("model")
            model_name = model_name or (str(model.get("name")) if isinstance(model, dict) else "")
            longest = max(longest, snap.seq_len)
            for number, layer in enumerate(layers):
                _add_layer(snap, layer, number, shape, n_sink, moments)
    assert shape is not None
    mean, cov = _mean_and_covariance(moments, shape)
    config = {
        "num_layers": shape[0],
        "num_heads": shape[1],
        "head_dim": shape[2],
        "dataset_name": "kvsnap:" + ",".join(os.path.basename(os.fspath(p)) for p in paths)[:200],
        "model_name": model_name or "unknown",
        "num_samples": len(paths),
        "sample_seq_len": longest,
        "n_sink": n_sink,
    }
    return mean, cov, config


def _query_layers(snap: kvformat.Snapshot) -> tuple[list[int], tuple[int, int, int]]:
    """The model's layers of ``snap`` and ``(layers, query heads, dim)``; `ExportError` unless
    every one holds queries of one shape (kvpress's table is one array)."""
    layers = [i for i, spec in enumerate(snap.layers) if "of_layer" not in spec.attributes]
    specs = [snap.layers[i].queries if snap.layers[i].present else None for i in layers]
    if not any(specs):
        raise ExportError(f"{snap.name}: no queries: capture with --queries all (or window:W)")
    shapes = {(spec.num_heads, spec.dim) if spec is not None else None for spec in specs}
    if len(shapes) != 1 or None in shapes:
        raise ExportError(f"{snap.name}: every layer must hold queries of one shape for kvpress's table")
    heads, dim = shapes.pop()  # type: ignore[misc]
    return layers, (len(layers), heads, dim)


def _add_layer(
    snap: kvformat.Snapshot,
    layer: int,
    number: int,
    shape: tuple[int, int, int],
    n_sink: int,
    moments: dict[tuple[int, int], _Moments],
) -> None:
    """Add the pre-RoPE queries of file layer ``layer`` (the model's ``number``) at positions
    ``>= n_sink`` to ``moments``, a head at a time."""
    dim = shape[2]
    try:
        rope = Rope.from_metadata(snap.metadata, snap.layers[layer].attributes, dim)
    except AnalysisError as exc:
        raise ExportError(f"{snap.name}: {exc}") from None
    for head in range(shape[1]):
        queries = snap.queries(layer, head)
        assert queries is not None
        keep = queries.positions >= n_sink
        q = rope.rotate(queries.q[keep], queries.positions[keep], inverse=True).astype(np.float64)
        held = moments.setdefault((number, head), _Moments(0, np.zeros(dim), np.zeros((dim, dim))))
        held.count += q.shape[0]
        held.total += q.sum(axis=0)
        held.outer += q.T @ q


def _mean_and_covariance(
    moments: dict[tuple[int, int], _Moments], shape: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Each head's mean and covariance (over ``N - 1``), float32 ``(layers, heads, d[, d])``."""
    mean = np.zeros(shape, np.float64)
    cov = np.zeros((*shape, shape[2]), np.float64)
    for (layer, head), held in moments.items():
        if held.count < 2:
            raise ExportError(
                f"layer {layer} head {head}: {held.count} queries past the sinks; a covariance needs 2"
            )
        mu = held.total / held.count
        mean[layer, head] = mu
        cov[layer, head] = (held.outer - held.count * np.outer(mu, mu)) / (held.count - 1)
    return mean.astype(np.float32), cov.astype(np.float32)


def write_expected_attention_stats(
    paths: Sequence[str | os.PathLike[str]],
    folder: str | os.PathLike[str],
    *,
    n_sink: int = SINKS,
    force: bool = False,
) -> list[str]:
    """Write ``model.safetensors`` and ``config.json`` (`expected_attention_stats`) into
    ``folder``: ``ExpectedAttentionStatsPress(stats_folder=folder)`` loads them. Only these two
    names are written there, an existing one only with ``force``."""
    from safetensors.numpy import save_file

    mean, cov, config = expected_attention_stats(paths, n_sink=n_sink)
    with files_into(folder, STATS_FILES, inputs=list(paths), force=force) as temporary:
        save_file({"query_mean": mean, "query_cov": cov}, os.path.join(temporary, STATS_FILES[0]))
        with open(os.path.join(temporary, STATS_FILES[1]), "x", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    return [os.path.join(os.fspath(folder), name) for name in STATS_FILES]
