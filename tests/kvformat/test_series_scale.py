"""Series materialized with numpy, checked entry by entry: the same snapshots as the spec's
section 11 read literally (a dict of run lists per head, as the reader did before), for random
series with sliding windows, gaps and several sequences; bad series refused at the right one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvformat.checksum import crc32c, linear_crc
from kvformat.errors import CorruptFileError
from kvformat.layout import DESCRIPTOR_DTYPE, KIND_K, KIND_V
from kvformat.runs import trim_runs
from kvformat.series import Chain, Entry, trim


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
        # 24 chunks a snapshot: two complete; of the third only one head's K/V pair was written,
        # so no whole snapshot can be rebuilt from it and its 5 rows are left out
        assert back.num_snapshots == 2
    assert not report.recovered_snapshot and report.rows_left_out == 5 and report.cut_at == 10


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


def _equal_runs_series(path: Path, dim: int) -> None:
    """Snapshots appending one 16-row chunk per (layer, head, kind): runs of equal records."""
    specs = [kvformat.LayerSpec(3, dim, dim, kvformat.FLOAT16)] * 4
    rng = np.random.default_rng(dim)
    with kvformat.Writer(path, specs) as w:
        for _ in range(5):
            block = rng.standard_normal((4, 3, 16, dim)).astype(np.float16)
            w.append_many([(layer, block[layer], block[layer], None, 0) for layer in range(4)])
            w.snapshot()


_DAMAGES = ["payload", "descriptor", "descriptor CRC", "descriptor rewritten"]


# Records of 576 bytes (no padding), and of 160 bytes with 32 of padding.
@pytest.mark.parametrize(
    ("dim", "where"),
    [(16, w) for w in _DAMAGES] + [(3, w) for w in [*_DAMAGES, "padding", "padding the CRC cannot see"]],
)
def test_verify_checks_runs_of_equal_records_in_one_pass_and_names_the_damage(
    tmp_path: Path, dim: int, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean file is verified without the chunk-by-chunk path; one flipped byte anywhere in a
    run fails it with the error the record-by-record walk gives (the chunk named)."""
    from kvformat import verify as verifying

    path = tmp_path / "s.kv"
    _equal_runs_series(path, dim)
    slow = verifying._verify_chunks
    calls = []
    monkeypatch.setattr(verifying, "_verify_chunks", lambda *a: calls.append(a) or slow(*a))
    with kvformat.open(path) as snap:
        report = snap.verify()
        assert report.chunks == 5 * 4 * 3 * 2 and not calls
        offset = int(snap._file.table["offset"][30])
        payload_size = int(snap._file.table["stored_size"][30])
    shift = {"payload": 64 + 7, "descriptor": 24, "descriptor CRC": 61, "padding": 64 + payload_size + 5}
    raw = bytearray(path.read_bytes())
    if where == "descriptor rewritten":  # another position, with a CRC to match: not the index's
        raw[offset + 24] ^= 0x20
        raw[offset + 60 : offset + 64] = crc32c(bytes(raw[offset : offset + 60])).to_bytes(4, "little")
    elif where == "padding the CRC cannot see":  # 32 bytes whose CRC's linear part is 0
        start = offset + 64 + payload_size
        body = bytes(range(1, 29))
        raw[start : start + 32] = body + linear_crc(body).to_bytes(4, "little")
        assert linear_crc(bytes(raw[start : start + 32])) == 0
    else:
        raw[offset + shift[where]] ^= 0x20
    path.write_bytes(bytes(raw))
    expected = {
        "payload": (kvformat.ChecksumError, r"chunk 30 \(.*payload CRC-32C mismatch"),
        "descriptor": (kvformat.ChecksumError, f"record at offset {offset}: descriptor CRC-32C mismatch"),
        "descriptor CRC": (kvformat.ChecksumError, f"record at offset {offset}: descriptor CRC-32C mismatch"),
        "padding": (kvformat.CorruptFileError, r"chunk 30 \(.*non-zero padding"),
        "padding the CRC cannot see": (kvformat.CorruptFileError, r"chunk 30 \(.*non-zero padding"),
        "descriptor rewritten": (kvformat.CorruptFileError, "chunk 30 differs from its index copy"),
    }[where]
    with kvformat.open(path) as snap, pytest.raises(expected[0], match=expected[1]):
        snap.verify()


