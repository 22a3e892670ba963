"""A `Writer` run in a child process (`kvformat.writer_process`) writes the very bytes the
`Writer` writes in-process, raises the child's errors in the parent by class, and leaves a
recoverable ``.partial`` file when either side goes away."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import kvformat
from kvformat import writer_process
from kvformat.errors import InvalidArrayError, WriterProcessError
from kvformat.writer_process import WriterProcess

SPECS = [
    kvformat.LayerSpec(2, 8, 8, kvformat.BFLOAT16),
    None,
    kvformat.LayerSpec(3, 4, 6, kvformat.FLOAT32),
]


def _calls(rng: np.random.Generator) -> list[tuple[str, Any]]:
    """Three snapshots of appends (bfloat16, float32, strided V, a gap in positions), a drop,
    snapshot arrays and metadata."""
    calls: list[tuple[str, Any]] = []
    start = 0
    for step, count in enumerate((5, 3, 4)):
        positions = np.arange(start, start + count, dtype=np.int64)
        if step == 2:
            positions = positions + 2  # a gap
        k0 = rng.standard_normal((2, count, 8)).astype(ml_dtypes.bfloat16)
        v0 = rng.standard_normal((count, 2, 8)).astype(ml_dtypes.bfloat16).transpose(1, 0, 2)  # strided
        k2 = rng.standard_normal((3, count, 4)).astype(np.float32)
        v2 = rng.standard_normal((3, count, 6)).astype(np.float32)
        calls.append(("append_many", [(0, k0, v0, positions, 0), (2, k2, v2, positions, 0)]))
        if step == 1:
            calls.append(("drop", (2, 0, 2)))
        state = {"logits": rng.standard_normal((1, 7)).astype(np.float32)}
        calls.append(("snapshot", ({"generated": step, "text": ["é"]}, state)))
        start = int(positions[-1]) + 1
    return calls


def _replay(writer: Any, calls: list[tuple[str, Any]]) -> list[int]:
    indices = []
    for name, args in calls:
        if name == "append_many":
            writer.append_many(args)
        elif name == "drop":
            writer.drop(*args)
        else:
            indices.append(writer.snapshot(args[0], arrays=args[1]))
    return indices


@pytest.mark.parametrize("flush_bytes", [64 << 20, 100])
def test_the_writer_process_writes_the_bytes_the_writer_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flush_bytes: int
) -> None:
    """Also when every append goes to the child on its own (``FLUSH_BYTES`` below one layer)."""
    monkeypatch.setattr(writer_process, "FLUSH_BYTES", flush_bytes)
    calls = _calls(np.random.default_rng(5))
    here, there = tmp_path / "here.kv", tmp_path / "there.kv"
    writer = kvformat.Writer(here, SPECS, metadata={"name": "série"}, durable=False)
    assert _replay(writer, calls) == [0, 1, 2]
    writer.close({"generated_text": "fin"})
    process = WriterProcess()
    process.open(there, SPECS, metadata={"name": "série"}, durable=False)
    assert _replay(process, calls) == [0, 1, 2]
    process.close({"generated_text": "fin"})
    assert here.read_bytes() == there.read_bytes()
    with kvformat.open(there) as snap:
        assert snap.num_snapshots == 3 and snap.metadata["generated_text"] == "fin"


def test_an_error_in_the_child_is_raised_in_the_parent_by_its_class(tmp_path: Path) -> None:
    process = WriterProcess()
    process.open(tmp_path / "bad.kv", SPECS, durable=False)
    k = np.zeros((2, 3, 5), ml_dtypes.bfloat16)  # dim 5, the layer's is 8
    process.append_many([(0, k, k, np.arange(3), 0)])
    with pytest.raises(InvalidArrayError, match="layer 0"):
        process.snapshot({})
    with pytest.raises(WriterProcessError, match="earlier request failed"):
        process.snapshot({})  # nothing more is written after a failure
    process.leave_partial()
    assert (tmp_path / "bad.kv.partial").exists() and not (tmp_path / "bad.kv").exists()


def test_an_existing_output_is_refused_in_the_child(tmp_path: Path) -> None:
    target = tmp_path / "there.kv"
    target.write_bytes(b"not mine")
    process = WriterProcess()
    process.open(target, SPECS)
    with pytest.raises(OSError):
        process.snapshot({})
    process.leave_partial()
    assert target.read_bytes() == b"not mine"


def _written(tmp_path: Path, name: str) -> tuple[WriterProcess, list[tuple[str, Any]], Path]:
    calls = _calls(np.random.default_rng(9))
    process = WriterProcess()
    path = tmp_path / name
    process.open(path, SPECS, durable=False)
    _replay(process, calls[:2])  # the first snapshot written
    return process, calls, path


def test_a_parent_gone_leaves_the_child_s_partial_file_recoverable(tmp_path: Path) -> None:
    process, _, path = _written(tmp_path, "orphan.kv")
    child = process._child
    assert child.stdin is not None
    child.stdin.close()  # what the parent's exit does to the pipe
    assert child.wait(timeout=30) == 0
    partial = Path(f"{path}.partial")
    kvformat.recover(partial, path)
    with kvformat.open(path) as snap:
        assert snap.num_snapshots == 1 and snap.select(0).snapshot_metadata["generated"] == 0


def test_a_child_gone_is_one_clear_error_in_the_parent(tmp_path: Path) -> None:
    process, calls, path = _written(tmp_path, "killed.kv")
    os.kill(process._child.pid, signal.SIGKILL)
    process._child.wait(timeout=30)
    process.append_many(calls[2][1])
    with pytest.raises(WriterProcessError, match="writer process stopped"):
        process.snapshot({})
    process.leave_partial()  # nothing left to tell: no second error
    assert Path(f"{path}.partial").exists()


def test_metadata_that_is_not_json_is_refused_as_the_writer_refuses_it(tmp_path: Path) -> None:
    """The same error class as `Writer`'s, and both go on: the next snapshot is number 0."""
    process = WriterProcess()
    process.open(tmp_path / "there.kv", SPECS, durable=False)
    writer = kvformat.Writer(tmp_path / "here.kv", SPECS, durable=False)
    for target in (writer, process):
        with pytest.raises(kvformat.errors.InvalidLayoutError, match="plain JSON"):
            target.snapshot({"x": float("nan")})
        assert target.snapshot({"x": 1}) == 0
        target.close()
    assert (tmp_path / "here.kv").read_bytes() == (tmp_path / "there.kv").read_bytes()
