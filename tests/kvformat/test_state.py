"""Recurrent state read back (SPEC 15.4): a slot of fixed shape, and one whose axis 1 grows
between snapshots (``null`` in its description), read with the length each snapshot stores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat import state

GROWING = [
    {"shape": [1, None, 4], "dtype": "float32", "heads": None, "role": "window"},
    {"shape": [1, None, None], "dtype": None, "heads": None, "role": "compress_kv"},
    {"shape": [1, 2], "dtype": "int64", "heads": None, "role": "offset"},
]


def test_a_growing_slot_reads_each_snapshot_s_own_length(tmp_path: Path) -> None:
    attributes = {"kind": "compressed", "state": GROWING}
    spec = kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32, attributes, present=False)
    path = tmp_path / "grow.kv"
    windows = [np.arange(n * 4, dtype=np.float32).reshape(n, 4) for n in (1, 3, 3)]
    with kvformat.Writer(path, [spec]) as writer:
        for n, window in enumerate(windows):
            arrays = {"state/0/0": window, "state/0/2": np.array([[n, 7]], np.int64).view(np.float32)}
            if n:  # the slot not set until the second snapshot, then 2 rows of 6
                arrays["state/0/1"] = np.ones((2, 6), np.float16)
            writer.snapshot(arrays=arrays)
    with kvformat.open(path) as snap:
        window, groups, offset = state.state_arrays(snap.layers)
        assert window.grows and groups.grows and not offset.grows
        for n, expected in enumerate(windows):
            view = snap.select(n)
            np.testing.assert_array_equal(state.read(view, window), expected[None])
            found = state.read(view, groups)
            assert found is None if n == 0 else (found.shape, found.dtype) == ((1, 2, 6), np.float16)
            np.testing.assert_array_equal(state.read(view, offset), [[n, 7]])


@pytest.mark.parametrize(
    "shape",
    [[1, 2, None], [None, 2], [1, None, 2, 3], [1, None, None, 2]],
)
def test_only_axis_1_and_then_axis_2_of_a_3_axis_slot_may_grow(shape: list) -> None:  # type: ignore[type-arg]
    entry = {"shape": shape, "dtype": "float32", "heads": None}
    with pytest.raises(kvformat.CorruptFileError, match="not a state description"):
        state.checked(0, [entry])


def test_an_untyped_slot_must_grow() -> None:
    with pytest.raises(kvformat.CorruptFileError, match="not a state description"):
        state.checked(0, [{"shape": [1, 3, 4], "dtype": None, "heads": None}])
    assert state.checked(0, [{"shape": [1, None, None], "dtype": None, "heads": None}])


def test_a_chunk_that_is_no_whole_rows_of_the_slot_is_corrupt() -> None:
    assert state.grown_shape((2, None, 4), (6, 4)) == (2, 3, 4)
    assert state.grown_shape((2, None, 4), (5, 4)) is None
    assert state.grown_shape((2, None, 4), (6, 5)) is None
    assert state.grown_shape((1, None), (1, 9)) == (1, 9)


def test_an_appended_slot_is_the_rows_of_its_whole_parent_chain(tmp_path: Path) -> None:
    """Two sequences: each snapshot stores the rows it added, ``(S * n, b)`` batch-major; the
    array is the chain's rows along axis 1, oldest first (a snapshot adding none stores none)."""
    described = [{"shape": [2, None, 3], "dtype": "float32", "heads": None, "role": "groups", "append": True}]
    attributes = {"kind": "compressed", "state": described}
    spec = kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32, attributes, present=False)
    full = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
    path = tmp_path / "append.kv"
    with kvformat.Writer(path, [spec]) as writer:
        for low, high in ((0, 2), (2, 2), (2, 5)):
            added = full[:, low:high]
            writer.snapshot(arrays={"state/0/0": added.reshape(-1, 3)} if high > low else {})
    with kvformat.open(path) as snap:
        (groups,) = state.state_arrays(snap.layers)
        assert groups.append
        found = [state.read(snap.select(i), groups) for i in range(3)]
    np.testing.assert_array_equal(found[0], full[:, :2])
    np.testing.assert_array_equal(found[1], full[:, :2])
    np.testing.assert_array_equal(found[2], full)


def test_only_a_growing_3_axis_slot_may_be_appended() -> None:
    for entry in (
        {"shape": [1, 4, 3], "dtype": "float32", "heads": None, "append": True},
        {"shape": [1, None], "dtype": "float32", "heads": None, "append": True},
        {"shape": [1, None, 3], "dtype": "float32", "heads": None, "append": "yes"},
    ):
        with pytest.raises(kvformat.CorruptFileError, match="not a state description"):
            state.checked(0, [entry])


def test_a_window_is_the_last_rows_of_its_chain(tmp_path: Path) -> None:
    """``last``: the array is the last rows the chain appended; reading stops at the snapshot
    whose rows reach that many."""
    described = [
        {
            "shape": [1, None, 2],
            "dtype": "float32",
            "heads": None,
            "role": "window",
            "append": True,
            "last": 3,
        }
    ]
    spec = kvformat.LayerSpec(
        1, 4, 4, kvformat.FLOAT32, {"kind": "compressed", "state": described}, present=False
    )
    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    path = tmp_path / "window.kv"
    with kvformat.Writer(path, [spec]) as writer:
        for low, high in ((0, 2), (2, 6), (6, 7), (7, 10)):
            writer.snapshot(arrays={"state/0/0": rows[max(low, high - 3) : high]})  # at most 3 kept
    with kvformat.open(path) as snap:
        (window,) = state.state_arrays(snap.layers)
        assert window.last == 3
        expected = [rows[:2], rows[3:6], rows[4:7], rows[7:10]]
        for index, want in enumerate(expected):
            np.testing.assert_array_equal(state.read(snap.select(index), window), want[None])
    with pytest.raises(kvformat.CorruptFileError, match="not a state description"):
        state.checked(0, [{**described[0], "append": False}])  # last without append
    with pytest.raises(kvformat.CorruptFileError, match="not a state description"):
        state.checked(0, [{**described[0], "last": 0}])
