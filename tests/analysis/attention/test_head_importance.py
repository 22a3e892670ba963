"""Head importance from saved attention: every score of `--stats attention` equals a
direct numpy computation from the attention weights written out in float64 from the definition
(SPEC 10.1), and `simulate`'s errors equal recomputing attention with the evicted keys removed.
On a synthetic file (GQA 4:2, a sliding window and sinks) and on a real SmolLM2 capture."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvformat.manifest import QuerySpec
from kvsnap.analysis.attention import compression as simulate
from kvsnap.analysis.attention import head_importance
from kvsnap.analysis.kernels import attention as attention_kernel
from kvsnap.analysis.kernels import native
from kvsnap.analysis.stats.catalogue import POSITION_BINS, position_bins
from tests.conftest import kept_arrays, kept_capture

POSITIONS = 48
PROMPT = 36  # positions 0..35 are the prompt; queries at 24..47


def _write(path: Path, spec: QuerySpec, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, POSITIONS, 8)).astype(np.float32)
    k[:, 0] *= 6.0  # a strong first key: an attention sink
    v = rng.standard_normal((2, POSITIONS, 8)).astype(np.float32)
    q = rng.standard_normal((4, POSITIONS, 8)).astype(np.float32)
    q[0] = k[0, 0] / 2  # query head 0 looks at its first key: a sink head
    tokens = rng.integers(0, 6, POSITIONS).tolist()  # a small vocabulary: many copies
    layer = kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT32, queries=spec)
    with kvformat.Writer(path, [layer], metadata={"prompt_tokens": PROMPT}) as writer:
        writer.append(0, k, v)
        writer.append_queries(0, q[:, 24:], np.arange(24, POSITIONS))
        writer.snapshot(metadata={"tokens": [tokens]})
    return {"k": k, "v": v, "q": q, "tokens": tokens}


def _weights(
    data: dict[str, Any], spec: QuerySpec, head: int, positions: np.ndarray, keys: np.ndarray
) -> np.ndarray:
    """Softmax weights in float64 from the definition, over the keys at ``keys`` only."""
    q = data["q"][head, positions].astype(np.float64)
    k = data["k"][spec.kv_heads[head], keys].astype(np.float64)
    logits = spec.scale * q @ k.T
    p, j = positions[:, None], keys[None, :]
    mask = j <= p
    if spec.window is not None:
        mask &= (p - j < spec.window - spec.keep) | (j < spec.keep)
    logits = np.where(mask, logits, -np.inf)
    top = logits.max(axis=1, keepdims=True)
    if spec.sinks is not None:
        top = np.maximum(top, spec.sinks[head])
    e = np.exp(logits - top)
    total = e.sum(axis=1, keepdims=True)
    if spec.sinks is not None:
        total = total + np.exp(spec.sinks[head] - top)
    return e / total


SPECS = {
    "causal": QuerySpec(num_heads=4, dim=8, dtype=kvformat.FLOAT32, scale=8**-0.5, kv_heads=(0, 0, 1, 1)),
    "window-sinks": QuerySpec(
        num_heads=4,
        dim=8,
        dtype=kvformat.FLOAT32,
        scale=8**-0.5,
        kv_heads=(0, 0, 1, 1),
        window=20,
        sinks=(0.5, -1.0, 2.0, 0.0),
    ),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_every_score_equals_the_definition(tmp_path: Path, name: str) -> None:
    spec = SPECS[name]
    data = _write(tmp_path / "a.kv", spec)
    rows = list(head_importance.attention_rows(tmp_path / "a.kv", window=8, needle=(0, 30), retrieval="all"))
    scoped = list(head_importance.attention_rows(tmp_path / "a.kv", window=8, needle=(0, 30)))
    with pytest.raises(ValueError, match="--needle 0:999 is not inside"):
        list(head_importance.attention_rows(tmp_path / "a.kv", needle=(0, 999), retrieval="all"))
    assert [(r["layer"], r["head"], r["kv_head"]) for r in rows] == [
        (0, h, spec.kv_heads[h]) for h in range(4)
    ]
    positions, keys = np.arange(24, POSITIONS), np.arange(POSITIONS)
    tokens = np.array(data["tokens"])
    for row in rows:
        w = _weights(data, spec, row["head"], positions, keys)
        seen = w > 0
        back = positions[:, None] - keys[None, :]
        assert row["n_queries"] == len(positions)
        assert row["sink_mass"] == pytest.approx(w[:, :4].sum(axis=1).mean(), rel=1e-5)
        local = w * (back < 64) * seen * (keys >= 4)  # sinks excluded: local and sink never overlap
        assert row["local_mass"] == pytest.approx(local.sum(axis=1).mean(), rel=1e-5)
        entropy = -(np.where(seen, w * np.log(np.where(seen, w, 1)), 0)).sum(axis=1)
        assert row["entropy"] == pytest.approx(entropy.mean(), rel=1e-4, abs=1e-5)
        assert row["entropy_normalized"] == pytest.approx(
            (entropy / np.log(seen.sum(axis=1))).mean(), rel=1e-4, abs=1e-5
        )
        assert row["mean_distance"] == pytest.approx((w * back).sum(axis=1).mean(), rel=1e-4)
        top = keys[np.argmax(w, axis=1)]
        expected_hist = np.bincount(position_bins(top), minlength=POSITION_BINS)
        assert row["top1_position_histogram"] == expected_hist.tolist()
        # Retrieval (Wu et al. 2024) within the needle [0, 30): the query at p produces token p + 1;
        # by default only generated tokens count (from the prompt's last query on).
        for scope, first in ((row, 0), (scoped[rows.index(row)], PROMPT - 1)):
            events = hits = 0
            for i, p in enumerate(positions.tolist()):
                if p < first or p + 1 >= POSITIONS or tokens[p + 1] not in tokens[0 : min(30, p + 1)]:
                    continue
                events += 1
                hits += int(top[i] < 30 and tokens[top[i]] == tokens[p + 1])
            assert scope["retrieval_events"] == events
            assert (
                scope["retrieval_score"] == pytest.approx(hits / events)
                if events
                else math.isnan(scope["retrieval_score"])
            )
        assert row["retrieval_events"] > scoped[rows.index(row)]["retrieval_events"]
        # Streaming: sinks + the last 8 positions, renormalized (a layer's own sinks keep their share).
        v = data["v"][spec.kv_heads[row["head"]]].astype(np.float64)
        keep = (keys[None, :] < 4) | (back < 8)
        full = w @ v
        kept = w * keep
        streamed = (kept @ v) / (kept.sum(axis=1) + (1 - w.sum(axis=1)))[:, None]
        error = np.sqrt(((streamed - full) ** 2).sum() / (full**2).sum())
        assert row["streaming_error"] == pytest.approx(error, rel=1e-4, abs=1e-5)
    if spec.window is None:  # query head 0 points at key 0; a 20-position window no longer sees it
        assert rows[0]["sink_mass"] > 0.9 > max(r["sink_mass"] for r in rows[1:])
    else:
        assert all(r["sink_mass"] == 0 for r in rows)


def test_simulate_equals_attention_with_the_evicted_keys_removed(tmp_path: Path) -> None:
    spec = SPECS["window-sinks"]
    data = _write(tmp_path / "a.kv", spec)
    with pytest.warns(simulate.CompressionWarning, match="observed and expected_attention left out"):
        table = simulate.simulate(tmp_path / "a.kv", budgets=(0.1, 0.25, 1.0), window=6)
    # observed and expected_attention need every query
    assert set(table["method"].to_list()) == set(simulate.METHODS) - {"observed", "expected_attention"}
    full_budget = table.filter(table["budget"] == 1.0)
    evictions = len(simulate.EVICTION) - 2
    assert (
        full_budget.height == evictions * 4 and (full_budget["relative_error"] == 0).all()
    )  # every key kept
    assert (full_budget["top1_agreement"] == 1).all()
    evicting = full_budget.filter(full_budget["method"].is_in(list(simulate.EVICTION)))
    assert (evicting["keys_evicted"] == 0).all()  # nothing evicted: exact by construction
    quarter = table.filter((table["budget"] == 0.25) & table["method"].is_in(list(simulate.EVICTION)))
    shared = quarter.filter(quarter["method"] == "adakv")  # a layer's budget shared among its KV heads
    assert (quarter.filter(quarter["method"] != "adakv")["keys_evicted"] == PROMPT - 9).all()  # 25% of 36
    per_kv_head = {(r["kv_head"], r["keys_evicted"]) for r in shared.iter_rows(named=True)}
    assert len(per_kv_head) == 2 and sum(PROMPT - evicted for _, evicted in per_kv_head) == 2 * 9
    quantized = table.filter(~table["method"].is_in(list(simulate.EVICTION)))
    assert quantized["keys_evicted"].null_count() == quantized.height == 4 * 4  # 4 methods x 4 heads
    decode = np.arange(PROMPT, POSITIONS)
    keys = np.arange(POSITIONS)
    with kvformat.open(tmp_path / "a.kv") as snap:
        scores = {}
        for kv_head in (0, 1):
            heads = [h for h in range(4) if spec.kv_heads[h] == kv_head]
            prompt_queries = np.arange(24, PROMPT)
            together = sum(_weights(data, spec, h, prompt_queries, keys) for h in heads)
            # SnapKV as kvpress: the window's mean per head, a zero-padded mean over 5 keys, the
            # group's mean; keys of the window are kept whatever their score
            before = keys < PROMPT - 6
            pooled = [
                np.convolve(_weights(data, spec, h, np.arange(PROMPT - 6, PROMPT), keys)[:, before].mean(0),
                            np.ones(5) / 5, mode="same")
                for h in heads
            ]  # fmt: skip
            snapkv = np.full(POSITIONS, np.nan)
            snapkv[before] = np.mean(pooled, axis=0)
            scores[kv_head] = {
                "h2o": together.sum(axis=0),
                "snapkv": snapkv,
                **_kvpress_scores(data, spec, kv_head),
            }
        # (a quarter's sums are a tenth's plus the keys it adds, where the tenth's are a subset)
        for row in table.filter(table["budget"] < 1).iter_rows(named=True):
            head, budget = row["head"], row["budget"]
            if row["method"] not in simulate.EVICTION or row["method"] == "adakv":
                continue  # checked by the budget-1 rows and its counts
            rng = simulate.head_rng(0, row["layer"], head, budget)  # random's own draws here
            keep = simulate.kept_keys(
                row["method"], budget, keys, PROMPT, scores[spec.kv_heads[head]], rng, 6
            )
            assert keep[PROMPT:].all() and keep[:PROMPT].sum() == PROMPT - row["keys_evicted"]
            assert budget == 0.1 or keep[:PROMPT].sum() == 9  # 25% of 36 prompt keys
            if row["method"] == "streaming" and budget == 0.25:
                assert keep[:4].all() and keep[PROMPT - 5 : PROMPT].all() and not keep[4 : PROMPT - 5].any()
            v = data["v"][spec.kv_heads[head]].astype(np.float64)
            full = _weights(data, spec, head, decode, keys) @ v
            kept = np.flatnonzero(keep)
            compressed = _weights(data, spec, head, decode, kept) @ v[kept]
            error = np.sqrt(((compressed - full) ** 2).sum() / (full**2).sum())
            assert row["relative_error"] == pytest.approx(error, rel=1e-3, abs=1e-6), row
        del snap
    quantized = table.filter(table["method"] == "kivi2")
    assert (quantized["budget"] == 2 / 16).all() and (quantized["relative_error"] > 0).all()
    kivi4 = table.filter(table["method"] == "kivi4")["relative_error"].mean()
    assert kivi4 < quantized["relative_error"].mean()  # more bits, less error


def test_simulate_spread_over_processes_equals_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers spread over worker processes give the rows one process gives, in the same order,
    with the same warnings (the first layer's, said in a worker, said again here); ``random``
    draws per head, so that its keys do not depend on which process simulated the head."""
    from kvsnap.analysis.engine import executors, processes

    spec = SPECS["window-sinks"]
    rng = np.random.default_rng(7)
    path = tmp_path / "layers.kv"
    layers = [kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT32, queries=spec) for _ in range(3)]
    with kvformat.Writer(path, layers, metadata={"prompt_tokens": PROMPT}) as writer:
        for layer in range(3):
            k, v = (rng.standard_normal((2, POSITIONS, 8)).astype(np.float32) for _ in range(2))
            writer.append(layer, k, v)
            q = rng.standard_normal((4, POSITIONS - 24, 8)).astype(np.float32)
            writer.append_queries(layer, q, np.arange(24, POSITIONS))
        writer.snapshot()
    monkeypatch.setattr(processes, "usable", lambda *args: True)  # a file this small stays in-process
    tables, said = [], []
    for workers in (2, 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tables.append(simulate.simulate(path, budgets=(0.1, 0.5), window=6, workers=workers))
        said.append(sorted(str(w.message) for w in caught if w.category is simulate.CompressionWarning))
        if workers == 2:
            assert executors.is_kept((2, "cpu"))  # the layers went to the pool's workers
    spread, alone = tables
    # 3 layers x 4 heads x (11 evictions x 2 budgets + 4 quantizations): no observed or
    # expected_attention (they need every query)
    assert spread.height == 3 * 4 * (11 * 2 + 4)
    assert spread.equals(alone)
    assert said[0] == said[1] and any("keeps" in message for message in said[0])


def _kvpress_scores(data: dict[str, Any], spec: QuerySpec, kv_head: int) -> dict[str, np.ndarray]:
    """The scores of kvpress's KnormPress, KeyDiffPress, CURPress, LagKVPress (a span shorter
    than 4 + 2 x 128: the sinks, then recency) and TOVAPress over the prompt's keys, written
    here from those presses' ``score`` methods (NaN after the prompt)."""
    k = data["k"][kv_head, :PROMPT].astype(np.float64)
    v = data["v"][kv_head, :PROMPT].astype(np.float64)
    norm = np.linalg.norm(k, axis=1)
    anchor = (k / norm[:, None]).mean(axis=0)
    blocks = -(-PROMPT // 16) * 16

    def local(x: np.ndarray) -> np.ndarray:
        squares = np.zeros(blocks)
        squares[:PROMPT] = (x**2).sum(axis=1)
        squares = squares.reshape(-1, 16)
        return (squares / squares.sum(axis=1, keepdims=True)).reshape(-1)[:PROMPT]

    cur = local(k) * local(v)
    cur = cur / cur.sum()
    cur[:4] = 1.0
    lagkv = np.ones(PROMPT)
    lagkv[4:] = np.arange(PROMPT - 4) / (PROMPT - 4)
    last = np.array([PROMPT - 1])
    tova = np.mean([_weights(data, spec, h, last, np.arange(PROMPT))[0] for h in range(4)], axis=0)
    tova[-1] = tova[:-1].max() + 1
    out = {
        "knorm": -norm,
        "keydiff": -(k @ anchor) / (norm * np.linalg.norm(anchor)),
        "cur": cur,
        "lagkv": lagkv,
        "tova": tova,
    }
    return {
        name: np.concatenate([values, np.full(POSITIONS - PROMPT, np.nan)]) for name, values in out.items()
    }


def test_quantize_matches_a_plain_min_max_quantizer() -> None:
    x = np.random.default_rng(1).standard_normal((70, 8)).astype(np.float32)
    got = simulate.quantize(x, 2, axis=1)
    low, high = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    scale = (high - low) / 3
    np.testing.assert_allclose(got, np.round((x - low) / scale) * scale + low, rtol=1e-6)
    per_channel = simulate.quantize(x, 4, axis=0, group=32)
    part = x[32:64]
    low, high = part.min(axis=0), part.max(axis=0)
    np.testing.assert_allclose(
        per_channel[32:64],
        np.round((part - low) / ((high - low) / 15)) * ((high - low) / 15) + low,
        rtol=1e-5,
        atol=1e-6,
    )


def test_without_queries_the_error_names_the_option(tmp_path: Path) -> None:
    from kvsnap.cli import main

    rng = np.random.default_rng(0)
    kvformat.save(
        tmp_path / "plain.kv", [kvformat.Layer(*(rng.standard_normal((2, 10, 8), np.float32),) * 2)]
    )
    with pytest.raises(head_importance.NoQueriesError, match="--queries"):
        list(head_importance.attention_rows(tmp_path / "plain.kv"))
    assert (
        main(["stats", str(tmp_path / "plain.kv"), "--stats", "attention"]) == 1
    )  # one line: the file failed
    assert main(["simulate", str(tmp_path / "plain.kv"), "-o", str(tmp_path / "s.parquet")]) == 2
    assert not (tmp_path / "s.parquet").exists()


def test_cli_attention_stats_and_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import polars as pl

    from kvsnap.cli import main

    _write(tmp_path / "a.kv", SPECS["causal"])
    out = tmp_path / "att.parquet"
    expected = head_importance.attention_stats(tmp_path / "a.kv")
    monkeypatch.setitem(sys.modules, "polars", None)  # printed and saved without polars, as `stats`
    assert main(["stats", str(tmp_path / "a.kv"), "--stats", "attention", "-o", str(out)]) == 0
    monkeypatch.delitem(sys.modules, "polars")
    printed = capsys.readouterr().out
    assert "highest sink mass: L0.H0=" in printed  # query head 0 is the sink head
    table = pl.read_parquet(out)
    assert table.equals(expected)  # the Python API's table, dtypes and all
    assert table.height == 4 and math.isfinite(table["entropy"][0])
    assert expected["streaming_trivial"].all()  # 48 positions within the default 256: 0 by construction
    assert "highest streaming error: none to rank" in printed
    assert main(["stats", str(tmp_path / "a.kv"), "--stats", "attention", "--window", "8"]) == 0
    windowed = head_importance.attention_stats(tmp_path / "a.kv", window=8)
    top = windowed.sort("streaming_error", descending=True, maintain_order=True).row(0, named=True)
    assert (
        f"highest streaming error: L0.H{top['head']}={top['streaming_error']:.3f}" in capsys.readouterr().out
    )
    with pytest.raises(SystemExit) as refused:  # argparse: one line, exit 2
        main(["stats", str(tmp_path / "a.kv"), "--stats", "attention,norms"])
    assert refused.value.code == 2
    sim = tmp_path / "sim.parquet"
    png = tmp_path / "sim.png"
    args = ["simulate", str(tmp_path / "a.kv"), "--method", "streaming", "kivi4", "--budget", "0.1", "0.5"]
    assert main([*args, "-o", str(sim), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = pl.read_parquet(sim)
    assert sorted(set(result["method"].to_list())) == ["kivi4", "streaming"]
    assert result.filter(pl.col("method") == "streaming").height == 2 * 4
    assert main([*args, "-o", str(sim)]) == 2  # exists: refused without --force
    capsys.readouterr()
    every = [
        "simulate",
        str(tmp_path / "a.kv"),
        "--method",
        "h2o",
        "--budget",
        "0.5",
        "1",
        "-o",
        str(tmp_path / "e.parquet"),
    ]
    assert main(every) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " h2o " in line]
    assert "nothing evicted" not in lines[0] and lines[1].endswith("(nothing evicted: exact by construction)")
    heatmap = tmp_path / "sinks.png"
    assert main(["plot", str(tmp_path / "a.kv"), "--stat", "sink_mass", "-o", str(heatmap)]) == 0
    assert heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1 layers x 4 query heads of sink_mass" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["simulate", str(tmp_path / "a.kv"), "--method", "nope", "-o", str(tmp_path / "x.parquet")])
    assert refused.value.code == 2


def test_a_fresh_attention_command_imports_neither_polars_nor_pandas(tmp_path: Path) -> None:
    """``kvsnap stats FILE --stats attention`` as a user runs it, in a new process: its table is
    printed and saved from Arrow (polars' import would be a large share of a fresh command:
    `python -m benchmarks.cli_bench`; `pa.Table.from_pylist` would import pandas)."""
    import subprocess

    _write(tmp_path / "a.kv", SPECS["causal"])
    command = ["stats", str(tmp_path / "a.kv"), "--stats", "attention", "-o", str(tmp_path / "a.parquet")]
    script = (
        f"import sys; from kvsnap.cli import main; main({command!r}); "
        "print(sorted(m for m in ('polars', 'pandas') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


REAL_MODELS = {"smollm2": ("smollm2_dir", 30, 9, 3), "gemma3": ("gemma3_dir", 18, 4, 1)}


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_scores_on_a_real_capture_equal_numpy_over_the_recomputed_attention(
    tmp_path: Path, name: str, request: pytest.FixtureRequest
) -> None:
    """SmolLM2-135M (GQA 9:3) and Gemma-3-270m (4:1, scale from ``query_pre_attn_scalar``,
    sliding-window and global layers), queries of the last 8 prompt positions and every generated
    one: each head's scores equal numpy over `snap.attention`'s weights and the file's V;
    `simulate` keeps every key at budget 1 (error 0)."""
    from mlx_lm import load

    import kvsnap

    fixture, layers, heads, kv_heads = REAL_MODELS[name]
    model_dir = request.getfixturevalue(fixture)
    text = "The bridge was built in 1820 and the bridge still stands; the bridge"

    def make(path: Path) -> dict[str, np.ndarray]:
        model, tokenizer = load(str(model_dir))
        ids = tokenizer.encode(text)
        list(kvsnap.generate(model, tokenizer, ids, max_tokens=8, output=path, queries="window:8"))
        return {"prompt": np.array(ids)}

    recipe = f"{text!r}, 8 new tokens, queries window:8"
    path = kept_capture(f"bridge-{name}", model_dir, recipe, make, (Path(__file__),))  # read only
    prompt = kept_arrays(path)["prompt"]
    rows = list(head_importance.attention_rows(path, window=6))
    every = list(head_importance.attention_rows(path, window=6, retrieval="all"))
    assert len(rows) == layers * heads
    assert {r["kv_head"] for r in rows if r["layer"] == 0} == set(range(kv_heads))
    with kvformat.open(path) as snap:
        tokens = np.array(snap.snapshot_metadata["tokens"][0])
        for row in rows[:: len(rows) // 7]:  # a spread of layers and heads
            found = snap.attention(row["layer"], row["head"])
            w = found.weights.astype(np.float64)
            p, j = found.query_positions, found.key_positions
            assert row["n_queries"] == len(p) >= 8 + 7  # the window, then the generated tokens' queries
            assert row["sink_mass"] == pytest.approx(w[:, j < 4].sum(axis=1).mean(), rel=1e-5, abs=1e-7)
            seen = w > 0
            entropy = -(np.where(seen, w * np.log(np.where(seen, w, 1)), 0)).sum(axis=1)
            assert row["entropy"] == pytest.approx(entropy.mean(), rel=1e-4, abs=1e-5)
            back = p[:, None] - j[None, :]
            assert row["mean_distance"] == pytest.approx((w * back).sum(axis=1).mean(), rel=1e-4, abs=1e-4)
            v = np.asarray(snap.head(row["layer"], row["kv_head"]).v, np.float64)  # type: ignore[union-attr]
            keep = (j[None, :] < 4) | (back < 6)
            full, kept = w @ v, w * keep
            streamed = (kept @ v) / kept.sum(axis=1)[:, None]
            error = np.sqrt(((streamed - full) ** 2).sum() / (full**2).sum())
            assert row["streaming_error"] == pytest.approx(error, rel=1e-3, abs=1e-5)
            top = j[np.argmax(w, axis=1)]
            # Wu et al. 2024: decoding steps whose generated token copies the context (the query at
            # the prompt's last position produced the first); with retrieval="all", every query.
            for scope, first in ((row, len(prompt) - 1), (every[rows.index(row)], 0)):
                events = [
                    (i, q)
                    for i, q in enumerate(p.tolist())
                    if first <= q and q + 1 < len(tokens) and tokens[q + 1] in tokens[: q + 1]
                ]
                assert scope["retrieval_events"] == len(events)
                hits = sum(int(tokens[top[i]] == tokens[q + 1]) for i, q in events)
                assert (
                    scope["retrieval_score"] == pytest.approx(hits / len(events))
                    if events
                    else math.isnan(scope["retrieval_score"])
                )
            assert every[rows.index(row)]["retrieval_events"] >= row["retrieval_events"]
    table = simulate.simulate(path, methods=["streaming", "snapkv"], budgets=(1.0,), window=4)
    assert table.height == 2 * layers * heads and (table["relative_error"] == 0).all()


@pytest.mark.parametrize("name", list(SPECS))
def test_token_table_snapkv_score_equals_the_definition(tmp_path: Path, name: str) -> None:
    """``token_table``'s ``snapkv_score``: per KV head and key before the observation window (the
    last 64 prompt queries, or as many as the file holds), SnapKV's score as kvpress computes it
    (the window's mean per head, a zero-padded mean over 5 keys, the group's mean), from the
    float64 definition; null from the window on and in a file without queries."""
    from kvsnap.analysis.tools.token_table import token_table

    spec = SPECS[name]
    data = _write(tmp_path / "a.kv", spec)
    table = token_table(tmp_path / "a.kv").collect()
    keys = np.arange(POSITIONS)
    window = np.arange(24, PROMPT)  # the file holds queries from position 24 on: 12 of the 64
    before = keys < window[0]
    for kv_head in (0, 1):
        heads = [h for h in range(4) if spec.kv_heads[h] == kv_head]
        per_head = [_weights(data, spec, h, window, keys)[:, before].mean(axis=0) for h in heads]
        pooled = np.mean([np.convolve(w, np.ones(5) / 5, mode="same") for w in per_head], axis=0)
        rows = table.filter((table["layer"] == 0) & (table["head"] == kv_head)).sort("position")
        got = rows["snapkv_score"].to_numpy()
        np.testing.assert_allclose(got[: window[0]], pooled, rtol=1e-5)
        assert rows["snapkv_score"][window[0] :].null_count() == POSITIONS - window[0]
    k = np.ones((2, 4, 8), np.float32)
    kvformat.save(tmp_path / "plain.kv", [kvformat.Layer(k, k)])
    assert token_table(tmp_path / "plain.kv").collect()["snapkv_score"].null_count() == 8


KERNEL_SPECS = {
    **SPECS,
    "softcap": QuerySpec(
        num_heads=4, dim=8, dtype=kvformat.FLOAT32, scale=0.5, kv_heads=(0, 0, 1, 1), softcap=3.0
    ),
    "window-keep": QuerySpec(
        num_heads=4, dim=8, dtype=kvformat.FLOAT32, scale=0.4, kv_heads=(0, 0, 1, 1), window=9, keep=2
    ),
}


@pytest.mark.skipif(
    not attention_kernel.AVAILABLE,
    reason="compiled kernel off (C kernels not built, or KVSNAP_KERNEL=numpy)",
)
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("name", list(KERNEL_SPECS))
def test_compiled_pass_equals_the_numpy_path(name: str, ordered: bool) -> None:
    """The compiled per-block pass (`attention_kernel`) gives the numpy path's sums over
    `kvformat.attention.weights`: strong and flat logits, a query that sees no key (position
    before the keys), a block with a NaN (it takes the numpy path: the query's weights all 0, its
    row still counted), keys
    in order (only the columns a block sees are multiplied) and out of order, every mask, scale,
    softcap and sink setting of SPEC 10.1."""
    spec = KERNEL_SPECS[name]
    rng = np.random.default_rng(3)
    keys_at = np.arange(0, 40) if ordered else rng.permutation(np.arange(5, 45))
    k = (rng.standard_normal((40, 8)) * 2).astype(np.float32)
    v = rng.standard_normal((40, 8)).astype(np.float32)
    q = (rng.standard_normal((20, 8)) * 3).astype(np.float32)
    q[3] = 0.0  # flat: every visible key the same weight
    nan = q.copy()
    nan[5, 2] = np.nan  # a block the compiled pass hands to the numpy path
    p = np.concatenate([[2], np.arange(26, 45)]).astype(np.int64)  # position 2 sees no key
    copies = head_importance.copy_events(rng.integers(0, 5, 50).tolist(), (0, 30))
    keys = head_importance._Keys(k, v, keys_at, ordered, float(np.abs(k).max()))
    for head, q in [(h, q) for h in range(4)] + [(1, nan)]:
        compiled, reference = head_importance._Sums(), head_importance._Sums()
        head_importance._add_compiled([compiled], spec, [head], q, p, keys, 7, copies)
        head_importance._add_block(reference, spec, head, q, p, keys, 7, copies)
        for field in ("sink", "local", "entropy", "entropy_normalized", "distance", "error_sq", "output_sq"):
            expected = getattr(reference, field)
            assert getattr(compiled, field) == pytest.approx(expected, rel=2e-5, abs=1e-5), field
        assert (compiled.queries, compiled.events, compiled.hits) == (
            reference.queries,
            reference.events,
            reference.hits,
        )
        assert compiled.histogram.tolist() == reference.histogram.tolist()


@pytest.mark.skipif(
    not attention_kernel.AVAILABLE,
    reason="compiled kernel off (C kernels not built, or KVSNAP_KERNEL=numpy)",
)
@pytest.mark.parametrize("name", list(KERNEL_SPECS))
def test_stacked_query_heads_score_as_each_head_alone(name: str) -> None:
    """The compiled pass given a KV head's query heads stacked (one product for the group, each
    head's own sink) gives each head the numpy path's sums for that head alone."""
    spec = KERNEL_SPECS[name]
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((40, 8)) * 2).astype(np.float32)
    v = rng.standard_normal((40, 8)).astype(np.float32)
    p = np.concatenate([[2], np.arange(26, 45)]).astype(np.int64)
    q = [(rng.standard_normal((20, 8)) * s).astype(np.float32) for s in (3.0, 0.5, 2.0, 1.0)]
    copies = head_importance.copy_events(rng.integers(0, 5, 50).tolist(), (0, 30))
    keys = head_importance._Keys(k, v, np.arange(40), True, float(np.abs(k).max()))
    stacked = [head_importance._Sums() for _ in range(4)]
    head_importance._add_compiled(stacked, spec, [0, 1, 2, 3], np.concatenate(q), p, keys, 7, copies)
    for head in range(4):
        reference = head_importance._Sums()
        head_importance._add_block(reference, spec, head, q[head], p, keys, 7, copies)
        for field in ("sink", "local", "entropy", "entropy_normalized", "distance", "error_sq", "output_sq"):
            expected = getattr(reference, field)
            assert getattr(stacked[head], field) == pytest.approx(expected, rel=2e-5, abs=1e-5), (head, field)
        assert stacked[head].histogram.tolist() == reference.histogram.tolist()
        assert (stacked[head].queries, stacked[head].hits) == (reference.queries, reference.hits)


def _compiled_exp(d: np.ndarray) -> np.ndarray:
    """The compiled pass's own ``exp`` of each of ``d``."""
    return native.exp_nonpositive(d)


@pytest.mark.skipif(
    not attention_kernel.AVAILABLE,
    reason="compiled kernel off (C kernels not built, or KVSNAP_KERNEL=numpy)",
)
def test_compiled_exp_is_within_one_ulp() -> None:
    """The compiled pass's own float32 ``exp`` (a polynomial, so its loops vectorize) against
    float64 ``exp`` over two million points of the range it serves, ``[-87.3, 0]``; 0 below."""
    d = np.linspace(-87.3, 0, 2_000_001).astype(np.float32)
    out = _compiled_exp(d)
    true = np.exp(d.astype(np.float64))
    ulp = np.spacing(true.astype(np.float32)).astype(np.float64)
    assert (np.abs(out - true) / ulp).max() <= 1.0
    assert _compiled_exp(np.array([-88.0, -100.0, -1e30], np.float32)).tolist() == [0.0, 0.0, 0.0]


def test_kept_keys_overlay_on_the_attention_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``plot --attention L:H --kept METHOD:BUDGET``: `compression.kept_mask` is what `simulate`
    keeps (streaming at 0.25 of 36 prompt keys: the 4 sinks and the last 5 prompt keys, every
    generated key; at budget 1 every key; snapkv keeps exactly ``floor(budget * 36)`` prompt
    keys, its window among them); the PNG is written; ``--kept`` without ``--attention`` and a bad
    value are one-line errors, exit 2."""
    from kvsnap.analysis.attention.compression import kept_mask
    from kvsnap.cli import main

    path = tmp_path / "a.kv"
    _write(path, SPECS["causal"])
    with kvformat.open(path) as snap:
        positions, keep = kept_mask(snap, 0, 1, "streaming", 0.25)
        expected = (
            (positions < 4) | ((positions >= PROMPT - 5) & (positions < PROMPT)) | (positions >= PROMPT)
        )
        assert positions.tolist() == list(range(POSITIONS)) and keep.tolist() == expected.tolist()
        assert kept_mask(snap, 0, 1, "h2o", 1.0)[1].all()
        snapkv = kept_mask(snap, 0, 2, "snapkv", 0.25, options=simulate.Options(window=8))[1]
        assert snapkv[:PROMPT].sum() == 9 and snapkv[PROMPT - 8 :].all()  # floor(0.25 * 36), the window
        with pytest.raises(ValueError, match="the file holds 12 of them"):  # a window it does not hold
            kept_mask(snap, 0, 2, "snapkv", 0.25, options=simulate.Options(window=64))
        # the default window: kvpress's 64, or the 12 queries the file holds before the prompt's end
        with pytest.warns(simulate.CompressionWarning, match="holds 12 consecutive queries before"):
            adapted = kept_mask(snap, 0, 2, "snapkv", 0.25)[1]
        explicit = kept_mask(snap, 0, 2, "snapkv", 0.25, options=simulate.Options(window=12))[1]
        assert adapted.tolist() == explicit.tolist() and adapted[:PROMPT].sum() == 9
        with pytest.raises(ValueError, match="eviction method"):
            kept_mask(snap, 0, 1, "kivi4", 0.5)
    png = tmp_path / "map.png"
    assert main(["plot", str(path), "--attention", "0:1", "--kept", "streaming:0.25", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(path), "--kept", "streaming:0.25", "-o", str(tmp_path / "b.png")]) == 2
    assert "--kept shades an attention map" in capsys.readouterr().err
    windowed = ["plot", str(path), "--attention", "0:2", "--kept", "snapkv:0.25", "--window", "8"]
    assert main([*windowed, "-o", str(tmp_path / "w.png")]) == 0  # SnapKV's window on the map too
    # options that would be ignored are refused in one line
    for ignored, message in (
        (["--attention", "0:1", "--stat", "norm_max"], "--stat picks a heatmap's statistic"),
        (["--attention", "0:1", "--kept", "streaming:0.5", "--window", "8"], "--window sets SnapKV's"),
    ):
        assert main(["plot", str(path), *ignored, "-o", str(tmp_path / "d.png")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "d.png").exists()
    for bad in ("streaming", "kivi4:0.5", "snapkv:0", "snapkv:x"):
        with pytest.raises(SystemExit) as refused:
            main(["plot", str(path), "--attention", "0:1", "--kept", bad, "-o", str(tmp_path / "c.png")])
        assert refused.value.code == 2


def test_a_windowed_capture_scores_only_queries_whose_keys_the_file_holds(
    tmp_path: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rotating cache (24 keys, 4 kept) snapshotted every 20 tokens: the queries that saw keys
    no snapshot holds are left out of every score and counted, with one warning; the rest score
    as numpy over the keys each saw (dropped rows from the earlier snapshot)."""
    from mlx_lm import load

    import kvsnap
    from kvformat import attention
    from kvsnap.cli import main

    text = "The history of the city begins when a small settlement grew up by a bridge"

    def make(path: Path) -> None:
        model, tokenizer = load(str(smollm2_dir))
        options = {"every": 20, "queries": "window:16", "max_kv_size": 24}
        list(kvsnap.generate(model, tokenizer, tokenizer.encode(text), max_tokens=40, output=path, **options))

    recipe = f"{text!r}, 40 new tokens, every 20, queries window:16, max_kv_size 24"
    path = kept_capture("rotating-window", smollm2_dir, recipe, make)  # read only
    with pytest.warns(head_importance.AttentionWarning, match="left out of the attention statistics"):
        rows = list(head_importance.attention_rows(path, retrieval="all"))
    with kvformat.open(path) as snap:
        for row in rows[::37]:
            spec = snap.layers[row["layer"]].queries
            assert spec is not None
            stored = snap.queries(row["layer"], row["head"])
            assert stored is not None
            keys = attention.context_keys(snap, row["layer"], row["kv_head"], 0, stored.positions)
            assert row["queries_incomplete"] == int((~keys.complete).sum()) > 0
            assert row["n_queries"] == int(keys.complete.sum())
            p = stored.positions[keys.complete]
            w = attention.weights(spec, row["head"], stored.q[keys.complete], keys.k, p, keys.positions)
            assert row["sink_mass"] == pytest.approx(w[:, keys.positions < 4].sum(axis=1).mean(), rel=1e-5)
            assert w[:, keys.positions < 4].sum(axis=1).min() < 0.99  # not the sink-only renormalisation
    assert main(["stats", str(path), "--stats", "attention"]) == 0
    err = capsys.readouterr().err
    assert err.count("kvsnap: warning:") == 1 and "queries_incomplete" in err


def test_attention_statistics_take_many_files_as_kv_statistics_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pattern over four files, one cut short and one without queries: the two good files'
    rows are written, each failure is one line naming its file, exit 1; the summary names the
    file of each head; the Python entry points expand patterns too; ``--snapshot`` past a file's
    snapshots names that file; a streaming error that is 0 by construction (every query within
    the sinks and the window) is flagged and not ranked."""
    from kvsnap.analysis.engine.files import FileFailure
    from kvsnap.cli import main

    many = tmp_path / "many"
    many.mkdir()
    _write(many / "a.kv", SPECS["causal"], seed=1)
    _write(many / "b.kv", SPECS["causal"], seed=2)
    (many / "c.kv").write_bytes((many / "a.kv").read_bytes()[:3000])  # cut short
    k = np.ones((2, 4, 8), np.float32)
    kvformat.save(many / "d.kv", [kvformat.Layer(k, k)])  # no queries
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "att.parquet"
    code = main(["stats", "many/*.kv", "--stats", "attention", "--window", "8", "-o", str(out)])
    printed = capsys.readouterr()
    assert code == 1
    errors = printed.err.strip().splitlines()
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in errors[:2]] == [
        "failed: many/c.kv",
        "failed: many/d.kv",
    ]
    assert "TruncatedFileError" in errors[0] and "NoQueriesError" in errors[1]
    assert errors[2] == "2 of 4 files failed" and len(errors) == 3
    import polars as pl

    table = pl.read_parquet(out)
    assert sorted(set(table["file"].to_list())) == ["many/a.kv", "many/b.kv"]
    assert "in 2 files" in printed.out and "a.kv:L0.H0=" in printed.out
    assert not table["streaming_trivial"].any()  # window 8: queries at 24..47 drop keys
    # the Python entry points take patterns too
    frame = head_importance.attention_stats("many/[ab].kv", window=8)
    assert frame.height == table.height
    failures: list[FileFailure] = []
    head_importance.attention_table(["many/*.kv"], failures=failures)
    assert [f.file for f in failures] == ["many/c.kv", "many/d.kv"]
    import kvsnap

    assert kvsnap.head_stats("many/[ab].kv")["file"].n_unique() == 2
    # a snapshot one of the files lacks: refused before any work, naming that file
    assert main(["stats", "many/a.kv", "many/b.kv", "--stats", "attention", "--snapshot", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvsnap: error: --snapshot 3: many/a.kv: snapshot 3 out of range")
    assert "\n" not in err
    # the default window (256) holds every one of these 48 positions: 0 by construction, flagged
    trivial = head_importance.attention_stats("many/a.kv")
    assert trivial["streaming_trivial"].all() and (trivial["streaming_error"] < 1e-6).all()  # rounding
    assert main(["stats", "many/a.kv", "--stats", "attention"]) == 0
    assert "highest streaming error: none to rank" in capsys.readouterr().out


def test_kvpress_methods_a_file_cannot_compute_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvsnap.cli import main

    _write(tmp_path / "a.kv", SPECS["window-sinks"])
    for method, why in (
        ("qfilter", "trained"),
        ("kvzip", "reconstructs"),
        ("duo_attention", "--duo-attention"),
    ):
        with pytest.raises(ValueError, match=why):
            simulate.simulate(tmp_path / "a.kv", [method])
        with pytest.raises(SystemExit) as exited:  # argparse's one line
            main(["simulate", str(tmp_path / "a.kv"), "--method", method, "-o", str(tmp_path / "o.parquet")])
        assert exited.value.code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "o.parquet").exists()


SPARSE_VECTOR = Path(__file__).resolve().parents[3] / "spec" / "vectors" / "queries-sparse.kv"


def test_sparse_attention_scores_the_keys_each_query_read() -> None:
    """A layer with key selections (format 1.7): the statistics, the viewer's row and heatmap
    weigh only the keys each query's selection names (numpy's softmax over exactly those keys),
    and simulate refuses the layer by name."""
    from kvsnap.analysis.viewer import data as viewer_data

    with kvformat.open(SPARSE_VECTOR) as snap:
        spec = snap.layers[0].queries
        chosen = snap.selection(0)
        head = snap.head(0, 0)
        assert spec is not None and chosen is not None and head is not None
        rows = {int(p): set(r.tolist()) for p, r in zip(chosen.positions, chosen.rows, strict=True)}
        for query_head in range(spec.num_heads):
            found = snap.queries(0, query_head)
            assert found is not None
            entropies = []
            for row, p in enumerate(found.positions.tolist()):
                seen = [j for j in range(p + 1) if p not in rows or j in rows[p]]
                logits = spec.scale * (head.k[seen].astype(np.float64) @ found.q[row].astype(np.float64))
                expected = np.exp(logits - logits.max())
                expected /= expected.sum()
                entropies.append(float(-(expected * np.log(expected)).sum()))
                shown = viewer_data.query_row(snap, 0, query_head, p)
                assert shown["keys"] == seen
                np.testing.assert_allclose(shown["weights"], expected, rtol=1e-4)
            scores = head_importance.head_scores(snap, 0, query_head)
            assert scores["n_queries"] == found.positions.size
            np.testing.assert_allclose(scores["entropy"], np.mean(entropies), rtol=1e-5)
    with pytest.raises(simulate.CompressionError, match="sparse attention"):
        simulate.simulate_rows(SPARSE_VECTOR, ["streaming"], [0.5])
