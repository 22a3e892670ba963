"""Series materialized with numpy, checked entry by entry: the same snapshots as the spec's
section 11 read literally (a dict of run lists per head, as the reader did before), for random
series with sliding windows, gaps and several sequences; bad series refused at the right one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvformat.errors import CorruptFileError
from kvformat.layout import DESCRIPTOR_DTYPE, KIND_K, KIND_V
from kvformat.series import Chain, Entry, trim, trim_runs


def reference(entries: list[Entry], table: np.ndarray, index: int) -> dict[tuple[int, int, int], list[Any]]:
    """Section 11 step by step: per (layer, seq, head), sorted (position, count, K chunk, K row,
    V chunk, V row)."""
    chain, cursor = [], index
    while cursor is not None:
        chain.append(cursor)
        cursor = entries[cursor].parent
    state: dict[tuple[int, int, int, int], list[tuple[int, int, int, int]]] = {}
    for i in reversed(chain):
        for layer, seq, start, stop in entries[i].drops:
            for key in state:
                if key[0] == layer and key[1] == seq:
                    state[key] = trim(state[key], start, stop)
        ranges = entries[i].chunk_ranges.tolist()
        whole = [(c, 0, int(table[c]["rows"])) for a, b in ranges for c in range(a, b)]
        for chunk, row, count in [*np.asarray(entries[i].appends).reshape(-1, 3).tolist(), *whole]:
            d = table[chunk]
            key = (int(d["layer"]), int(d["seq"]), int(d["head"]), int(d["kind"]))
            state.setdefault(key, []).append((chunk, row, count, int(d["position"]) + row))
    out: dict[tuple[int, int, int], list[Any]] = {}
    for (layer, seq, head, kind), runs in state.items():
        if kind != KIND_K or not runs:
            continue
        k = sorted(runs, key=lambda r: r[3])
        v = sorted(state[(layer, seq, head, KIND_V)], key=lambda r: r[3])
        out[(layer, seq, head)] = [(a[3], a[2], a[0], a[1], b[0], b[1]) for a, b in zip(k, v, strict=True)]
    return out


def random_series(path: Path, seed: int) -> None:
    """Appends of random sizes (gaps too) to 3 layers x 2 heads x 2 sequences, a sliding layer
    dropping what leaves its window, snapshots at random moments."""
    rng = np.random.default_rng(seed)
    specs = [kvformat.LayerSpec(2, 4, 4, kvformat.FLOAT32)] * 3
    with kvformat.Writer(path, specs, num_seqs=2, chunk_bytes=64) as w:
        next_position = np.zeros((3, 2), np.int64)
        for step in range(40):
            for layer in range(3):
                for seq in range(2):
                    if rng.random() < 0.3:
                        continue
                    count = int(rng.integers(1, 7))
                    start = int(next_position[layer, seq] + (rng.integers(0, 3) if rng.random() < 0.2 else 0))
                    data = rng.standard_normal((2, count, 4)).astype(np.float32)
                    w.append(layer, data, data + 1, np.arange(start, start + count), seq=seq)
                    next_position[layer, seq] = start + count
                    if layer == 1 and start + count > 10:  # a window of 10 keeping 2 sinks
                        w.drop(1, 2, start + count - 8, seq=seq)
            if rng.random() < 0.5 or step == 39:
                w.snapshot({"step": step})


@pytest.mark.parametrize("seed", range(6))
def test_numpy_materialization_equals_the_spec_read_literally(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "r.kv"
    random_series(path, seed)
    with kvformat.open(path) as snap:
        snap.verify()
        file = snap._file
        for index in range(snap.num_snapshots):
            expected = reference(file.entries, file.table, index)
            view = snap.select(index)
            got: dict[tuple[int, int, int], list[Any]] = {}
            for s in view.segments():
                got.setdefault((s.layer, s.seq, s.head), []).append(
                    (s.position, s.count, s.k_chunk, s.k_row, s.v_chunk, s.v_row)
                )
            assert {k: sorted(v) for k, v in got.items()} == expected, f"snapshot {index}"
            assert view.seq_len == max((r[-1][0] + r[-1][1] for r in expected.values()), default=0)
            for (layer, seq, head), runs in expected.items():
                head_data = view.head(layer, head, seq)
                assert head_data is not None
                positions = np.concatenate([np.arange(p, p + c) for p, c, *_ in runs])
                np.testing.assert_array_equal(head_data.positions, positions)
                np.testing.assert_array_equal(head_data.v, head_data.k + 1)


def test_recover_gives_back_the_same_heads(tmp_path: Path) -> None:
    path = tmp_path / "r.kv"
    random_series(path, 1)
    data = path.read_bytes()
    partial = tmp_path / "cut.kv.partial"
    partial.write_bytes(data[:-64])  # no footer: as if the writer died before its last step
    kvformat.recover(partial, tmp_path / "back.kv")
    with kvformat.open(path) as a, kvformat.open(tmp_path / "back.kv") as b:
        assert b.num_snapshots == a.num_snapshots
        for layer in range(3):
            for seq in range(2):
                for head in range(2):
                    x, y = a.head(layer, head, seq), b.head(layer, head, seq)
                    assert x is not None and y is not None
                    np.testing.assert_array_equal(x.positions, y.positions)
                    np.testing.assert_array_equal(x.k, y.k)


def _table(rows: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    """A chunk table of (kind, layer, seq, head, position) chunks of 4 rows each."""
    table = np.zeros(len(rows), DESCRIPTOR_DTYPE)
    for i, (kind, layer, seq, head, position) in enumerate(rows):
        table[i]["kind"], table[i]["layer"], table[i]["seq"] = kind, layer, seq
        table[i]["head"], table[i]["position"], table[i]["rows"] = head, position, 4
    return table


def test_check_all_finds_the_snapshot_that_holds_a_position_twice() -> None:
    table = _table([(KIND_K, 0, 0, 0, 0), (KIND_V, 0, 0, 0, 0), (KIND_K, 0, 0, 0, 2), (KIND_V, 0, 0, 0, 2)])
    good = Entry(None, [], [(0, 0, 4), (1, 0, 4)])
    again = Entry(0, [], [(2, 0, 4), (3, 0, 4)])  # positions 2..5: 2 and 3 are held already
    Chain([good], table).check_all()
    with pytest.raises(CorruptFileError, match=r"snapshot 1: .* holds position 2 twice"):
        Chain([good, again], table).check_all()
    after_drop = Entry(0, [(0, 0, 2, 4)], [(2, 0, 4), (3, 0, 4)])  # 2..3 dropped first: fine
    Chain([good, after_drop], table).check_all()


def test_check_all_finds_k_without_v() -> None:
    table = _table([(KIND_K, 0, 0, 0, 0), (KIND_V, 0, 0, 0, 0), (KIND_K, 0, 0, 1, 0)])
    with pytest.raises(CorruptFileError, match="snapshot 1: K and V of layer 0 head 1"):
        Chain([Entry(None, [], [(0, 0, 4), (1, 0, 4)]), Entry(0, [], [(2, 0, 4)])], table).check_all()


def test_trim_runs_equals_trim() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        runs = []
        position = 0
        for chunk in range(int(rng.integers(1, 6))):
            position += int(rng.integers(0, 3))
            count = int(rng.integers(1, 6))
            runs.append((chunk, int(rng.integers(0, 3)), count, position))
            position += count
        start = int(rng.integers(0, position + 2))
        stop = start + int(rng.integers(0, 8))
        expected = trim(runs, start, stop)
        array = np.array([[0, 0, 0, 0, c, r, n, p] for c, r, n, p in runs], np.int64)
        got = trim_runs(array, start, stop)
        assert [(c, r, n, p) for *_, c, r, n, p in got.tolist()] == expected


@pytest.mark.parametrize("where", ["payload", "descriptor"])
def test_recover_stops_at_the_first_damaged_chunk(tmp_path: Path, where: str) -> None:
    """A run of equal chunks is checked in bulk when recovering; one damaged record in the middle
    of it still ends the scan right before it."""
    path = tmp_path / "r.kv"
    specs = [kvformat.LayerSpec(4, 8, 8, kvformat.FLOAT16)] * 3
    data = np.ones((4, 5, 8), np.float16)
    with kvformat.Writer(path, specs) as w:
        for _ in range(6):
            w.append_many([(layer, data, data, None, 0) for layer in range(3)])
            w.snapshot()
    with kvformat.open(path) as snap:
        offset = int(snap._file.table["offset"][50])
    raw = bytearray(path.read_bytes()[:-64])
    raw[offset + (70 if where == "payload" else 20)] ^= 0x10
    partial = tmp_path / "bad.kv.partial"
    partial.write_bytes(bytes(raw))
    report = kvformat.recover(partial, tmp_path / "back.kv")
    assert report.chunks == 50  # chunks 0..49: the 50th is damaged
    with kvformat.open(tmp_path / "back.kv") as back:
        back.verify()
        assert back.num_snapshots == 3  # 24 chunks a snapshot: two complete, then what was after them


def test_opening_a_series_builds_no_snapshot(tmp_path: Path) -> None:
    """SPEC 13: open reads the index; a snapshot is materialized when first used, and a bad one
    still fails before any of its data is returned."""
    path = tmp_path / "s.kv"
    random_series(path, 1)
    with kvformat.open(path) as snap:
        file = snap._file
        assert "_segments" not in snap.__dict__ and file.chain._cache is None
        assert "_columns" not in file.chain.__dict__  # no per-chunk columns of the whole table
        view = snap.select(3)
        assert file.chain._cache is None
        assert view.head(0, 1) is not None and "_segments" in view.__dict__
