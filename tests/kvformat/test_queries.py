"""Queries in the file: stored, inherited by later snapshots, refused by a
1.2 reader, and attention recomputed from the file equal to what the model's own attention kernel
returned (hooked here), for SmolLM2 (GQA 9:3), Gemma-3 (sliding and global layers, its own query
scale), a rotating cache (``max_kv_size``) and a quantized KV cache (``kv_bits``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvformat
from kvformat import attention
from kvformat.manifest import QuerySpec
from kvformat.rewrite import rebuild_index
from kvsnap.capture.queries import QuerySelection

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
    with kvformat.open(bad) as snap, pytest.raises(kvformat.CorruptFileError, match="not a Q chunk"):
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


def test_query_selection_parses_the_cli_forms() -> None:
    assert QuerySelection.parse("none").enabled is False
    assert QuerySelection.parse("window:64").first_position(100) == 36
    assert QuerySelection.parse("decode").first_position(100) == 100
    assert QuerySelection.parse("all").first_position(100) == 0
    for bad in ("window", "window:0", "some", "all:3"):
        with pytest.raises(ValueError, match="--queries"):
            QuerySelection.parse(bad)


# -- held to the model ------------------------------------------------------------------------


class _Outputs:
    """What the attention kernel returned, per call: mx.fast's and the quantized kernel's outputs
    in call order (each forward calls layer 0, 1, ... in turn)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from mlx_lm.models import base

        self.calls: list[Any] = []
        fast, quantized = mx.fast.scaled_dot_product_attention, base.quantized_scaled_dot_product_attention

        def record(function: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                out = function(*args, **kwargs)
                # Kept as the output array itself (evaluated with the step; no copy that would
                # synchronise each layer) and read on the host after generation.
                self.calls.append(out)
                return out

            return wrapper

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", record(fast))
        monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", record(quantized))

    def by_position(self, layers: int, prompt: int) -> dict[tuple[int, int], np.ndarray]:
        """``(layer, position) -> (query heads, v_dim)``: the prefill is one call per layer, then
        one call per layer per generated token."""
        found: dict[tuple[int, int], np.ndarray] = {}
        position = 0
        calls = [np.array(out.astype(mx.float32)) for out in self.calls]
        for call in range(0, len(calls), layers):
            step = calls[call : call + layers]
            count = step[0].shape[2]
            for layer, out in enumerate(step):
                for i in range(count):
                    found[(layer, position + i)] = out[0, :, i]
            position += count
        assert position >= prompt
        return found


CASES = {
    "smollm2": ("smollm2_dir", {}),
    "gemma3": ("gemma3_dir", {}),
    "rotating": ("smollm2_dir", {"max_kv_size": 24}),
    "quantized": ("smollm2_dir", {"kv_bits": 8, "quantized_kv_start": 0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_from_the_file_equals_the_models(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from mlx_lm import load

    import kvsnap

    fixture, options = CASES[case]
    model, tokenizer = load(str(request.getfixturevalue(fixture)))
    prompt = tokenizer.encode("The history of the city begins when a small settlement grew up by a bridge")
    path = tmp_path / "run.kv"
    plain = [r.token for r in kvsnap.generate(model, tokenizer, prompt, max_tokens=14, **options)]
    outputs = _Outputs(monkeypatch)
    tokens = [
        r.token
        for r in kvsnap.generate(
            model, tokenizer, prompt, max_tokens=14, output=path, every=1, queries="window:6", **options
        )
    ]
    assert tokens == plain  # capturing queries changes nothing
    layers = len(model.layers)
    kernel = outputs.by_position(layers, len(prompt))
    errors: list[float] = []
    with kvformat.open(path) as series:
        assert series.metadata["queries"] == "window:6"
        if case == "gemma3":
            windows = {series.layers[i].queries.window for i in range(layers)}  # type: ignore[union-attr]
            assert windows == {512, None}  # sliding and global layers
            assert series.layers[0].queries.scale == pytest.approx(256**-0.5)  # type: ignore[union-attr]
        done = 0
        for index in range(series.num_snapshots):
            snap = series.select(index)
            for layer in range(layers):
                spec = snap.layers[layer].queries
                assert spec is not None
                found = snap.queries(layer, 0)
                assert found is not None
                fresh = found.positions[found.positions >= done]  # the queries this snapshot added
                if not fresh.size:
                    continue
                for head in range(spec.num_heads):
                    output, positions = snap.attention_output(
                        layer, head, queries=(int(fresh[0]), int(fresh[-1]) + 1)
                    )
                    for row, position in enumerate(positions.tolist()):
                        expected = kernel[(layer, position)][head]
                        error = float(
                            np.linalg.norm(output[row] - expected) / max(np.linalg.norm(expected), 1e-6)
                        )
                        errors.append(error)
            done = int(snap.queries(0, 0).positions[-1]) + 1  # type: ignore[union-attr]
        assert done == len(prompt) + 14  # every query of the run, the last generated token's too
    worst, median = max(errors), float(np.median(errors))
    print(
        f"{case}: relative error of the recomputed attention output: median {median:.2e}, worst {worst:.2e}"
    )
    # float16 queries, keys and values against the kernel's float16 output; the quantized kernel
    # also rounds its scores to float16 before the softmax (mlx-lm's quantized attention)
    assert worst < (1e-1 if case == "quantized" else 2e-2) and median < (
        1e-2 if case == "quantized" else 2e-3
    )


WINDOWED = {
    "rotating-every-20": ("smollm2_dir", {"max_kv_size": 24}, 20, 56, 1),
    "rotating-every-8": ("smollm2_dir", {"max_kv_size": 24}, 8, 56, 1),
    "gemma3-sliding-512": ("gemma3_dir", {}, 3, 6, 34),
}


def _held_to_kernel(
    snap: kvformat.Snapshot, layer: int, heads: int, run: list[int], kernel: dict[tuple[int, int], np.ndarray]
) -> list[float]:
    """The relative error of each head's recomputed output against the kernel's, for the
    consecutive query positions ``run`` (one `attention_output` call per head)."""
    errors: list[float] = []
    if not run:
        return errors
    for head in range(heads):
        output, positions = snap.attention_output(layer, head, queries=(run[0], run[-1] + 1))
        assert positions.tolist() == run
        for row, position in enumerate(run):
            expected = kernel[(layer, position)][head]
            errors.append(float(np.linalg.norm(output[row] - expected) / max(np.linalg.norm(expected), 1e-6)))
    return errors


@pytest.mark.parametrize("case", list(WINDOWED))
def test_windowed_attention_is_the_models_at_every_stored_query(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Every query every snapshot stores, recomputed over the keys it saw (those dropped since
    taken from earlier snapshots), against the kernel's output for it; a query whose keys no
    snapshot holds is refused, never renormalised over fewer keys."""
    from mlx_lm import load

    import kvsnap

    fixture, options, every, max_tokens, repeat = WINDOWED[case]
    model, tokenizer = load(str(request.getfixturevalue(fixture)))
    text = "The history of the city begins when a small settlement grew up by a bridge. "
    prompt = tokenizer.encode((text * repeat).strip())  # SmolLM2: 15 tokens, 23 at the first every-8 snapshot
    if case.startswith("gemma3"):
        assert len(prompt) > 512  # past the sliding layers' window
    path = tmp_path / "run.kv"
    outputs = _Outputs(monkeypatch)
    for _ in kvsnap.generate(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        output=path,
        every=every,
        queries="window:16",
        **options,
    ):
        pass
    layers = len(model.layers)
    kernel = outputs.by_position(layers, len(prompt))
    errors: list[float] = []
    refused = checked = lost = 0
    with kvformat.open(path) as series:
        assert series.num_snapshots >= 2
        ever = {  # every key position some snapshot holds, per layer (an oracle apart from the reader's)
            layer: set().union(
                *(series.select(i).positions(layer, 0).tolist() for i in range(series.num_snapshots))
            )  # type: ignore[union-attr]
            for layer in range(layers)
        }
        windowed = [i for i in range(layers) if series.layers[i].queries.window is not None]  # type: ignore[union-attr]
        assert windowed
        for index in range(series.num_snapshots):
            snap = series.select(index)
            for layer in windowed:
                spec = snap.layers[layer].queries
                assert spec is not None
                stored = snap.queries(layer, 0)
                assert stored is not None
                keys = attention.context_keys(snap, layer, spec.kv_heads[0], 0, stored.positions)
                run: list[int] = []  # consecutive complete queries: recomputed in one call per head
                for position, complete in zip(stored.positions.tolist(), keys.complete.tolist(), strict=True):
                    seen = attention.visible(spec, np.array([position]), np.arange(position + 1))[0]
                    lost += int(not set(np.flatnonzero(seen).tolist()) <= ever[layer])
                    if complete and (not run or position == run[-1] + 1):
                        run.append(position)
                        continue
                    checked += len(run)
                    errors += _held_to_kernel(snap, layer, spec.num_heads, run, kernel)
                    run = [position] if complete else []
                    if not complete:
                        with pytest.raises(kvformat.MissingKeysError, match=f"positions {position}"):
                            snap.attention_output(layer, 0, queries=(position, position + 1))
                        refused += 1
                checked += len(run)
                errors += _held_to_kernel(snap, layer, spec.num_heads, run, kernel)
    worst, median = max(errors), float(np.median(errors))
    print(
        f"{case}: {checked} queries held to the kernel, {refused} refused; "
        f"median {median:.2e}, worst {worst:.2e}"
    )
    assert refused == lost  # refused exactly where a key the query saw is in no snapshot
    if every == 20:  # the window (24 keys, 4 kept) moves 20 positions between snapshots: keys are lost
        assert refused > 0
    if every == 8:  # it moves 8: every key a query saw is in some snapshot
        assert refused == 0
    assert checked > 0 and median < 1e-3 and worst < 5e-3  # float16 kernel outputs against float32


# -- the command line ---------------------------------------------------------------------------


def test_attention_command_and_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import polars as pl

    from kvsnap.cli import main

    spec = _spec(window=8)
    data = _write(tmp_path / "q.kv", spec)
    assert spec.queries is not None
    out = tmp_path / "att.npz"
    assert main(["attention", str(tmp_path / "q.kv"), "--layer", "0", "--head", "2", "-o", str(out)]) == 0
    assert f"wrote {out}: layer 0 query head 2, 20 queries x 40 keys" in capsys.readouterr().out
    with np.load(out) as saved:
        expected = _reference(data, spec.queries, 2, saved["query_positions"])
        np.testing.assert_allclose(saved["weights"], expected, rtol=1e-5, atol=1e-6)
    table = tmp_path / "att.parquet"
    args = ["attention", str(tmp_path / "q.kv"), "--layer", "0", "--head", "2", "--queries", "30:32"]
    assert main([*args, "-o", str(table)]) == 0
    long = pl.read_parquet(table)
    assert set(long["query_position"].to_list()) == {30, 31} and long.height == 2 * 8  # the window
    assert main([*args, "-o", str(table)]) == 2  # exists
    png = tmp_path / "map.png"
    assert main(["plot", str(tmp_path / "q.kv"), "--attention", "0:3", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        main(["attention", str(tmp_path / "q.kv"), "--layer", "0", "--head", "9", "-o", str(out), "--force"])
        == 2
    )
    with pytest.raises(SystemExit) as refused:  # argparse: usage and exit status 2
        main(
            [
                "attention",
                str(tmp_path / "q.kv"),
                "--layer",
                "0",
                "--head",
                "0",
                "--queries",
                "9:3",
                "-o",
                "x",
            ]
        )
    assert refused.value.code == 2


def test_selections_and_indices_outside_the_file_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layer out of range, or a query or key range that selects nothing the file stores: one
    line naming what the file holds, exit 2, nothing written; `OutOfRangeError` from Python."""
    from kvsnap.cli import main

    path = tmp_path / "q.kv"
    _write(path, _spec(window=8))
    capsys.readouterr()
    out = tmp_path / "att.npz"
    cases = {
        ("--layer", "5", "--head", "0"): "layer 5 out of range 0..1",
        ("--layer", "0", "--head", "0", "--queries", "100:200"): "--queries 100:200 selects none of the "
        "queries layer 0 stores for query head 0 (positions 20..39)",
        ("--layer", "0", "--head", "0", "--keys", "50:60"): "--keys 50:60 selects none of the keys",
    }
    for options, message in cases.items():
        assert main(["attention", str(path), *options, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not out.exists()
    assert main(["plot", str(path), "--attention", "7:0", "-o", str(tmp_path / "m.png")]) == 2
    assert "layer 7 out of range 0..1" in capsys.readouterr().err
    with kvformat.open(path) as snap, pytest.raises(kvformat.OutOfRangeError, match="layer 7 out of range"):
        snap.attention(7, 0)
    with pytest.raises(SystemExit):
        main(["stats", str(path), "--stats", "atention"])
    assert "choose from all, norms, channels, rope, spectrum, quant, attention" in capsys.readouterr().err
    assert main(["outliers", str(path), "--stat", "sink_mass", "--threshold", "1.0"]) == 0
    assert "query heads with sink_mass above 1.0x" in capsys.readouterr().out
    assert main(["stats", str(path), "--needle", "0:4"]) == 2
    assert "--needle scores attention: use it with --stats attention" in capsys.readouterr().err


def test_query_join_falls_back_where_the_gather_kernel_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`capture.gather.join` with the kernel asked for where it cannot run (this CPU build has no
    CUDA): each shape is tried once, found unusable, and joined by ``mx.concatenate``, so a capture
    never fails on it; runs longer than one launch and other pieces between them keep their order."""
    from kvsnap.capture import gather

    monkeypatch.setattr(gather, "_WORKS", {})
    window = mx.random.normal((1, 3, 5, 8))
    singles = [mx.random.normal((1, 3, 1, 8)) for _ in range(150)]
    for parts in ([window, *singles], singles[:3], [*singles[:70], window, *singles[70:]]):
        joined = gather.join(parts, gather=True)
        assert bool(mx.array_equal(joined, mx.concatenate(parts, axis=2)).item())
    assert dict(gather._WORKS) == {(mx.float32, 3, 8): False}
    assert gather.join([window]) is window


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
                logits = spec.scale * (head.k[seen].astype(np.float64) @ found.q[row].astype(np.float64))
                expected = np.exp(logits - logits.max())
                expected /= expected.sum()
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
