"""Recurrent state (SPEC 15.4): stored with every snapshot, put back into the same cache class
bit for bit, so generation resumes as if never interrupted; a malformed description is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import kvformat
from kvformat.rewrite import rebuild_index
from kvsnap.capture import restore, snapshot_kv
from kvsnap.capture.errors import UnsupportedModelError
from kvsnap.capture.tiny import tiny_model

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
LATER = [43, 38, 32, 79]


def _logits_after(model, cache, tokens):  # type: ignore[no-untyped-def]
    logits = None
    for token in tokens:
        logits = model(mx.array([[token]]), cache=cache)
    return np.array(logits[0, -1])


@pytest.mark.parametrize("architecture", ["lfm2", "nemotron_h"])
def test_a_snapshot_file_restores_the_state_bit_for_bit(tmp_path: Path, architecture: str) -> None:
    model = tiny_model(architecture)
    uninterrupted = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=uninterrupted)
    expected = _logits_after(model, uninterrupted, LATER)

    live = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=live)
    path = tmp_path / "hybrid.kv"
    snapshot_kv(live, model).save(path)
    with kvformat.open(path) as snap:
        recurrent = [i for i, spec in enumerate(snap.layers) if spec.attributes.get("kind") == "recurrent"]
        assert recurrent and all(not snap.layers[i].present for i in recurrent)
        for index in recurrent:
            live_state = live[index].cache
            described = snap.layers[index].attributes["state"]
            assert [entry["shape"] for entry in described] == [list(a.shape) for a in live_state]
        cache = restore(snap)
    for index in recurrent:
        assert type(cache[index]).__name__ == "ArraysCache"
        for restored, original in zip(cache[index].cache, live[index].cache, strict=True):
            assert restored.dtype == original.dtype
            np.testing.assert_array_equal(np.array(restored), np.array(original))
    np.testing.assert_array_equal(_logits_after(model, cache, LATER), expected)


def test_the_state_is_named_and_shaped_as_the_spec_says(tmp_path: Path) -> None:
    """SPEC 15.4 read with numpy alone: a head-axis slot is H arrays of (S * a, b)."""
    model = tiny_model("nemotron_h")
    live = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=live)
    path = tmp_path / "nemotron.kv"
    snapshot_kv(live, model).save(path)
    conv, ssm = (np.array(a) for a in live[0].cache)
    with kvformat.open(path) as snap:
        assert [e["role"] for e in snap.layers[0].attributes["state"]] == ["conv", "ssm"]
        assert [e["heads"] for e in snap.layers[0].attributes["state"]] == [None, ssm.shape[1]]
        np.testing.assert_array_equal(snap.array("state/0/0"), conv.reshape(conv.shape[1], -1))
        for head in range(ssm.shape[1]):
            np.testing.assert_array_equal(snap.array(f"state/0/1/{head}"), ssm[0, head])


@pytest.mark.parametrize("broken", [{"shape": "x"}, {"heads": 3}, {"dtype": "complex64"}, "text"])
def test_a_malformed_state_description_is_one_named_error(tmp_path: Path, broken: object) -> None:
    model = tiny_model("lfm2")
    live = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=live)
    good, bad = tmp_path / "good.kv", tmp_path / "bad.kv"
    snapshot_kv(live, model).save(good)

    def edit(document: dict) -> None:  # type: ignore[type-arg]
        state = document["manifest"]["layers"][0]["attributes"]["state"]
        if isinstance(broken, dict):
            state[0].update(broken)
        else:
            document["manifest"]["layers"][0]["attributes"]["state"] = broken

    rebuild_index(good, bad, edit_json=edit)
    with kvformat.open(bad) as snap, pytest.raises(UnsupportedModelError, match="layer 0: its 'state'"):
        restore(snap)


def _edited(tmp_path: Path, caches: list, edit) -> Path:  # type: ignore[no-untyped-def,type-arg]
    good, bad = tmp_path / "good.kv", tmp_path / "bad.kv"
    good.unlink(missing_ok=True)
    bad.unlink(missing_ok=True)
    snapshot_kv(caches).save(good)
    rebuild_index(good, bad, edit_json=lambda d: edit(d["manifest"]["layers"]))
    return bad


@pytest.mark.parametrize(
    "edit",
    [
        lambda layers: layers[0]["attributes"].update(window="8"),  # an empty rotating cache's window
        lambda layers: layers[0]["attributes"].__delitem__("window"),
        lambda layers: layers[1]["attributes"].update(of_layer=-1, sub_cache=1),
        lambda layers: layers[1]["attributes"].update(of_layer="0", sub_cache=1),
        lambda layers: layers[0]["attributes"].update(cache_class="LayerCache", cache_module="os"),
        lambda layers: layers[0]["attributes"].update(cache_class="LayerCache", window_size="x"),
    ],
    ids=["window-text", "window-missing", "of-layer-negative", "of-layer-text", "module", "window-size"],
)
def test_attributes_a_file_should_not_have_are_one_named_error(tmp_path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Restore reads layer attributes from the file: anything but what capture writes is
    `UnsupportedModelError` naming it, never a KeyError or ValueError from deep inside."""
    from mlx_lm.models import cache as cache_module

    caches = [cache_module.RotatingKVCache(max_size=8, keep=2), cache_module.KVCache()]
    caches[1].update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    with (
        kvformat.open(_edited(tmp_path, caches, edit)) as snap,
        pytest.raises(UnsupportedModelError) as found,
    ):
        restore(snap)
    assert "\n" not in str(found.value)


