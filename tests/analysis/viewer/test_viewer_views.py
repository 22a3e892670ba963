"""`kvsnap view`'s views beyond one map: two files side by side (the other file's map and the
difference of the weights, held to `snap.attention` of each file), the queries and keys of a head
in one plane (held to an independent numpy PCA of AttentionViz's normalisation), long captures
(a query's row and the K/V view cut to a bounded size, each point held to numpy; the token view
in the page bounded), the tiles sent as float32 bytes; then the same in Chromium: zoom linked
across the three maps, a click on a query in the plane showing its row."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvformat import QuerySpec
from kvsnap.analysis.viewer import data
from kvsnap.analysis.viewer.data import (
    Source,
    attention_difference,
    attention_map,
    kv_view,
    qk_projection,
    query_row,
)
from kvsnap.analysis.viewer.server import ViewerServer

from .test_viewer import _browser

HEADS, QUERY_HEADS, DIM = 2, 4, 16


def synthetic(
    path: Path, tokens: int, *, seed: int = 0, boost: tuple[int, int] | None = None, pieces: bool = False
) -> Path:
    """Two layers of 2 KV heads and 4 query heads (dim 16, float32), a query at every position;
    ``boost``: keys of positions ``[start, stop)`` tripled (the second file of a comparison);
    position 3's key aligned with the last query of head 0 (a needle far back)."""
    rng = np.random.default_rng(seed)
    spec = kvformat.LayerSpec(
        HEADS, DIM, DIM, kvformat.FLOAT32,
        queries=QuerySpec(num_heads=QUERY_HEADS, dim=DIM, dtype=kvformat.FLOAT32, scale=DIM**-0.5,
                          kv_heads=(0, 0, 1, 1)),
    )  # fmt: skip
    k = rng.standard_normal((2, HEADS, tokens, DIM), dtype=np.float32)
    v = rng.standard_normal((2, HEADS, tokens, DIM), dtype=np.float32)
    q = rng.standard_normal((2, QUERY_HEADS, tokens, DIM), dtype=np.float32)
    k[:, 0, 3] = 4 * q[:, 0, -1] / np.linalg.norm(q[:, 0, -1], axis=-1, keepdims=True) * DIM**0.5
    if boost is not None:
        k[:, :, boost[0] : boost[1]] *= 3
    metadata = {"prompt_tokens": tokens}
    with kvformat.Writer(path, [spec, spec], metadata=metadata) as writer:
        for layer in range(2):
            writer.append(layer, k[layer], v[layer])
            writer.append_queries(layer, q[layer], np.arange(tokens))
        snapshot = {"token_pieces": [[f"t{p % 97} " for p in range(tokens)]]} if pieces else {}
        writer.snapshot(snapshot)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("pair")
    return synthetic(folder / "a.kv", 48), synthetic(folder / "b.kv", 48, boost=(10, 14))


@pytest.fixture(scope="module")
def long_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic(tmp_path_factory.mktemp("long") / "long.kv", 6000, pieces=True)


def test_the_difference_map_is_the_other_files_weights_minus_this_files(pair: tuple[Path, Path]) -> None:
    with kvformat.open(pair[0]) as a, kvformat.open(pair[1]) as b:
        for layer, head in ((0, 1), (1, 2)):
            wa, wb = a.attention(layer, head), b.attention(layer, head)
            exact = attention_difference(a, b, layer, head, rows=64, columns=64)
            assert exact["exact"] and exact["compared"] == 48
            tiles = np.array([[np.nan if v is None else v for v in row] for row in exact["tiles"]])
            delta = wb.weights - wa.weights
            visible = np.tril(np.ones((48, 48), bool))
            np.testing.assert_allclose(tiles[visible], delta[visible], atol=1e-6)
            assert np.isnan(tiles[~visible]).all()  # masked in both: no value
            assert exact["largest"] == pytest.approx(np.abs(delta).max(), abs=1e-6)
            # pooled: each tile the difference of largest magnitude among its cells, sign kept
            pooled = attention_difference(a, b, layer, head, rows=5, columns=7)
            q_step, k_step = pooled["step"]
            for i, row in enumerate(pooled["tiles"]):
                for j, value in enumerate(row):
                    cells = delta[i * q_step : (i + 1) * q_step, j * k_step : (j + 1) * k_step]
                    seen = visible[i * q_step : (i + 1) * q_step, j * k_step : (j + 1) * k_step]
                    if not seen.any():
                        assert value is None
                        continue
                    largest = cells[seen][np.argmax(np.abs(cells[seen]))]
                    assert value == pytest.approx(largest, abs=1e-6)
            # a zoom: the same spans as the map's own
            span = attention_difference(a, b, layer, head, queries=(20, 30), keys=(5, 25))
            assert span["queries"] == attention_map(a, layer, head, queries=(20, 30), keys=(5, 25))["queries"]
            got = np.array([[np.nan if v is None else v for v in row] for row in span["tiles"]])
            np.testing.assert_allclose(
                np.nan_to_num(got), np.where(visible, delta, 0)[20:30, 5:25], atol=1e-6
            )


