"""Diff two captures head by head: the same SmolLM2 prompt with a float16 cache and
with 8-bit and 4-bit quantized caches (quantizing from the first token)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler

import kvformat
from kvsnap.analysis.tools.diff import LayoutMismatchError, head_diff
from kvsnap.capture.generation import generate
from kvsnap.cli import main
from tests.conftest import PROSE, kept_capture
from tests.kvformat.test_channel_order import _pair


@pytest.fixture(scope="module")
def captures(smollm2_dir: Path) -> dict[str, Path]:
    """The three captures, each made once and kept by content (`kept_capture`): read only."""
    loaded: list[tuple[object, object]] = []

    def capture(extra: dict[str, int]) -> Callable[[Path], None]:
        def make(path: Path) -> None:
            if not loaded:
                loaded.append(load(str(smollm2_dir)))
            model, tokenizer = loaded[0]
            prompt = tokenizer.encode(PROSE)[:48]  # type: ignore[attr-defined]
            sampler = make_sampler(0.0)
            list(generate(model, tokenizer, prompt, max_tokens=2, output=path, sampler=sampler, **extra))

        return make

    paths = {}
    for name, extra in (("fp16", {}), ("kv8", {"kv_bits": 8}), ("kv4", {"kv_bits": 4})):
        if extra:
            extra = {**extra, "kv_group_size": 64, "quantized_kv_start": 0}
        recipe = f"PROSE[:48] ids, 2 new tokens, greedy, {sorted(extra.items())}"
        paths[name] = kept_capture(f"diff-{name}", smollm2_dir, recipe, capture(extra), (Path(__file__),))
    return paths


def direct_rel_error(a: Path, b: Path, layer: int, head: int, tensor: str) -> float:
    with kvformat.open(a) as x, kvformat.open(b) as y:
        p, q = x.head(layer, head), y.head(layer, head)
        assert p is not None and q is not None
        _, i, j = np.intersect1d(p.positions, q.positions, return_indices=True)
        left = np.asarray(getattr(p, tensor), np.float64)[i]
        right = np.asarray(getattr(q, tensor), np.float64)[j]
        return float(np.linalg.norm(right - left) / np.linalg.norm(left))


def test_quantized_caches_against_float16(captures: dict[str, Path]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # greedy tokens may differ after the prompt
        eight = head_diff(captures["fp16"], captures["kv8"])
        four = head_diff(captures["fp16"], captures["kv4"])
    with kvformat.open(captures["fp16"]) as snap:
        assert snap.layers[0].quantization is None
        expected_rows = sum(spec.num_heads for spec in snap.layers if spec.present) * 2
    with kvformat.open(captures["kv4"]) as snap:
        assert snap.layers[0].quantization is not None and snap.layers[0].quantization.bits == 4
    assert eight.height == four.height == expected_rows
    assert (eight["n_positions"] >= 48).all()
    for row in eight.sample(8, seed=0).iter_rows(named=True):
        direct = direct_rel_error(captures["fp16"], captures["kv8"], row["layer"], row["head"], row["tensor"])
        assert row["rel_error"] == pytest.approx(direct, rel=1e-12)
    joined = eight.join(four, on=["layer", "head", "seq", "tensor"], suffix="_4")
    assert (joined["rel_error_4"] > joined["rel_error"]).all()  # 4-bit worse than 8-bit, every head
    assert (eight["rel_error"] < 0.05).all() and (eight["cosine_mean"] > 0.99).all()
    assert (four["first_divergent_position"] == 0).all()  # quantized from the first token
    same = head_diff(captures["fp16"], captures["fp16"])
    assert (same["rel_error"] == 0).all() and same["first_divergent_position"].null_count() == same.height


def test_diff_command(captures: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "d.parquet", tmp_path / "d.png"
    argv = ["diff", str(captures["fp16"]), str(captures["kv4"]), "-o", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "worst heads" in printed.out and "rel_error" in printed.out
    assert pl.read_parquet(out).height > 0 and plot.stat().st_size > 10_000


def test_layouts_that_differ_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    k = np.ones((2, 3, 4), np.float32)
    kvformat.save(tmp_path / "a.kv", [kvformat.Layer(k, k)])
    kvformat.save(tmp_path / "b.kv", [kvformat.Layer(k[:1], k[:1])])
    with pytest.raises(LayoutMismatchError, match="layer 0: 2 heads, k_dim 4, v_dim 4 in A vs 1 heads"):
        head_diff(tmp_path / "a.kv", tmp_path / "b.kv")
    assert main(["diff", str(tmp_path / "a.kv"), str(tmp_path / "b.kv")]) == 2
    assert "differ: layer 0" in capsys.readouterr().err


def test_only_positions_before_the_tokens_diverge_are_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """B's token ids differ from position 1 on, and so do its rows there: by default only
    position 0 is compared (exact), the table and the summary say where the tokens diverge and
    how many positions were left out; ``all_positions`` compares the three."""
    spec = kvformat.LayerSpec(1, 4, 4, kvformat.dtypes.from_numpy(np.dtype(np.float32)))
    rng = np.random.default_rng(2)
    k = rng.standard_normal((1, 3, 4)).astype(np.float32)
    changed = k.copy()
    changed[:, 1:] *= 1.5
    for name, tokens, rows in (("a", [5, 6, 7], k), ("b", [5, 9, 7], changed)):
        with kvformat.Writer(tmp_path / f"{name}.kv", [spec]) as writer:
            writer.append(0, rows, rows)
            writer.snapshot({"tokens": [tokens]})
    with pytest.warns(UserWarning, match="token ids differ from position 1 of sequence 0 on: only positions"):
        table = head_diff(tmp_path / "a.kv", tmp_path / "b.kv")
    assert table["n_positions"].to_list() == [1, 1] and table["rel_error"].to_list() == [0.0, 0.0]
    assert table["tokens_diverge_at"].to_list() == [1, 1] and table["positions_left_out"].to_list() == [2, 2]
    with pytest.warns(UserWarning, match="compared anyway"):
        every = head_diff(tmp_path / "a.kv", tmp_path / "b.kv", all_positions=True)
    assert every["n_positions"].to_list() == [3, 3] and every["positions_left_out"].to_list() == [0, 0]
    moved = np.linalg.norm(k[0, 1:] * 0.5) / np.linalg.norm(k[0])
    assert every["rel_error"].to_list() == pytest.approx([moved, moved])
    out, plot = tmp_path / "d.parquet", tmp_path / "d.png"
    argv = ["diff", str(tmp_path / "a.kv"), str(tmp_path / "b.kv"), "-o", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "kvsnap: warning: " in printed.err
    assert "token ids diverge at position 1: up to 2 later positions per head left out" in printed.out
    assert pl.read_parquet(out)["tokens_diverge_at"].to_list() == [1, 1]
    assert main([*argv[:3], "--all-positions"]) == 0
    assert "later positions compared too (--all-positions)" in capsys.readouterr().out


@pytest.mark.parametrize("keys", ["post_rope", "pre_rope"])
def test_diff_compares_in_one_order_and_says_so(tmp_path: Path, keys: str) -> None:
    a, b, _ = _pair(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = head_diff(a, b, keys=keys)
    assert any("pair RoPE channels differently" in str(w.message) for w in caught)
    assert max(table["rel_error"].to_list()) < 1e-5  # never a silent 1.4
    plain = head_diff(b, b, keys=keys)
    assert max(plain["rel_error"].to_list()) == 0.0
