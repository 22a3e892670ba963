"""Queries in the file: stored, inherited by later snapshots, refused by a 1.2 reader, attention
recomputed from the file equal to SPEC 10.1's definition in numpy, and the attention commands.
Attention held to the model's own kernel is `tests/capture/test_attention_held_to_model.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvformat import attention
from kvformat.manifest import QuerySpec
from kvformat.rewrite import rebuild_index

# -- the format ------------------------------------------------------------------------------


def _spec(**changes: Any) -> kvformat.LayerSpec:
    queries = QuerySpec(num_heads=4, dim=8, dtype=kvformat.FLOAT32, scale=8**-0.5, kv_heads=(0, 0, 1, 1))
    if changes:
        queries = QuerySpec(**{**queries.__dict__, **changes})
    return kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT32, queries=queries)


def _write(path: Path, spec: kvformat.LayerSpec | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    spec = spec or _spec()
    k = rng.standard_normal((2, 40, 8)).astype(np.float32)
    v = rng.standard_normal((2, 40, 8)).astype(np.float32)
    q = rng.standard_normal((4, 40, 8)).astype(np.float32)
    with kvformat.Writer(path, [spec, None]) as writer:
        writer.append(0, k[:, :30], v[:, :30])
        writer.append_queries(0, q[:, 20:30], np.arange(20, 30))
        writer.snapshot()
        writer.append(0, k[:, 30:], v[:, 30:])
        writer.append_queries(0, q[:, 30:], np.arange(30, 40))
        writer.snapshot()
    return {"k": k, "v": v, "q": q}


def _reference(data: dict[str, np.ndarray], spec: QuerySpec, head: int, positions: np.ndarray) -> np.ndarray:
    """Softmax attention in float64 straight from the definition (SPEC 10.1)."""
    q = data["q"][head, positions].astype(np.float64)
    k = data["k"][spec.kv_heads[head]].astype(np.float64)
    logits = spec.scale * q @ k.T
    if spec.softcap is not None:
        logits = spec.softcap * np.tanh(logits / spec.softcap)
    j = np.arange(k.shape[0])[None, :]
    p = positions[:, None]
    mask = j <= p
    if spec.window is not None:
        mask &= (p - j < spec.window - spec.keep) | (j < spec.keep)
    logits = np.where(mask, logits, -np.inf)
    top = logits.max(axis=1, keepdims=True)
    if spec.sinks is not None:
        top = np.maximum(top, spec.sinks[head])
    e = np.exp(logits - top)
    total = e.sum(axis=1, keepdims=True) + (np.exp(spec.sinks[head] - top) if spec.sinks is not None else 0)
    return e / total


@pytest.mark.parametrize(
    "changes",
    [{}, {"window": 8}, {"window": 12, "keep": 4}, {"softcap": 5.0}, {"sinks": (0.5, -1.0, 2.0, 0.0)}],
    ids=["causal", "window", "window-keep", "softcap", "sinks"],
)
def test_attention_equals_the_definition(tmp_path: Path, changes: dict[str, Any]) -> None:
    spec = _spec(**changes)
    data = _write(tmp_path / "q.kv", spec)
    assert spec.queries is not None
    with kvformat.open(tmp_path / "q.kv") as snap:
        assert snap.version == (1, 3) and "queries" in snap._file.manifest.required_features
        for head in range(4):
            found = snap.attention(0, head)
            np.testing.assert_array_equal(found.query_positions, np.arange(20, 40))
            expected = _reference(data, spec.queries, head, found.query_positions)
            np.testing.assert_allclose(found.weights, expected, rtol=1e-5, atol=1e-6)
            masked = ~attention.visible(spec.queries, found.query_positions, found.key_positions)
            assert bool(np.all(found.weights[masked] == 0.0))  # exactly 0
            sums = found.weights.sum(axis=1)
            if spec.queries.sinks is None:
                np.testing.assert_allclose(sums, 1.0, rtol=1e-5)
            else:
                assert bool(np.all(sums < 1.0))
            output, positions = snap.attention_output(0, head)
            np.testing.assert_array_equal(positions, found.query_positions)
            np.testing.assert_allclose(
                output, expected @ data["v"][spec.queries.kv_heads[head]], rtol=1e-4, atol=1e-5
            )
            part = snap.attention(0, head, queries=(25, 27), keys=(0, 10))
            np.testing.assert_allclose(part.weights, expected[5:7, :10], rtol=1e-5, atol=1e-6)


def test_queries_series_and_absent_layers(tmp_path: Path) -> None:
    data = _write(tmp_path / "q.kv")
    with kvformat.open(tmp_path / "q.kv") as snap:
        found = snap.queries(0, 3)
        assert found is not None
        np.testing.assert_array_equal(found.q, data["q"][3, 20:])
        first = snap.select(0).queries(0, 3)
        assert first is not None and first.positions.tolist() == list(range(20, 30))
        assert snap.queries(1, 0) is None  # absent layer
        with pytest.raises(kvformat.OutOfRangeError):
            snap.queries(0, 4)
        snap.verify()


def test_files_without_queries_stay_1_2_and_say_so(tmp_path: Path) -> None:
    path = tmp_path / "plain.kv"
    kvformat.save(path, [kvformat.Layer(np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 4), np.float32))])
    with kvformat.open(path) as snap:
        assert snap.version == (1, 2)
        with pytest.raises(ValueError, match="holds no queries"):
            snap.queries(0, 0)


def test_a_1_2_reader_refuses_a_file_with_queries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1.2 reader knows no "queries" feature: R7 refuses the file before any chunk is read, so it
    never reads Q chunks as K/V (SPEC section 14)."""
    from kvformat import manifest

    _write(tmp_path / "q.kv")
    monkeypatch.setattr(manifest, "KNOWN_FEATURES", frozenset({"append-chunks"}))
    with pytest.raises(kvformat.UnsupportedFeatureError, match="queries"):
        kvformat.open(tmp_path / "q.kv")