def _random_chain(rng: np.random.Generator) -> tuple[list[Entry], np.ndarray]:
    """Snapshots each appending, per head, a K and (mostly) a V chunk of 4 rows at the head's
    next position (sometimes a gap, a gap filled later, an overlap, a V at another position, a
    drop)."""
    rows: list[tuple[int, int, int, int, int]] = []
    entries: list[Entry] = []
    ends = {(layer, head): 0 for layer in range(2) for head in range(2)}
    holes: dict[tuple[int, int], list[int]] = {key: [] for key in ends}  # 4 free positions each
    for index in range(int(rng.integers(1, 7))):
        first = len(rows)
        drops: list[tuple[int, int, int, int]] = []
        for (layer, head), end in ends.items():
            if rng.random() < 0.2:
                continue
            chance = rng.random()
            if chance < 0.15 and holes[(layer, head)]:
                position = holes[(layer, head)].pop()  # a gap filled later: valid, not in order
            elif chance < 0.3:
                position = end + 4  # a gap
                holes[(layer, head)].append(end)
            elif chance < 0.4:
                position = max(end - int(rng.integers(1, 4)), 0)  # an overlap
            else:
                position = end
            v_position = position + (1 if rng.random() < 0.05 else 0)
            rows.append((KIND_K, layer, 0, head, position))
            if rng.random() > 0.05:
                rows.append((KIND_V, layer, 0, head, v_position))
            ends[(layer, head)] = max(end, position + 4)
        if index and rng.random() < 0.1:
            drops.append((0, 0, 0, 2))
        parent = index - 1 if index and rng.random() > 0.1 else None
        ranges = np.array([[first, len(rows)]], np.int64) if len(rows) > first else np.empty((0, 2), np.int64)
        entries.append(Entry(parent, drops, np.empty((0, 3), np.int64), chunk_ranges=ranges))
    return entries, _table(rows) if rows else np.zeros(0, DESCRIPTOR_DTYPE)