def test_a_cache_whose_arrays_grow_restores_from_every_snapshot(tmp_path: Path) -> None:
    """DeepSeek-V4.1's LayerCache from a 2-token prompt: its window grows to 8 rows, a group of 4
    (or 2) closes every 4 (or 2) tokens, index keys appear once a group closes; each slot's axis 1
    is described as null (SPEC 15.4), the closed groups and index keys are stored once (each
    snapshot the rows added since its parent), and every snapshot of the series resumes exactly."""
    from mlx_lm.sample_utils import make_sampler

    from kvformat import state as stored_state
    from kvsnap.analysis.tools.state import state_rows
    from kvsnap.capture import generate
    from kvsnap.capture.tiny import build, byte_tokenizer

    model, tokenizer, greedy = build("deepseek_v41"), byte_tokenizer(), make_sampler(0.0)
    path = tmp_path / "v41.kv"
    full = list(generate(model, tokenizer, [3, 14], max_tokens=10, output=path, every=1, sampler=greedy))
    with kvformat.open(path) as snap:
        described = snap.layers[1].attributes["state"]
        assert [entry["shape"][1] for entry in described[:5]] == [None] * 5
        arrays = {a.role: a for a in stored_state.state_arrays(snap.layers) if a.layer == 1}
        window, groups = arrays["window"], arrays["compress_kv"]
        rows, closed = [], []
        for index in range(snap.num_snapshots):
            view = snap.select(index)
            rows.append(stored_state.read(view, window).shape[1])
            found = stored_state.read(view, groups)
            closed.append(0 if found is None else found.shape[1])
            done = view.snapshot_metadata["generated"]
            later = full[done : done + 2]
            if not later:  # the last snapshot: nothing after it to compare
                continue
            resumed = list(generate(model, tokenizer, [], max_tokens=len(later), resume=view, sampler=greedy))
            assert [r.token for r in resumed] == [r.token for r in later]
            for mine, theirs in zip(resumed, later, strict=True):
                np.testing.assert_array_equal(np.array(mine.logprobs), np.array(theirs.logprobs))
        # The closed groups are stored once: each snapshot holds the groups added since its parent.
        last = snap.select(snap.num_snapshots - 1)
        added = last.array(groups.name)
        assert added is not None and added.shape[0] == closed[-1] - closed[-2] < closed[-1]
        newest = last.array(window.name)  # the window: the one row its token added (it keeps 8)
        assert newest is not None and newest.shape[0] == 1
        held = sum(a.nbytes for r in arrays.values() if (a := last.array(r.name)) is not None)
    assert rows[0] < 8 and rows[-1] == 8 and rows == sorted(rows)
    assert closed[0] == 0 and closed[-1] > 1 and closed == sorted(closed)
    # The state statistics read each snapshot's own length: one row per snapshot holding groups.
    found = [r for r in state_rows(path) if r["layer"] == 1 and r["role"] == "compress_kv"]
    assert [r["rows"] for r in found] == [n for n in closed if n]
    assert all(r["dtype"] == "float32" and r["cols"] == 16 for r in found)
    # `info` names the growing axis and counts what the snapshot holds.
    info = subprocess.run([sys.executable, "-m", "kvsnap", "info", str(path)], capture_output=True, text=True)
    line = next(text for text in info.stdout.splitlines() if text.strip().startswith("layer   1:"))
    size = f"{held} B" if held < 1024 else f"{held / 1024:.1f} KiB"
    assert "window 1xnx16 float32 appended, compress_kv 1xnxn appended" in line  # not set at the start
    assert f"({size} in this snapshot)" in line


def test_a_window_that_moved_past_what_it_holds_between_snapshots_restores(tmp_path: Path) -> None:
    """Snapshots 9 tokens apart over an 8-row window: each stores the whole window (the rows it
    no longer holds are not needed), and resuming from each gives the uninterrupted tokens."""
    from mlx_lm.sample_utils import make_sampler

    from kvsnap.capture import generate
    from kvsnap.capture.tiny import build, byte_tokenizer

    model, tokenizer, greedy = build("deepseek_v41"), byte_tokenizer(), make_sampler(0.0)
    path = tmp_path / "apart.kv"
    full = list(generate(model, tokenizer, [3, 14], max_tokens=20, output=path, every=9, sampler=greedy))
    with kvformat.open(path) as snap:
        assert snap.num_snapshots >= 3
        for index in range(1, snap.num_snapshots - 1):
            view = snap.select(index)
            stored = view.array("state/0/0")
            assert stored is not None and stored.shape[0] == 8  # 9 rows added, 8 held
            done = view.snapshot_metadata["generated"]
            later = full[done : done + 2]
            resumed = list(generate(model, tokenizer, [], max_tokens=len(later), resume=view, sampler=greedy))
            assert [r.token for r in resumed] == [r.token for r in later]
            for mine, theirs in zip(resumed, later, strict=True):
                np.testing.assert_array_equal(np.array(mine.logprobs), np.array(theirs.logprobs))