def test_hostile_query_references(tmp_path: Path) -> None:
    source = tmp_path / "q.kv"
    _write(source)

    def point_at_k(document: dict[str, Any]) -> None:
        document["snapshots"][1]["queries"] = [0, 1]  # chunk 0 is a K chunk

    bad = tmp_path / "bad.kv"
    rebuild_index(source, bad, edit_json=point_at_k)
    with (
        kvformat.open(bad) as snap,
        pytest.raises(kvformat.CorruptFileError, match="neither a Q nor a selection chunk"),
    ):
        snap.queries(0, 0)

    def twice(document: dict[str, Any]) -> None:
        snapshot = document["snapshots"][1]
        snapshot["queries"] = snapshot["queries"] + document["snapshots"][0]["queries"]

    rebuild_index(source, tmp_path / "twice.kv", edit_json=twice)
    with (
        kvformat.open(tmp_path / "twice.kv") as snap,
        pytest.raises(kvformat.CorruptFileError, match="twice"),
    ):
        snap.verify()

    def wider(table: np.ndarray) -> None:
        table["head"][table["kind"] == 3] = 4  # the layer has query heads 0..3

    rebuild_index(source, tmp_path / "wide.kv", edit_table=wider)
    with pytest.raises(kvformat.CorruptFileError, match="query chunk"):
        kvformat.open(tmp_path / "wide.kv")

    def undeclared(document: dict[str, Any]) -> None:
        document["manifest"]["required_features"] = ["append-chunks"]

    rebuild_index(source, tmp_path / "undeclared.kv", edit_json=undeclared)
    with pytest.raises(kvformat.CorruptFileError, match="queries"):
        kvformat.open(tmp_path / "undeclared.kv")


def _softmax_over(keys: np.ndarray, query: np.ndarray, scale: float) -> np.ndarray:
    """numpy's softmax of ``scale * keys @ query`` in float64: one query's weights over exactly
    ``keys``."""
    logits = scale * (keys.astype(np.float64) @ query.astype(np.float64))
    expected = np.exp(logits - logits.max())
    return expected / expected.sum()


