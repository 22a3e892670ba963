"""Statistics of the recurrent state a file stores, held to the states mlx-lm's own model holds
at the same tokens (numpy's SVD on them), NaNs counted, and the command's one-line refusals."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import kvformat
from kvsnap.analysis.tools.state import state_rows
from kvsnap.capture import generate, tokens_of
from kvsnap.capture.tiny import build, byte_tokenizer

PROMPT = list(range(3, 30))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    model = build("qwen3_next")
    path = tmp_path_factory.mktemp("state") / "qwen3_next.kv"
    list(generate(model, byte_tokenizer(), PROMPT, max_tokens=9, output=path, every=4))
    return path, model


def _live_states(model: object, ids: list[int]) -> list[object]:
    cache = make_prompt_cache(model)
    model(mx.array([ids[: len(PROMPT)]]), cache=cache)  # type: ignore[operator]
    for token in ids[len(PROMPT) :]:
        model(mx.array([[token]]), cache=cache)  # type: ignore[operator]
    return cache


def test_state_statistics_are_those_of_the_models_own_states(hybrid: tuple[Path, object]) -> None:
    path, model = hybrid
    rows = state_rows(path)
    with kvformat.open(path) as snap:
        count = snap.num_snapshots
        assert count == 3 and {row["snapshot"] for row in rows} == set(range(count))
        previous: dict[tuple[int, int, int | None], np.ndarray] = {}
        for index in range(count):
            cache = _live_states(model, tokens_of(snap.select(index))[0])
            for row in (r for r in rows if r["snapshot"] == index):
                live = np.array(cache[row["layer"]].cache[row["slot"]].astype(mx.float32))[0]
                matrix = live if row["head"] is None else live[row["head"]]
                matrix = matrix.reshape(matrix.shape[0], -1).astype(np.float64)
                singular = np.linalg.svd(matrix, compute_uv=False)
                assert (row["rows"], row["cols"]) == matrix.shape
                assert row["norm"] == pytest.approx(np.linalg.norm(matrix), rel=1e-4)
                np.testing.assert_allclose(row["singular_values"], singular[:8], rtol=1e-3, atol=1e-6)
                p = singular**2 / (singular**2).sum()
                p = p[p > 0]
                assert row["effective_rank"] == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-3)
                key = (row["layer"], row["slot"], row["head"])
                if key in previous:
                    expected = np.linalg.norm(matrix - previous[key]) / np.linalg.norm(previous[key])
                    assert row["change"] == pytest.approx(expected, rel=1e-3)
                else:
                    assert row["change"] is None
                previous[key] = matrix
    roles = {(row["slot"], row["role"]) for row in rows}
    assert roles == {(0, "conv"), (1, "recurrent")}


def test_one_snapshot_still_changes_against_the_one_before(hybrid: tuple[Path, object]) -> None:
    path, _ = hybrid
    every = state_rows(path)
    one = state_rows(path, snapshot=1)
    assert {row["snapshot"] for row in one} == {1}
    assert one == [row for row in every if row["snapshot"] == 1]


def test_a_nan_in_the_state_is_counted_and_left_out(tmp_path: Path) -> None:
    described = [{"shape": [1, 2, 3, 4], "dtype": "float32", "heads": 2, "role": "ssm"}]
    spec = kvformat.LayerSpec.absent({"kind": "recurrent", "state": described})
    state = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    state[0, 1, 2, 3] = np.nan
    path = tmp_path / "nan.kv"
    with kvformat.Writer(path, [spec]) as writer:
        writer.snapshot({}, arrays={f"state/0/0/{h}": state[:, h].reshape(3, 4) for h in range(2)})
    rows = state_rows(path)
    assert [row["nonfinite_values"] for row in rows] == [0, 1]
    finite = np.where(np.isfinite(state[0, 1]), state[0, 1], 0.0)
    assert rows[1]["norm"] == pytest.approx(np.linalg.norm(finite))
    assert math.isfinite(rows[1]["effective_rank"])


def test_the_command_refuses_a_file_without_state_in_one_line(
    hybrid: tuple[Path, object], tmp_path: Path
) -> None:
    path, _ = hybrid
    run = [sys.executable, "-m", "kvsnap.cli", "stats", "--stats", "state"]
    plain = Path(__file__).resolve().parents[3] / "spec" / "vectors" / "float32-raw.kv"
    refused = subprocess.run([*run, str(plain)], capture_output=True, text=True)
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0 and "holds no recurrent state" in refused.stderr
    out = tmp_path / "state.csv"
    done = subprocess.run([*run, str(path), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "recurrent" in done.stdout and out.read_text().count("\n") == len(state_rows(path)) + 1