def test_the_difference_refuses_files_that_do_not_match(pair: tuple[Path, Path], tmp_path: Path) -> None:
    other = tmp_path / "other.kv"
    spec = kvformat.LayerSpec(
        HEADS, DIM, DIM, kvformat.FLOAT32,
        queries=QuerySpec(num_heads=QUERY_HEADS, dim=DIM, dtype=kvformat.FLOAT32, scale=DIM**-0.5,
                          kv_heads=(0, 1, 0, 1)),
    )  # fmt: skip
    with kvformat.Writer(other, [spec, spec]) as writer:
        for layer in range(2):
            writer.append(layer, np.ones((HEADS, 4, DIM), np.float32), np.ones((HEADS, 4, DIM), np.float32))
            writer.append_queries(layer, np.ones((QUERY_HEADS, 4, DIM), np.float32), np.arange(4))
        writer.snapshot()
    with kvformat.open(pair[0]) as a, kvformat.open(other) as b:
        with pytest.raises(data.ViewerError, match="laid out differently"):
            attention_difference(a, b, 0, 1)
        with pytest.raises(data.ViewerError, match="no stored query"):
            attention_difference(a, a, 0, 0, queries=(100, 200))


def _pca_reference(q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AttentionViz's joint view computed here in float64 with an SVD: keys moved to the queries'
    mean, both scaled to one mean norm, the two principal axes of the joint set."""
    q, k = q.astype(np.float64), k.astype(np.float64)
    k = k - k.mean(axis=0) + q.mean(axis=0)
    scale = np.sqrt(np.linalg.norm(k, axis=1).mean() / np.linalg.norm(q, axis=1).mean())
    joint = np.concatenate([q * scale, k / scale])
    centred = joint - joint.mean(axis=0)
    _, singular, axes = np.linalg.svd(centred, full_matrices=False)
    points = centred @ axes[:2].T
    return points[: len(q)], points[len(q) :], singular**2 / (singular**2).sum()


def test_the_query_key_plane_is_attentionviz_s_joint_pca(pair: tuple[Path, Path]) -> None:
    with kvformat.open(pair[0]) as snap:
        found = snap.queries(1, 3)
        keys = snap.head(1, 1)
        assert found is not None and keys is not None
        view = qk_projection(snap, 1, 3)
        q_ref, k_ref, explained = _pca_reference(np.asarray(found.q), np.asarray(keys.k))
        got_q = np.stack([view["queries"]["x"], view["queries"]["y"]], axis=1)
        got_k = np.stack([view["keys"]["x"], view["keys"]["y"]], axis=1)
        signs = np.sign(np.sum(got_k * k_ref, axis=0))  # an axis's sign is a convention
        np.testing.assert_allclose(got_q, q_ref * signs, atol=2e-4)
        np.testing.assert_allclose(got_k, k_ref * signs, atol=2e-4)
        np.testing.assert_allclose(view["explained"], explained[:2], atol=1e-5)
        assert view["kv_head"] == 1 and view["step"] == [1, 1]
        assert view["keys"]["positions"] == keys.positions.tolist()
        # the normalisation leaves every query's softmax as it was
        q, k = np.asarray(found.q, np.float64), np.asarray(keys.k, np.float64)
        moved = (k - k.mean(axis=0) + q.mean(axis=0)) / view["scale"]
        logits, shifted = q @ k.T, (q * view["scale"]) @ moved.T
        assert np.allclose(logits - logits[:, :1], shifted - shifted[:, :1], atol=1e-9)
        # past the limit: every n-th key, the first four always
        few = qk_projection(snap, 1, 3, limit=10)
        assert few["step"] == [5, 5]
        assert few["keys"]["positions"][:5] == [0, 1, 2, 3, 5]
        assert len(few["queries"]["positions"]) == 10


def test_a_long_querys_row_holds_the_nearest_and_the_heaviest_keys(long_capture: Path) -> None:
    with kvformat.open(long_capture) as snap:
        found = snap.attention(0, 0, queries=(5999, 6000))
        row = query_row(snap, 0, 0, 5999)
        assert row["seen"] == 6000 and not row["complete"]
        assert len(row["keys"]) == data.MAX_ROW_KEYS
        keys = np.array(row["keys"])
        half = data.MAX_ROW_KEYS // 2
        assert keys[-half:].tolist() == list(range(6000 - half, 6000))  # the nearest half
        older = found.weights[0][: 6000 - half]
        heaviest = np.sort(np.argsort(older)[-half:])
        assert keys[:half].tolist() == heaviest.tolist()  # the heaviest of the others
        assert 3 in keys  # the planted needle
        np.testing.assert_allclose(row["weights"], found.weights[0][keys], atol=1e-7)
        short = query_row(snap, 0, 0, 40)
        assert short["complete"] and short["keys"] == list(range(41))


def test_a_long_heads_kv_view_keeps_each_runs_largest(long_capture: Path) -> None:
    with kvformat.open(long_capture) as snap:
        view = kv_view(snap, 1, 1)
        head = snap.head(1, 1)
        assert head is not None
        step = view["step"]
        assert step == 3 and len(view["positions"]) == 2000
        k, v = np.asarray(head.k), np.asarray(head.v)
        k_norm = np.linalg.norm(k, axis=1).reshape(-1, step).max(axis=1)
        v_norm = np.linalg.norm(v, axis=1).reshape(-1, step).max(axis=1)
        channel = int(np.argmax(np.abs(k).mean(axis=0)))
        values = k[:, channel].reshape(-1, step)
        signed = values[np.arange(values.shape[0]), np.abs(values).argmax(axis=1)]
        assert view["channel"] == channel
        np.testing.assert_allclose(view["k_norm"], k_norm, rtol=1e-5)
        np.testing.assert_allclose(view["v_norm"], v_norm, rtol=1e-5)
        np.testing.assert_allclose(view["k_channel"], signed, rtol=1e-5)
        assert view["positions"][:3] == [0, 3, 6]


@pytest.fixture
def served(pair: tuple[Path, Path]) -> Iterator[ViewerServer]:
    running = ViewerServer([Source(str(pair[0])), Source(str(pair[1]))])
    running.start()
    yield running
    running.close()


def _json(server: ViewerServer, path: str) -> Any:
    base = server.url.split("?")[0].rstrip("/")
    with urllib.request.urlopen(f"{base}{path}&token={server.token}", timeout=60) as answer:
        return json.loads(answer.read())


def test_tiles_sent_as_float32_bytes_are_the_json_tiles(served: ViewerServer) -> None:
    import base64

    for endpoint in ("map", "mapdiff"):
        query = f"/api/{endpoint}?file=0&other=1&layer=1&head=2&rows=20&columns=30"
        text, packed = _json(served, query), _json(served, query + "&encoding=f32")
        assert "tiles" not in packed and packed["shape"] == [len(text["tiles"]), len(text["tiles"][0])]
        values = np.frombuffer(base64.b64decode(packed["tiles_f32"]), "<f4").reshape(packed["shape"])
        expected = np.array([[np.nan if v is None else v for v in row] for row in text["tiles"]], np.float64)
        np.testing.assert_allclose(values, expected, atol=1e-7)  # NaN where a tile shows nothing
        assert {k: v for k, v in packed.items() if k not in ("tiles_f32", "shape")} == {
            k: v for k, v in text.items() if k != "tiles"
        }


def test_two_files_side_by_side_and_the_query_key_plane_in_a_browser(
    served: ViewerServer, pair: tuple[Path, Path]
) -> None:
    playwright, browser = _browser()
    try:
        page = browser.new_context(viewport={"width": 1400, "height": 1200}, bypass_csp=True).new_page()
        errors: list[str] = []
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(served.url)
        page.wait_for_function(
            "window.kvsnap && window.kvsnap.grid && window.kvsnap.mapDiff", timeout=120_000
        )
        page.evaluate("window.kvsnap.select(1, 2)")
        page.wait_for_function(
            "window.kvsnap.mapDiff && window.kvsnap.mapDiff.layer === 1 && window.kvsnap.mapDiff.head === 2 "
            "&& window.kvsnap.mapB.head === 2"
        )
        assert page.is_visible("#map-b") and page.is_visible("#map-diff")
        with kvformat.open(pair[0]) as a, kvformat.open(pair[1]) as b:
            wa, wb = a.attention(1, 2).weights, b.attention(1, 2).weights
        diff = np.array(page.evaluate("window.kvsnap.mapDiff.tiles"), dtype=float)
        visible = np.tril(np.ones((48, 48), bool))
        np.testing.assert_allclose(diff[visible], (wb - wa)[visible], atol=1e-6)
        other = np.array(page.evaluate("window.kvsnap.mapB.tiles"))
        np.testing.assert_allclose(np.clip(other, 0, None), wb, atol=1e-6)
        # a drag on the difference map zooms all three maps to the same span
        box = page.locator("#map-diff").bounding_box()
        assert box is not None
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.1, box["y"] + box["height"] * 0.9)
        page.mouse.up()
        page.wait_for_function(
            "window.kvsnap.span && window.kvsnap.mapDiff.keys[1] - window.kvsnap.mapDiff.keys[0] < 48"
        )
        page.wait_for_function(
            "JSON.stringify(window.kvsnap.mapDiff.keys) === JSON.stringify(window.kvsnap.map.keys) && "
            "JSON.stringify(window.kvsnap.mapB.keys) === JSON.stringify(window.kvsnap.map.keys)"
        )
        spans = page.evaluate(
            "[window.kvsnap.map.queries, window.kvsnap.map.keys, window.kvsnap.mapDiff.queries]"
        )
        assert spans[0] == spans[2] and spans[1][0] < spans[1][1] <= 48
        # the queries and keys of the head in one plane: every point drawn; a click on a query
        page.evaluate("window.kvsnap.showQk()")
        page.wait_for_function("window.kvsnap.qk && window.kvsnap.qkPoints && window.kvsnap.qk.head === 2")
        counts = page.evaluate("window.kvsnap.qkPoints.map((g) => g.xs.length)")
        assert counts == [48, 48]  # keys, queries
        assert "layer 1, query head 2, KV head 1" in page.text_content("#qk-what")
        x, y, position = page.evaluate(
            "(() => { const g = window.kvsnap.qkPoints[1]; return [g.xs[30], g.ys[30], g.positions[30]]; })()"
        )
        page.evaluate("window.kvsnap.row = null")
        page.locator("#qk").click(position={"x": x, "y": y})  # (the canvas is drawn at its own size)
        page.wait_for_function("window.kvsnap.row && window.kvsnap.row.query !== undefined")
        chosen = page.evaluate("window.kvsnap.row.query")
        points = page.evaluate("window.kvsnap.qkPoints[1]")
        xs, ys = np.array(points["xs"]), np.array(points["ys"])
        nearest = int(np.argmin((xs - x) ** 2 + (ys - y) ** 2))  # (another query may sit on it)
        assert chosen == points["positions"][nearest]
        assert chosen == position or np.hypot(xs[nearest] - x, ys[nearest] - y) < 1
        assert page.evaluate("window.kvsnap.query") == chosen
        assert not errors, errors
    finally:
        browser.close()
        playwright.stop()


def test_a_long_capture_s_token_view_stays_bounded(long_capture: Path) -> None:
    running = ViewerServer([Source(str(long_capture))])
    running.start()
    playwright, browser = _browser()
    try:
        page = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True).new_page()
        page.goto(running.url)
        page.wait_for_function(
            "window.kvsnap && window.kvsnap.row && window.kvsnap.row.query === 5999", timeout=120_000
        )
        page.wait_for_function("document.querySelectorAll('#tokens span').length > 0")
        spans = page.evaluate(
            "[...document.querySelectorAll('#tokens span')].map((s) => Number(s.dataset.position))"
        )
        gaps = page.evaluate("[...document.querySelectorAll('#tokens .gap')].map((s) => s.textContent)")
        row = page.evaluate("window.kvsnap.row.keys")
        assert spans == sorted(set(row) | {5999}) and len(spans) <= 4096  # the row's keys, no more
        assert 3 in spans and gaps and all("tokens" in gap for gap in gaps)
        hidden = 6000 - len(spans)
        assert sum(int(gap.split()[1]) for gap in gaps) == hidden  # every left-out token counted
    finally:
        browser.close()
        playwright.stop()
        running.close()