def test_chunked_attention_sees_only_the_querys_block() -> None:
    """SPEC 10.1 (1.6): with ``chunk`` C a query at p attends keys j <= p with j // C == p // C,
    held to numpy's softmax over exactly those keys (vector queries-chunked.kv, C = 4)."""
    path = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "queries-chunked.kv"
    with kvformat.open(path) as snap:
        spec = snap.layers[0].queries
        assert spec is not None and spec.chunk == 4
        head = snap.head(0, 0)
        assert head is not None
        for query_head in range(spec.num_heads):
            found = snap.queries(0, query_head)
            assert found is not None
            weights = snap.attention(0, query_head).weights
            for row, p in enumerate(found.positions.tolist()):
                seen = [j for j in range(p + 1) if j // 4 == p // 4]
                expected = _softmax_over(head.k[seen], found.q[row], spec.scale)
                np.testing.assert_allclose(weights[row, seen], expected, rtol=1e-5)
                assert np.count_nonzero(weights[row]) == len(seen)


def test_latent_attention_uses_the_latent_and_the_rope_key_as_the_spec_says() -> None:
    """SPEC 10.1 (1.6): a latent layer's query [q_c; q_r] has logits scale * (q_c . c_j + q_r .
    r_j) over the K slot's latents c and the V slot's RoPE keys r, and its output is the weighted
    sum of the latents (vector queries-latent.kv), held to numpy."""
    path = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "queries-latent.kv"
    with kvformat.open(path) as snap:
        spec = snap.layers[0].queries
        assert spec is not None and spec.latent and spec.dim == 8
        head = snap.head(0, 0)
        assert head is not None
        latents, rope_keys = head.k.astype(np.float64), head.v.astype(np.float64)
        for query_head in range(spec.num_heads):
            found = snap.queries(0, query_head)
            assert found is not None
            output, positions = snap.attention_output(0, query_head)
            weights = snap.attention(0, query_head).weights
            for row, p in enumerate(positions.tolist()):
                q = found.q[row].astype(np.float64)
                logits = spec.scale * (latents[: p + 1] @ q[:6] + rope_keys[: p + 1] @ q[6:])
                expected = np.exp(logits - logits.max())
                expected /= expected.sum()
                np.testing.assert_allclose(weights[row, : p + 1], expected, rtol=1e-5)
                np.testing.assert_allclose(output[row], expected @ latents[: p + 1], rtol=1e-5, atol=1e-6)


SPARSE_VECTOR = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "queries-sparse.kv"


def test_sparse_attention_reads_only_the_selected_keys_as_the_spec_says() -> None:
    """SPEC 10.1 (1.7): a query at p with a selection row attends only the keys j <= p its row
    names; a query without one every key j <= p (vector queries-sparse.kv: rows for positions
    4..8, position 4's naming a future key), held to numpy's softmax over exactly those keys."""
    with kvformat.open(SPARSE_VECTOR) as snap:
        spec = snap.layers[0].queries
        assert spec is not None and spec.selection == 3 and snap.version == (1, 7)
        chosen = snap.selection(0)
        assert chosen is not None and chosen.positions.tolist() == [4, 5, 6, 7, 8]
        assert chosen.rows[0].tolist() == [0, 2, 5]
        rows = {int(p): set(r.tolist()) for p, r in zip(chosen.positions, chosen.rows, strict=True)}
        head = snap.head(0, 0)
        assert head is not None
        for query_head in range(spec.num_heads):
            found = snap.queries(0, query_head)
            assert found is not None
            weights = snap.attention(0, query_head).weights
            output, _ = snap.attention_output(0, query_head)
            for row, p in enumerate(found.positions.tolist()):
                seen = [j for j in range(p + 1) if p not in rows or j in rows[p]]
                expected = _softmax_over(head.k[seen], found.q[row], spec.scale)
                np.testing.assert_allclose(weights[row, seen], expected, rtol=1e-5)
                assert np.count_nonzero(weights[row]) == len(seen)
                np.testing.assert_allclose(output[row], expected @ head.v[seen], rtol=1e-5, atol=1e-6)
        # Ignoring the selections gives other weights: the check above can fail.
        plain = attention.weights(spec, 0, found.q, head.k, found.positions, head.positions)
        assert not np.allclose(plain, weights)


def test_selections_are_written_sorted_checked_and_need_their_feature(tmp_path: Path) -> None:
    """The writer stores each row sorted and refuses rows it cannot store; a file with selections
    lists ``sparse-attention`` and has minor 7 (a 1.6 reader refuses it at R7); one without stays
    minor 3."""
    from kvformat import manifest

    spec = kvformat.LayerSpec(
        1, 8, 8, kvformat.FLOAT32, queries=QuerySpec(2, 8, kvformat.FLOAT32, 0.25, (0, 0), selection=2)
    )
    rng = np.random.default_rng(5)
    path = tmp_path / "sparse.kv"
    with kvformat.Writer(path, [spec]) as writer:
        writer.append(
            0,
            rng.standard_normal((1, 4, 8)).astype(np.float32),
            rng.standard_normal((1, 4, 8)).astype(np.float32),
        )
        writer.append_queries(0, rng.standard_normal((2, 4, 8)).astype(np.float32), np.arange(4))
        for bad, why in (
            (np.array([[1, 1]]), "distinct"),
            (np.array([[-1, 0]]), "distinct"),
            (np.array([[0, 1, 2]]), "width=2"),
            (np.array([[0.0, 1.0]]), "integers"),
        ):
            with pytest.raises(kvformat.errors.InvalidArrayError, match=why):
                writer.append_selection(0, bad, [3])
        writer.append_selection(0, np.array([[2, 0], [3, 1]]), [2, 3])
        with pytest.raises(kvformat.errors.InvalidArrayError, match="not after"):
            writer.append_selection(0, np.array([[0, 1]]), [3])
    with kvformat.open(path) as snap:
        assert snap.version == (1, 7)
        assert "sparse-attention" in snap._file.manifest.required_features
        found = snap.selection(0)
        assert found is not None and found.rows.tolist() == [[0, 2], [1, 3]]
        assert snap.selection(0, positions=(3, 4)).positions.tolist() == [3]  # type: ignore[union-attr]
        snap.verify()
    _write(tmp_path / "dense.kv")
    with kvformat.open(tmp_path / "dense.kv") as snap:
        assert snap.version == (1, 3) and snap.selection(0) is None
    plain = kvformat.LayerSpec(
        1, 8, 8, kvformat.FLOAT32, queries=QuerySpec(2, 8, kvformat.FLOAT32, 0.25, (0, 0))
    )
    with (
        kvformat.Writer(tmp_path / "no.kv", [plain]) as writer,
        pytest.raises(kvformat.errors.NoQueriesError),
    ):
        writer.append_selection(0, np.array([[0, 1]]), [1])
    known = manifest.KNOWN_FEATURES - {"sparse-attention"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "KNOWN_FEATURES", known)
        with pytest.raises(kvformat.UnsupportedFeatureError, match="sparse-attention"):
            kvformat.open(path)


POOLED_VECTOR = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "queries-pooled.kv"


def test_pooled_attention_reads_the_window_and_the_whole_selected_groups_as_the_spec_says() -> None:
    """SPEC 10.1 (1.8): a query at p attends its own layer's keys j with p - j < window and,
    in the same softmax (sinks included), layer 1's groups g with (g + 1) * ratio <= p + 1 that
    its selection row names (every whole group without a row); held to numpy in float64
    (vector queries-pooled.kv: window 4, ratio 2, rows from position 3)."""
    with kvformat.open(POOLED_VECTOR) as snap:
        spec = snap.layers[0].queries
        assert spec is not None and spec.pooled == kvformat.Pooled(1, 2) and snap.version == (1, 8)
        assert spec.sinks is not None
        chosen = snap.selection(0)
        assert chosen is not None
        rows = {int(p): set(r.tolist()) for p, r in zip(chosen.positions, chosen.rows, strict=True)}
        own, pooled = snap.head(0, 0), snap.head(1, 0)
        assert own is not None and pooled is not None and pooled.positions.tolist() == [0, 1, 2, 3, 4]
        for query_head in range(spec.num_heads):
            found = snap.queries(0, query_head)
            assert found is not None
            result = snap.attention(0, query_head)
            assert result.pooled_keys == 5
            assert result.key_positions.tolist() == [*range(10), *range(5)]
            output, _ = snap.attention_output(0, query_head)
            sink = spec.sinks[query_head]
            for row, p in enumerate(found.positions.tolist()):
                mine = [j for j in range(10) if j <= p and p - j < 4]
                groups = [g for g in range(5) if (g + 1) * 2 <= p + 1 and (p not in rows or g in rows[p])]
                keys = np.concatenate([own.k[mine], pooled.k[groups]]).astype(np.float64)
                values = np.concatenate([own.v[mine], pooled.v[groups]]).astype(np.float64)
                logits = spec.scale * keys @ found.q[row].astype(np.float64)
                top = max(logits.max(), sink)
                expected = np.exp(logits - top) / (np.exp(logits - top).sum() + np.exp(sink - top))
                columns = mine + [10 + g for g in groups]
                np.testing.assert_allclose(result.weights[row, columns], expected, rtol=1e-5)
                assert np.count_nonzero(result.weights[row]) == len(columns)
                np.testing.assert_allclose(output[row], expected @ values, rtol=1e-5, atol=1e-6)
        # A computation over the layer's own keys alone is refused, never quietly short.
        with pytest.raises(kvformat.errors.PooledKeysError, match="pooled keys"):
            attention.context_keys(snap, 0, 0, 0, found.positions)
        with pytest.raises(kvformat.errors.PooledKeysError):
            attention.visible(spec, found.positions, own.positions)
        with pytest.raises(kvformat.errors.InvalidArgumentError, match=r"keys=\(start, stop\) is not"):
            snap.attention(0, 0, keys=(0, 4))


def test_pooled_keys_need_another_present_layer_of_the_same_shape(tmp_path: Path) -> None:
    """The writer refuses what a reader would refuse (SPEC 10.1, 1.8), and writes minor 8 with
    the feature ``pooled-attention``."""
    pooled = QuerySpec(2, 8, kvformat.FLOAT32, 0.25, (0, 0), pooled=kvformat.Pooled(1, 4))
    layer = kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32, queries=pooled)
    for others, why in (
        ([kvformat.LayerSpec.absent()], "not another present layer"),
        ([kvformat.LayerSpec(1, 8, 4, kvformat.FLOAT32)], "same K and V head dims"),
        ([], "not another present layer"),
    ):
        with pytest.raises(kvformat.errors.InvalidLayoutError, match=why):
            kvformat.Writer(tmp_path / "bad.kv", [layer, *others])
    self_pooled = QuerySpec(2, 8, kvformat.FLOAT32, 0.25, (0, 0), pooled=kvformat.Pooled(0, 4))
    with pytest.raises(kvformat.errors.InvalidLayoutError):
        kvformat.Writer(
            tmp_path / "self.kv", [kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32, queries=self_pooled)]
        )
    with kvformat.Writer(
        tmp_path / "good.kv", [layer, kvformat.LayerSpec(1, 8, 8, kvformat.FLOAT32)]
    ) as writer:
        writer.snapshot()
    with kvformat.open(tmp_path / "good.kv") as snap:
        assert snap.version == (1, 8)
        assert "pooled-attention" in snap._file.manifest.required_features


def test_a_query_whose_groups_the_file_does_not_hold_is_refused(tmp_path: Path) -> None:
    """A pooled layer holding no rows yet: a query that saw whole groups cannot be recomputed
    (`MissingKeysError`, SPEC 10.1), one that saw none can."""
    pooled = QuerySpec(1, 4, kvformat.FLOAT32, 0.5, (0,), pooled=kvformat.Pooled(1, 2))
    layers = [
        kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32, queries=pooled),
        kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32),
    ]
    rows = np.ones((1, 3, 4), np.float32)
    with kvformat.Writer(tmp_path / "p.kv", layers) as writer:
        writer.append(0, rows, rows)
        writer.append_queries(0, rows, np.arange(3))
        writer.snapshot()
    with kvformat.open(tmp_path / "p.kv") as snap:
        first = snap.attention(0, 0, queries=(0, 1))  # position 0: no whole group to see
        assert first.pooled_keys == 0 and first.weights[0].tolist() == [1.0, 0.0, 0.0]
        with pytest.raises(kvformat.MissingKeysError, match=r"positions 1\.\.2"):
            snap.attention(0, 0)
