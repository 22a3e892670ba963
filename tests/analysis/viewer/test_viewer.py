"""`kvsnap view`: the server's answers held to `snap.attention` (exact maps, max-pooled tiles, a
query's row, the mean over a layer's heads), its token (403 without), the files it serves (only
those named), the standalone page (its data escaped); then the page itself in a real browser
(Debian's Chromium driven by Playwright): no console error, the head grid, a head's map and the
token view equal to the file's weights, a prompt holding markup shown as text, and the ``--html``
page opened from disk showing the same map."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvsnap.analysis.attention.head_importance import attention_rows
from kvsnap.analysis.viewer.data import Source, attention_map
from kvsnap.analysis.viewer.page import write_html
from kvsnap.analysis.viewer.server import ViewerServer

HOSTILE = 'Say <script>alert("x")</script> and "><img src=x onerror=alert(1)> twice. The bridge, the bridge'
CHROMIUM = os.environ.get("KVSNAP_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A SmolLM2 capture of a prompt holding markup, every query kept."""
    from mlx_lm import load

    import kvsnap

    model, tokenizer = load(str(smollm2_dir))
    path = tmp_path_factory.mktemp("view") / "run.kv"
    for _ in kvsnap.generate(model, tokenizer, HOSTILE, max_tokens=6, output=path, queries="all"):
        pass
    return path


@pytest.fixture
def server(capture: Path) -> Iterator[ViewerServer]:
    running = ViewerServer([Source(str(capture))])
    running.start()
    yield running
    running.close()


def _get(server: ViewerServer, path: str, token: str | None = "") -> tuple[int, Any]:
    base = server.url.split("?")[0].rstrip("/")
    given = server.token if token == "" else token
    separator = "&" if "?" in path else "?"
    url = base + path + (f"{separator}token={given}" if given is not None else "")
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            body = answer.read()
            status = answer.status
    except urllib.error.HTTPError as error:
        body, status = error.read(), error.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode()


def test_the_token_guards_every_request_and_only_named_files_are_served(server: ViewerServer) -> None:
    assert server.server_address[0] == "127.0.0.1"
    assert _get(server, "/", token=None)[0] == 403
    assert _get(server, "/api/files", token="wrong")[0] == 403
    status, page = _get(server, "/")
    assert status == 200 and "kvsnap view" in page
    assert _get(server, "/api/map?file=1&layer=0&head=0") == (
        400,
        {"error": "file 1 is not one of the 1 files served"},
    )
    assert _get(server, "/../../etc/passwd")[0] == 404
    assert _get(server, "/api/files?path=/etc/passwd")[1][0]["name"].endswith("run.kv")


def test_maps_rows_and_grid_equal_the_files_attention(server: ViewerServer, capture: Path) -> None:
    with kvformat.open(capture) as snap:
        found = snap.attention(12, 4)
        status, exact = _get(server, "/api/map?file=0&layer=12&head=4")
        assert status == 200 and exact["exact"] and exact["refused"] == 0
        tiles = np.array(exact["tiles"])
        keys = found.key_positions
        assert tiles.shape == (found.query_positions.size, int(keys.max()) + 1)
        weights = tiles[:, keys]
        visible = weights >= 0
        np.testing.assert_allclose(np.where(visible, weights, 0), found.weights, atol=1e-6)
        assert np.all(found.weights[~visible] == 0)
        # pooled: each tile the largest weight of its cells (masked cells -1)
        pooled = attention_map(snap, 12, 4, rows=4, columns=5)
        q_step, k_step = pooled["step"]
        full = np.where(visible, weights, -1.0)
        for i, row in enumerate(pooled["tiles"]):
            for j, value in enumerate(row):
                block = full[i * q_step : (i + 1) * q_step, j * k_step : (j + 1) * k_step]
                assert value == pytest.approx(block.max(), abs=1e-6)
        query = int(found.query_positions[-1])
        status, row = _get(server, f"/api/row?file=0&layer=12&head=4&query={query}")
        np.testing.assert_allclose(row["weights"], found.weights[-1], atol=1e-6)
        spec = snap.layers[12].queries
        assert spec is not None
        mean = np.mean([snap.attention(12, h).weights[-1] for h in range(spec.num_heads)], axis=0)
        status, row = _get(server, f"/api/row?file=0&layer=12&head=-1&query={query}")
        np.testing.assert_allclose(row["weights"], mean, atol=1e-6)
    status, grid = _get(server, "/api/grid?file=0&score=sink_mass")
    rows = list(attention_rows(capture))
    top = max(rows, key=lambda r: r["sink_mass"])
    assert len(grid["layers"]) == 30 and all(len(layer) == 9 for layer in grid["layers"])
    assert grid["layers"][top["layer"]][top["head"]] == pytest.approx(top["sink_mass"])
    assert max(v for layer in grid["layers"] for v in layer) == pytest.approx(top["sink_mass"])