def test_check_all_in_bulk_accepts_and_rejects_what_snapshot_by_snapshot_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`check_all` checks stretches of appends together; whatever it accepts, the snapshot by
    snapshot check (the rules applied one snapshot at a time) accepts too, and the same errors."""
    from kvformat import series

    holds: list[bool] = []
    bulk_check = series._appends_hold
    monkeypatch.setattr(series, "_appends_hold", lambda *a: holds.append(bulk_check(*a)) or holds[-1])
    rng = np.random.default_rng(0)
    outcomes = {"ok": 0, "error": 0, "ok in bulk": 0, "ok, not shown in bulk": 0}
    for _ in range(400):
        entries, table = _random_chain(rng)
        holds.clear()

        def outcome(check: str, entries: list[Entry] = entries, table: np.ndarray = table) -> str:
            try:
                getattr(Chain(entries, table), check)()
            except CorruptFileError as exc:
                return str(exc)
            return "ok"

        bulk = outcome("check_all")
        shown = bool(holds) and all(holds)
        each = outcome("_check_each")
        assert bulk == each, (entries, table)
        outcomes["ok" if bulk == "ok" else "error"] += 1
        if bulk == "ok" and holds:
            outcomes["ok in bulk" if shown else "ok, not shown in bulk"] += 1
    # Valid and damaged files were made; valid ones were shown in bulk, and some (a gap filled
    # later) were left to the snapshot by snapshot check.
    assert outcomes["ok"] > 50 and outcomes["error"] > 50 and outcomes["ok in bulk"] > 10
    assert outcomes["ok, not shown in bulk"] > 3


def test_snapshots_that_append_nothing_verify(tmp_path: Path) -> None:
    """A stretch of snapshots with no new rows (metadata only), after data and before any."""
    table = _table([(KIND_K, 0, 0, 0, 0), (KIND_V, 0, 0, 0, 0)])
    empty = np.empty((0, 3), np.int64)
    Chain(
        [Entry(None, [], empty), Entry(0, [], empty), Entry(1, [], [(0, 0, 4), (1, 0, 4)])], table
    ).check_all()
    Chain(
        [Entry(None, [], [(0, 0, 4), (1, 0, 4)]), Entry(0, [], empty), Entry(1, [], empty)], table
    ).check_all()
    path = tmp_path / "quiet.kv"
    data = np.ones((2, 3, 4), np.float32)
    with kvformat.Writer(path, [kvformat.LayerSpec(2, 4, 4, kvformat.FLOAT32)]) as w:
        w.snapshot({"step": 0})
        w.append(0, data, data, np.arange(3))
        for step in range(1, 4):
            w.snapshot({"step": step})
    with kvformat.open(path) as snap:
        assert snap.verify().snapshots == 4
        assert snap.num_snapshots == 4


def test_check_all_refuses_a_huge_append_range_before_making_it() -> None:
    """A damaged ``append_chunks`` range far past the table is an error, not a range of 2^50
    chunk numbers made first (the bulk check and the per-snapshot one alike)."""
    table = _table([(KIND_K, 0, 0, 0, 0), (KIND_V, 0, 0, 0, 0)])
    empty = np.empty((0, 3), np.int64)
    good = Entry(None, [], empty, chunk_ranges=np.array([[0, 2]], np.int64))
    huge = Entry(0, [], empty, chunk_ranges=np.array([[0, 2**50]], np.int64))
    with pytest.raises(CorruptFileError, match=f"snapshot 1 appends chunk {2**50 - 1}; the file has 2"):
        Chain([good, huge], table).check_all()
    with pytest.raises(CorruptFileError, match=f"snapshot 1 appends chunk {2**50 - 1}; the file has 2"):
        Chain([good, huge], table).appended(1)


def _regular_chain(rng: np.random.Generator) -> tuple[list[Entry], np.ndarray]:
    """A series writer's shape: every snapshot appends one range of chunks, one per (layer,
    head, kind) in one fixed order (K and V side by side, or every K first), each at its head's
    end; now and then a gap (valid), an overlap, a V at another position, another order
    (valid), a head's K or V missing, a chunk of another layer, or an empty chunk."""
    heads = [(layer, head) for layer in range(2) for head in range(2)]
    rows: list[tuple[int, int, int, int, int]] = []
    sizes: list[int] = []
    entries: list[Entry] = []
    ends = dict.fromkeys(heads, 0)
    damage = rng.random() < 0.5
    split = rng.random() < 0.3  # every K chunk of a snapshot before its V chunks
    for index in range(int(rng.integers(2, 8))):
        first = len(rows)
        order = list(heads)
        if rng.random() < 0.1:
            rng.shuffle(order)  # another order: valid, but not the first snapshot's layout
        for layer, head in order:
            position = ends[(layer, head)]
            if rng.random() < 0.1:
                position += 4  # a gap: valid
            what = rng.choice(["overlap", "V elsewhere", "other layer", "no V", *["none"] * 60])
            what = what if damage else "none"
            if what == "overlap":
                position = max(position - 2, 0)
            k_layer = 1 - layer if what == "other layer" else layer
            rows.append((KIND_K, k_layer, 0, head, position))
            if what != "no V":
                rows.append((KIND_V, layer, 0, head, position + (what == "V elsewhere")))
            ends[(layer, head)] = max(ends[(layer, head)], position + 4)
        if split:
            rows[first:] = sorted(rows[first:], key=lambda row: row[0])
        sizes += [0 if damage and rng.random() < 0.01 else 4] * (len(rows) - first)
        ranges = np.array([[first, len(rows)]], np.int64)
        parent = index - 1 if index else None
        entries.append(Entry(parent, [], np.empty((0, 3), np.int64), chunk_ranges=ranges))
    table = _table(rows)
    table["rows"] = sizes
    return entries, table


