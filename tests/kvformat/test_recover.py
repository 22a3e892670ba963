"""`kvformat.recover` of a file cut anywhere: every snapshot it writes is whole (every head of every
present layer holds the same positions), or it refuses with `IncompleteRecoveryError`; a snapshot
an earlier recover left uneven is refused by `head`, `segments`, `verify` and named by `info`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvformat
from tests import crash_writer
from tests.conftest import pattern

ROOT = Path(__file__).resolve().parents[2]


def _record_ends(path: Path) -> list[int]:
    """The end of every record of a finished file before its index (descriptor + payload)."""
    with kvformat.open(path) as snap:
        table = snap._file.table
        index_offset = snap._file.footer.index_offset
    ends = sorted({int(o) + 64 + int(s) for o, s in zip(table["offset"], table["stored_size"], strict=True)})
    return [e for e in ends if e < index_offset]


def test_a_file_cut_anywhere_recovers_only_whole_snapshots(tmp_path: Path) -> None:
    """Cut a 3-snapshot series (2 layers x 2 heads, 3 chunks per head and step) after every
    table record and half-way into the next: the recovered file verifies, every snapshot holds
    positions 0..n-1 on every head with the writer's values, and rows past the least head's end
    are reported as left out; before the first snapshot is whole nothing is written."""
    full = tmp_path / "full.kv"
    crash_writer.main(str(full), 3, "raw")
    data = full.read_bytes()
    ends = _record_ends(full)
    outcomes = {"refused": 0, "cut": 0, "whole": 0}
    for end in ends[::2] + [e + 100 for e in ends[1::5]]:
        partial = tmp_path / "cut.kv.partial"
        partial.write_bytes(data[:end])
        out = tmp_path / "cut.kv"
        if out.exists():
            out.unlink()
        try:
            report = kvformat.recover(partial, out)
        except kvformat.IncompleteRecoveryError as exc:
            assert "no snapshot is complete" in str(exc)
            assert not out.exists()
            outcomes["refused"] += 1
            continue
        with kvformat.open(out) as snap:
            snap.verify()
            for index in range(snap.num_snapshots):
                view = snap.select(index)
                assert view.incomplete == ()
                for head in view.heads():
                    assert head.positions.tolist() == list(range(view.seq_len))
                    np.testing.assert_array_equal(
                        head.k, pattern(head.layer, head.head, head.positions, 32, "k")
                    )
        if report.rows_left_out:
            assert report.cut_at is not None and report.short_layers
            assert f"ends at position {report.cut_at}" in report.describe_cut()
            outcomes["cut"] += 1
        else:
            outcomes["whole"] += 1
    assert min(outcomes.values()) >= 1, outcomes


def _uneven_recovered(path: Path) -> None:
    """A file as an earlier recover could leave it: a snapshot marked recovered whose layer 1
    stops at position 4 while layer 0 reaches 8."""
    spec = kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT32)
    k = np.ones((2, 8, 8), np.float32)
    with kvformat.Writer(path, [spec, spec]) as w:
        w.append(0, k, k)
        w.append(1, k[:, :4], k[:, :4])
        w.snapshot({"recovered": True})


def test_an_uneven_recovered_snapshot_is_refused_not_read_short(tmp_path: Path) -> None:
    path = tmp_path / "old.kv"
    _uneven_recovered(path)
    with kvformat.open(path) as snap:
        assert [(layer, head, end) for layer, _, head, end in snap.incomplete] == [(1, 0, 4), (1, 1, 4)]
        assert "layer(s) 1 stop before position 8" in snap.describe_incomplete()
        assert snap.head(0, 1) is not None and snap.head(0, 1).k.shape == (8, 8)  # type: ignore[union-attr]
        with pytest.raises(kvformat.IncompleteSnapshotError, match="layer 1 head 0 ends at position 4"):
            snap.head(1, 0)
        with pytest.raises(kvformat.IncompleteSnapshotError):
            snap.segments()
        with pytest.raises(kvformat.IncompleteSnapshotError):
            snap.verify()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "kvsnap"]
    verify = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True, env=env)
    assert verify.returncode != 0 and "incomplete" in verify.stderr
    assert "Traceback" not in verify.stderr and len(verify.stderr.strip().splitlines()) == 1
    info = subprocess.run([*cli, "info", str(path)], capture_output=True, text=True, env=env)
    assert info.returncode == 0 and "INCOMPLETE: snapshot 0 was rebuilt from a cut file" in info.stdout