def test_the_standalone_page_escapes_what_the_file_holds(capture: Path, tmp_path: Path) -> None:
    out = tmp_path / "view.html"
    assert write_html([str(capture)], out, layers=[12], heads=[4]) == 1
    page = out.read_text("utf-8")
    assert "<script>alert" not in page and "onerror=alert" not in page.replace("\\u003e", "")
    data = page[page.index('id="kvsnap-data"') :]
    assert "\\u003c" in data and "script" in data  # the prompt's markup, as escaped data
    with pytest.raises(FileExistsError):
        write_html([str(capture)], out, layers=[12], heads=[4])


def test_the_command_writes_the_page_and_refuses_its_input(capture: Path, tmp_path: Path) -> None:
    from kvsnap.cli import main

    out = tmp_path / "page.html"
    assert main(["view", str(capture), "--html", str(out), "--layers", "12", "--heads", "4,5"]) == 0
    assert "window.kvsnap" in out.read_text("utf-8")
    assert main(["view", str(capture), "--html", str(out)]) == 2  # exists: --force replaces it
    assert main(["view", str(capture), "--html", str(capture), "--force"]) == 2  # never its input
    assert capture.stat().st_size > 0


def test_the_notebook_view_is_a_frame_of_a_served_viewer(
    capture: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a Jupyter kernel (IPython's shell there has a ``kernel``): an IFrame of a served
    viewer; anywhere else, one error naming the command to run instead."""
    import IPython

    import kvsnap
    from kvsnap.analysis.viewer.notebook import NotInNotebookError

    with pytest.raises(NotInNotebookError, match=f"'kvsnap view {capture}' serves it"):
        kvsnap.view(capture)  # a plain Python process: no kernel
    kernel_shell = type("KernelShell", (), {"kernel": object()})()
    monkeypatch.setattr(IPython, "get_ipython", lambda: kernel_shell)
    frame = kvsnap.view(capture)
    assert "token=" in frame.src and frame.src.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(frame.src, timeout=30) as answer:
        assert answer.status == 200 and "kvsnap view" in answer.read().decode()


# -- in a real browser ------------------------------------------------------------------------


def _browser() -> Any:
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), "make test installs Chromium (or set KVSNAP_CHROMIUM)"
    playwright = sync_playwright().start()
    browser = playwright.chromium.launch(
        executable_path=CHROMIUM,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
        ],
    )
    return playwright, browser


def test_the_page_in_a_browser(server: ViewerServer, capture: Path, tmp_path: Path) -> None:
    playwright, browser = _browser()
    try:
        # The test's own probes are evaluated scripts, which the page's policy forbids: only theirs
        # bypass it (the page's scripts run under it as served).
        context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
        page = context.new_page()
        errors: list[str] = []
        dialogs: list[str] = []
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        refused = context.new_page()
        assert refused.goto(server.url.split("?")[0]).status == 403
        refused.close()
        page.goto(server.url)
        page.wait_for_function("window.kvsnap && window.kvsnap.grid && window.kvsnap.row", timeout=120_000)
        grid = page.evaluate("window.kvsnap.grid.layers")
        assert len(grid) == 30 and all(len(layer) == 9 for layer in grid)
        # click layer 12, head 4 in the grid: its map is drawn, equal to the file's weights
        cell = int(page.get_attribute("#grid", "data-cell"))
        left, top = (int(page.get_attribute("#grid", f"data-{side}")) for side in ("left", "top"))
        assert left > 0 and top > 0  # margins hold the layer and head numbers
        # the legend below the cells spans the grid's values, lowest to highest
        low, high = (float(page.get_attribute("#grid", f"data-{end}")) for end in ("low", "high"))
        values = [v for layer in grid for v in layer if v is not None]
        assert low == pytest.approx(min(values)) and high == pytest.approx(max(values))
        page.click("#grid", position={"x": left + 4 * cell + cell / 2, "y": top + 12 * cell + cell / 2})
        page.wait_for_function(
            "window.kvsnap.map && window.kvsnap.map.layer === 12 && window.kvsnap.map.head === 4"
        )
        tiles = np.array(page.evaluate("window.kvsnap.map.tiles"))
        page.wait_for_function("window.kvsnap.row && window.kvsnap.row.layer === 12")
        shading = page.evaluate(
            "[...document.querySelectorAll('#tokens span')].map(s => [Number(s.dataset.position), "
            "s.dataset.weight === undefined ? null : Number(s.dataset.weight)])"
        )
        texts = page.evaluate(
            "[...document.querySelectorAll('#tokens span')].map(s => s.textContent).join('')"
        )
        with kvformat.open(capture) as snap:
            found = snap.attention(12, 4)
        keys = found.key_positions
        np.testing.assert_allclose(np.clip(tiles[:, keys], 0, None), found.weights, atol=1e-6)
        weights = {p: w for p, w in shading if w is not None}
        np.testing.assert_allclose([weights[int(k)] for k in keys], found.weights[-1], atol=1e-6)
        assert "<script>" in texts and "onerror" in texts  # shown as text
        assert page.evaluate("document.querySelectorAll('img').length") == 0
        assert not dialogs and not errors, (dialogs, errors)
        # the standalone page, from disk, shows the same map
        out = tmp_path / "view.html"
        write_html([str(capture)], out, layers=[12], heads=[4])
        standalone = context.new_page()
        standalone.on("pageerror", lambda error: errors.append(str(error)))
        standalone.goto(out.as_uri())
        standalone.wait_for_function("window.kvsnap && window.kvsnap.map", timeout=60_000)
        same = np.array(standalone.evaluate("window.kvsnap.map.tiles"))
        np.testing.assert_allclose(same, tiles, atol=1e-7)
        assert not errors, errors
    finally:
        browser.close()
        playwright.stop()


# -- hostile requests ---------------------------------------------------------------------------


def _raw(server: ViewerServer, path: str, host: str | None = None) -> tuple[int, bytes]:
    """GET ``path`` with the Host header ``host`` (default: the server's own address)."""
    import http.client

    address, port = str(server.server_address[0]), int(server.server_address[1])
    connection = http.client.HTTPConnection(address, port, timeout=60)
    try:
        connection.putrequest("GET", path, skip_host=True)
        connection.putheader("Host", host if host is not None else f"{address}:{port}")
        connection.endheaders()
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def test_the_host_header_must_name_this_server(server: ViewerServer) -> None:
    """A page of another origin whose name was rebound to 127.0.0.1 sends its own name as Host:
    refused, token or not; loopback names are served."""
    port = int(server.server_address[1])
    path = f"/api/files?token={server.token}"
    assert _raw(server, path)[0] == 200
    assert _raw(server, path, f"localhost:{port}")[0] == 200
    for host in (
        f"evil.example:{port}",
        "127.0.0.1",
        f"127.0.0.1:{port + 1}",
        f"localhost.evil.example:{port}",
    ):
        status, body = _raw(server, path, host)
        assert status == 403 and b"Host header" in body, host


ENDPOINTS = ["files", "grid", "diff", "map", "mapdiff", "row", "kept", "kv", "qk", "nothing"]
PARAMETERS = [
    "file",
    "other",
    "layer",
    "head",
    "query",
    "q0",
    "q1",
    "k0",
    "k1",
    "rows",
    "columns",
    "score",
    "method",
    "budget",
    "encoding",
    "points",
]


def test_every_endpoint_answers_arbitrary_parameters_with_a_4xx_at_worst(server: ViewerServer) -> None:
    """Hypothesis drives every endpoint with arbitrary parameters (huge and negative integers,
    floats, text, empty values): every request gets an answer, 200 or a 4xx with one JSON line,
    never a 500 nor silence, and the server lives on."""
    import urllib.parse

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    values = st.one_of(
        st.integers(-(10**30), 10**30).map(str),
        st.integers(-3, 40).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(str),
        st.text(max_size=12),
        st.sampled_from(["", "-", "1e9", "0x10", "1_0", " 1", "9" * 40, "sink_mass", "snapkv", "nan"]),
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.sampled_from(ENDPOINTS), st.dictionaries(st.sampled_from(PARAMETERS), values, max_size=6))
    def request(endpoint: str, params: dict[str, str]) -> None:
        query = urllib.parse.urlencode({**params, "token": server.token})
        status, body = _raw(server, f"/api/{endpoint}?{query}")
        assert status == 200 or 400 <= status < 500, (endpoint, params, status, body[:300])
        if status != 200:
            answer = json.loads(body)
            assert "\n" not in answer["error"], answer

    request()
    assert _raw(server, f"/api/files?token={server.token}")[0] == 200  # still serving


def test_a_map_request_is_bounded_before_any_work(server: ViewerServer) -> None:
    """The requests that once reached numpy: a key range of -10^18 (a 24 GB array), 10^30 (an
    OverflowError), a 16-digit tile count: each a 400 naming the parameter, at once."""
    token = server.token
    for params, named in (
        ("k0=-1000000000000000000", "k0"),
        ("k0=" + "1" + "0" * 30, "k0"),
        ("k0=-1000000000", "k0"),
        ("rows=9999999999999999", "rows"),
        ("q0=5&q1=5", "q0"),
        ("layer=99999", "layer"),
    ):
        where = "" if params.startswith("layer") else "layer=1&"
        status, body = _raw(server, f"/api/map?file=0&{where}head=1&{params}&token={token}")
        assert status == 400 and named in json.loads(body)["error"], (params, body)


# -- the answer to the last request -------------------------------------------------------------


def test_the_page_shows_the_answer_to_the_last_request(
    capture: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers slowed on purpose where a race would show a stale picture: head (1, 5)'s map, the
    mean row, and head (3, 2)'s whole map. Selecting (1, 5) then (2, 7) at once shows (2, 7);
    ticking then unticking "mean" shows the head's own row; a zoom made while the whole map loads
    stays. Each checked after the slow answer would have arrived."""
    import time

    from kvsnap.analysis.viewer import data

    slow = 1.5
    original_map, original_row = data.attention_map, data.query_row

    def attention_map(snap: Any, layer: int, head: int, **options: Any) -> Any:
        if (layer, head) == (1, 5) or ((layer, head) == (3, 2) and options.get("keys") is None):
            time.sleep(slow)
        return original_map(snap, layer, head, **options)

    def query_row(snap: Any, layer: int, head: int, position: int) -> Any:
        if head == -1:
            time.sleep(slow)
        return original_row(snap, layer, head, position)

    monkeypatch.setattr(data, "attention_map", attention_map)
    monkeypatch.setattr(data, "query_row", query_row)
    running = ViewerServer([Source(str(capture))])
    running.start()
    playwright, browser = _browser()
    try:
        page = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True).new_page()
        page.goto(running.url)
        page.wait_for_function("window.kvsnap && window.kvsnap.map && window.kvsnap.row", timeout=120_000)

        def settled() -> None:
            page.wait_for_timeout(int((slow + 1.0) * 1000))

        # two heads selected back to back
        page.evaluate("() => { window.kvsnap.select(1, 5); window.kvsnap.select(2, 7); }")
        settled()
        shown = page.evaluate("[window.kvsnap.map.layer, window.kvsnap.map.head]")
        drawn = page.evaluate(
            "[document.querySelector('#map').dataset.layer, document.querySelector('#map').dataset.head]"
        )
        assert shown == [2, 7] and drawn == ["2", "7"]
        assert "layer 2, query head 7" in page.text_content("#map-title")
        # mean ticked, then unticked before its (slow) row came
        page.click("#mean")
        page.click("#mean")
        settled()
        assert page.evaluate("window.kvsnap.row.head") == 7 and not page.is_checked("#mean")
        # a zoom while the whole map loads
        page.evaluate("() => { window.kvsnap.select(3, 2); }")
        page.wait_for_timeout(200)
        page.evaluate("() => window.kvsnap.zoom({q0: 10, q1: 20, k0: 0, k1: 12})")
        settled()
        assert page.evaluate("[window.kvsnap.map.layer, window.kvsnap.map.head, window.kvsnap.map.keys]") == [
            3,
            2,
            [0, 12],
        ]
    finally:
        browser.close()
        playwright.stop()
        running.close()