def test_check_all_of_regular_series_accepts_and_rejects_what_snapshot_by_snapshot_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shortcut for a series writer's shape (`Chain._regular_appends_hold`: the chunk table
    seen as a (snapshots, chunks per snapshot) grid) gives what the snapshot by snapshot check
    gives, on valid and damaged series; what it cannot show goes the general way."""
    shown: list[bool] = []
    regular = Chain._regular_appends_hold
    monkeypatch.setattr(
        Chain, "_regular_appends_hold", lambda self, *a: shown.append(regular(self, *a)) or shown[-1]
    )
    rng = np.random.default_rng(1)
    outcomes = {"ok, shown": 0, "ok, not shown": 0, "error": 0}
    for _ in range(400):
        entries, table = _regular_chain(rng)
        shown.clear()
        try:
            Chain(entries, table).check_all()
            bulk = "ok"
        except CorruptFileError as exc:
            bulk = str(exc)
        try:
            Chain(entries, table)._check_each()
            each = "ok"
        except CorruptFileError as exc:
            each = str(exc)
        assert bulk == each, (entries, table)
        if bulk != "ok":
            assert True not in shown  # a problem is never shown valid
            outcomes["error"] += 1
        else:
            outcomes["ok, shown" if shown == [True] else "ok, not shown"] += 1
    assert outcomes["ok, shown"] > 100 and outcomes["error"] > 50 and outcomes["ok, not shown"] > 10


def test_verify_walks_only_the_records_between_runs_and_names_their_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean series is verified without a record-by-record step (its snapshot records, one
    between each two runs of chunks, are checked in bulk too); damage to a snapshot record, or
    its padding, is named as the walk in file order names it."""
    from kvformat import verify as verifying

    path = tmp_path / "s.kv"
    _equal_runs_series(path, 16)
    one_by_one = verifying._verify_record
    calls: list[int] = []
    monkeypatch.setattr(verifying, "_verify_record", lambda f, c, *a: calls.append(c) or one_by_one(f, c, *a))
    with kvformat.open(path) as snap:
        report = snap.verify()
        table = snap._file.table
        assert report.records - report.chunks == 6 and not calls  # the manifest and 5 snapshots
        after = int(table["offset"][23]) + 64 + int(table["stored_size"][23])  # the first snapshot
    record = bytes(path.read_bytes()[after : after + 64])
    stored = int.from_bytes(record[40:48], "little")

    def resealed(raw: bytearray) -> None:  # payload and descriptor CRCs made to match
        payload = bytes(raw[after + 64 : after + 64 + stored])
        raw[after + 56 : after + 60] = crc32c(payload).to_bytes(4, "little")
        raw[after + 60 : after + 64] = crc32c(bytes(raw[after : after + 60])).to_bytes(4, "little")

    for shift, error, message in [
        (64 + 1, kvformat.ChecksumError, f"record at offset {after}: payload CRC-32C mismatch"),
        (64 + stored, kvformat.CorruptFileError, f"record at offset {after}: non-zero padding"),
        (30, kvformat.ChecksumError, f"record at offset {after}: descriptor CRC-32C mismatch"),
        ("not JSON", kvformat.CorruptFileError, f"record at offset {after} is not valid JSON"),
        ("a manifest", kvformat.CorruptFileError, "the manifest must be the first record"),
    ]:
        raw = bytearray(path.read_bytes())
        if shift == "not JSON":
            raw[after + 64] = ord("[")
            resealed(raw)
        elif shift == "a manifest":
            raw[after + 4] = 16  # the record kind
            resealed(raw)
        else:
            assert isinstance(shift, int)
            raw[after + shift] ^= 0x01
        damaged = tmp_path / "damaged.kv"
        damaged.write_bytes(bytes(raw))
        with kvformat.open(damaged) as snap, pytest.raises(error, match=message):
            snap.verify()


def test_verify_refuses_a_chunk_before_the_manifest(tmp_path: Path) -> None:
    """The manifest must be the first record: a file whose first record is a chunk (the manifest
    moved after it, every offset and CRC made to match) fails verify, however fast the path."""
    from kvformat.layout import align
    from kvformat.rewrite import rebuild_index

    path = tmp_path / "s.kv"
    _equal_runs_series(path, 16)
    data = bytearray(path.read_bytes())
    with kvformat.open(path) as snap:
        chunk = int(snap._file.table["offset"][0])
        chunk_end = align(chunk + 64 + int(snap._file.table["stored_size"][0]))
    manifest, record = bytes(data[64:chunk]), bytes(data[chunk:chunk_end])

    def moved(descriptor: bytes, offset: int) -> bytes:
        body = descriptor[:32] + offset.to_bytes(8, "little") + descriptor[40:60]
        return body + crc32c(body).to_bytes(4, "little")

    record = moved(record[:64], 64) + record[64:]
    manifest = moved(manifest[:64], 64 + len(record)) + manifest[64:]
    data[64:chunk_end] = record + manifest
    swapped = tmp_path / "swapped.kv"
    swapped.write_bytes(bytes(data))
    fixed = tmp_path / "fixed.kv"

    def first_at_64(table: np.ndarray) -> None:
        table["offset"][0] = 64

    rebuild_index(swapped, fixed, edit_table=first_at_64)
    with (
        kvformat.open(fixed) as snap,
        pytest.raises(kvformat.CorruptFileError, match="the manifest must be the first record"),
    ):
        snap.verify()


