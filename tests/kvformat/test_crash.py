"""Crash test: SIGKILL the writer at random moments. The destination never holds a file with
wrong data; the `.partial` left behind recovers into a valid file of complete chunks."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvformat
from tests import crash_writer
from tests.conftest import pattern

ROOT = Path(__file__).resolve().parents[2]


def check_contents(path: Path) -> int:
    """Every snapshot holds positions 0..n-1 on every head, and the first, middle and last
    snapshots hold exactly the pattern for those positions; return n of the last snapshot."""
    with kvformat.open(path) as snap:
        snap.verify()
        last = snap.num_snapshots - 1
        for index in range(snap.num_snapshots):
            view = snap.select(index)
            assert view.incomplete == ()
            for layer in range(2):
                for head_index in range(2):
                    positions = view.positions(layer, head_index)
                    assert positions is not None
                    # every head of a snapshot holds the same positions: none stops short
                    assert positions.tolist() == list(range(view.seq_len))
            if index in (0, last // 2, last):
                for head in view.heads():
                    assert np.array_equal(head.k, pattern(head.layer, head.head, head.positions, 32, "k"))
                    assert np.array_equal(head.v, pattern(head.layer, head.head, head.positions, 32, "v"))
        first = snap.head(0, 0)
        assert first is not None
        return int(first.positions.size)


@pytest.fixture(scope="module")
def writers() -> multiprocessing.context.ForkServerContext:
    """Writer processes forked from a server that has imported numpy and kvformat once (a fresh
    interpreter per trial spent most of this test's time starting up); each is a separate process
    killed with SIGKILL, as before."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.crash_writer"])
    return context


@pytest.mark.parametrize("codec", ["raw", "zstd", "raw+pipelined"])
def test_killed_writer_never_leaves_wrong_data(
    tmp_path: Path, codec: str, writers: multiprocessing.context.ForkServerContext
) -> None:
    rng = np.random.default_rng(len(codec))
    outcomes = {"finished": 0, "recovered": 0, "nothing": 0}
    # At least 12 trials, and on until 4 recoveries (a loaded machine's writer finishes more often
    # before the kill comes), 40 at most.
    for trial in range(40):
        if trial >= 12 and outcomes["recovered"] >= 4:
            break
        path = tmp_path / f"trial{trial}.kv"
        partial = Path(str(path) + ".partial")
        proc = writers.Process(target=crash_writer.main, args=(str(path), 400, codec))
        proc.start()
        # Wait for the process to start writing, then kill it a random moment later.
        deadline = time.monotonic() + 30
        while not partial.exists() and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(float(rng.uniform(0.0, 0.25)))
        proc.kill()  # SIGKILL (nothing if it has finished)
        proc.join()
        if path.exists():
            check_contents(path)
            outcomes["finished"] += 1
        if partial.exists():
            assert not path.exists()
            try:
                kvformat.open(partial).close()
                check_contents(partial)  # killed between the footer and the rename: complete
            except kvformat.KVFormatError:
                pass
            try:
                report = kvformat.recover(partial)
            except kvformat.TruncatedFileError:
                # killed before the manifest record, or before every head of the first snapshot,
                # was complete: nothing whole to keep, and nothing written
                assert not path.exists()
                outcomes["nothing"] += 1
                continue
            assert report.path == str(path) and partial.exists()  # the input is only read
            tokens = check_contents(path)
            assert tokens >= 24 * (report.snapshots - 1 - int(report.recovered_snapshot))
            outcomes["recovered"] += 1
    assert outcomes["recovered"] >= 4, outcomes


def test_recover_is_idempotent_after_partial_recovery(tmp_path: Path) -> None:
    """A crash during recover (simulated: index half-written) can be recovered again."""
    path = tmp_path / "r.kv"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.crash_writer", str(path), "3", "raw"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
    )
    assert proc.returncode == 0
    data = path.read_bytes()
    with kvformat.open(path) as snap:
        index_offset = snap._file.footer.index_offset
    partial = tmp_path / "r2.kv.partial"
    partial.write_bytes(data[: index_offset + 200])  # records + a torn index
    report = kvformat.recover(partial)
    assert report.snapshots == 3 and not report.recovered_snapshot
    assert check_contents(tmp_path / "r2.kv") == 72
    with pytest.raises(FileExistsError):
        partial.write_bytes(data[: index_offset + 10])
        kvformat.recover(partial)