def test_verify_refuses_a_descriptor_equal_to_a_wrong_index_copy_in_its_crc_only(tmp_path: Path) -> None:
    """Descriptors are shown equal to their index copies through their CRC fields, which needs
    the table's own CRCs to hold: a file descriptor rewritten with a valid CRC, and its index
    copy given that CRC over its old bytes (the index CRC made to match), fails verify."""
    from kvformat.rewrite import rebuild_index

    path = tmp_path / "s.kv"
    _equal_runs_series(path, 16)
    with kvformat.open(path) as snap:
        offset = int(snap._file.table["offset"][30])
    raw = bytearray(path.read_bytes())
    raw[offset + 24] ^= 0x20  # another position, with a CRC to match
    crc = crc32c(bytes(raw[offset : offset + 60]))
    raw[offset + 60 : offset + 64] = crc.to_bytes(4, "little")
    rewritten = tmp_path / "rewritten.kv"
    rewritten.write_bytes(bytes(raw))

    def same_crc(table: np.ndarray) -> None:
        table["descriptor_crc"][30] = crc

    damaged = tmp_path / "damaged.kv"
    rebuild_index(rewritten, damaged, edit_table=same_crc, descriptor_crcs=False)
    with (
        kvformat.open(damaged) as snap,
        pytest.raises(kvformat.CorruptFileError, match="chunk 30 differs from its index copy"),
    ):
        snap.verify()


@pytest.mark.parametrize("dim", [16, 3])
def test_verify_of_a_series_in_one_pass_reports_what_the_walk_reports_and_misses_no_flipped_byte(
    tmp_path: Path, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one CRC pass over a series (`_StreamChecksum`, `_check_all_but_the_stream`) is taken
    for a clean file and reports what the walk in file order reports; a byte flipped anywhere in
    the record stream (descriptor, payload, padding, snapshot record) is never passed."""
    from kvformat import verify as verifying

    path = tmp_path / "s.kv"
    _equal_runs_series(path, dim)
    one_pass = verifying._check_all_but_the_stream
    taken: list[object] = []
    monkeypatch.setattr(
        verifying, "_check_all_but_the_stream", lambda *a: taken.append(one_pass(*a)) or taken[-1]
    )
    with kvformat.open(path) as snap:
        fast = snap.verify()
        end = snap._file.footer.index_offset
    assert taken and taken[0] is not None
    monkeypatch.setattr(verifying, "_check_all_but_the_stream", lambda *a: None)
    with kvformat.open(path) as snap:
        assert snap.verify() == fast
    monkeypatch.setattr(verifying, "_check_all_but_the_stream", one_pass)
    clean = path.read_bytes()
    rng = np.random.default_rng(dim)
    damaged = tmp_path / "damaged.kv"
    for where in rng.integers(64, end, 150).tolist():
        raw = bytearray(clean)
        raw[where] ^= 1 << int(rng.integers(0, 8))
        damaged.write_bytes(bytes(raw))
        with kvformat.open(damaged) as snap, pytest.raises(kvformat.KVFormatError):
            snap.verify()


def test_verify_of_a_series_from_a_file_object_equals_the_memory_map(tmp_path: Path) -> None:
    """verify reads on two threads: a file object source (one file position) gives the report
    and the error the memory map gives."""
    path = tmp_path / "s.kv"
    _equal_runs_series(path, 3)
    with kvformat.open(path) as snap:
        mapped = snap.verify()
        offset = int(snap._file.table["offset"][40])
    for _ in range(5):
        with open(path, "rb") as f, kvformat.open(f) as snap:
            assert snap.verify() == mapped
    raw = bytearray(path.read_bytes())
    raw[offset + 70] ^= 2
    path.write_bytes(bytes(raw))
    with (
        open(path, "rb") as f,
        kvformat.open(f) as snap,
        pytest.raises(kvformat.ChecksumError, match="chunk 40"),
    ):
        snap.verify()


def test_a_file_object_source_reads_the_right_bytes_from_many_threads(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kvformat.io.source import FileObjectSource

    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "bytes.bin"
    path.write_bytes(data)
    with open(path, "rb") as f:
        source = FileObjectSource(f)

        def reads(seed: int) -> bool:
            rng = np.random.default_rng(seed)
            for _ in range(300):
                offset, size = int(rng.integers(0, 1 << 19)), int(rng.integers(1, 1 << 16))
                if bytes(source.read(offset, size)) != data[offset : offset + size]:
                    return False
            return True

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(reads, range(8)))


def test_verify_from_a_file_object_reads_the_file_about_once(tmp_path: Path) -> None:
    """The one pass reads a file-object source's record stream once (plus the records between
    runs), never the whole stream again to look at a few records."""
    import io

    path = tmp_path / "s.kv"
    _equal_runs_series(path, 16)
    data = path.read_bytes()

    class Counting(io.BytesIO):
        read_bytes = 0

        def readinto(self, buffer: Any) -> int:
            n = super().readinto(buffer)
            Counting.read_bytes += n
            return n

    with kvformat.open(Counting(data)) as snap:
        Counting.read_bytes = 0
        snap.verify()
    assert len(data) < Counting.read_bytes < 1.3 * len(data)
