"""A series file written snapshot by snapshot from cache deltas (on the writer thread)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import kvformat
from kvformat.writer_process import WriterProcess, sync

from .deltas import LayerDelta

SYNC_EACH = "writeback"
"""What each snapshot does for durability while generation goes on: ``"writeback"`` starts the
kernel writing it to disk without waiting (``posix_fadvise(DONTNEED)``), so the fsync at close
has little left; ``"fdatasync"`` waits until it is on disk; ``"none"`` leaves it all to close."""


class SeriesWriter:
    """Appends snapshots to one `.kv` file: each one the drops and new rows of every layer
    (`capture.deltas`), so shared chunks are stored once and a snapshot costs what it adds.
    With ``process`` (a started `WriterProcess`) the file is written by that child process,
    so the writing's Python does not hold this process's interpreter lock; else here."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        codec: str,
        metadata: dict[str, Any],
        specs: list[kvformat.LayerSpec],
        num_seqs: int,
        durable: bool = True,
        overwrite: bool = False,
        process: WriterProcess | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.num_seqs = num_seqs
        options: dict[str, Any] = {"num_seqs": num_seqs, "metadata": metadata, "codec": codec}
        options.update(durable=durable, overwrite=overwrite)
        self.writer: kvformat.Writer | WriterProcess
        if process is not None:
            process.open(self.path, specs, **options)
            self.writer = process
        else:
            self.writer = kvformat.Writer(self.path, specs, **options)

    def add(
        self,
        deltas: list[LayerDelta],
        host: list[np.ndarray],
        metadata: dict[str, Any],
        last_logits: np.ndarray | None = None,
        state: dict[str, np.ndarray] | None = None,
    ) -> int:
        """Write one snapshot: ``host`` holds the host copies of every delta's device arrays in
        order (keys then values, layer by layer); ``state`` the recurrent state arrays by name
        (SPEC 15.4). Returns the snapshot's index."""
        writer = self.writer
        appends: list[tuple[int, Any, Any, Any, int]] = []
        cursor = 0
        for delta in deltas:
            if delta.host is not None:  # compared on the host (batch caches)
                appends += self._host_delta(delta)
                continue
            for start, stop in delta.drops:
                for seq in range(self.num_seqs):
                    writer.drop(delta.layer, start, stop, seq=seq)
            n = delta.arrays_per_side
            keys, values = host[cursor : cursor + n], host[cursor + n : cursor + 2 * n]
            cursor += 2 * n
            if delta.positions.size:
                appends += _per_sequence(delta.layer, keys, values, delta.positions)
        writer.append_many(appends)
        arrays = dict(state or {})
        if last_logits is not None:
            arrays["last_logits"] = last_logits
        if isinstance(writer, WriterProcess):
            return writer.snapshot(metadata, arrays=arrays, sync=SYNC_EACH)
        index = writer.snapshot(metadata, arrays=arrays)
        if writer.durable:
            sync(writer.fileno(), SYNC_EACH)
        return index

    def _host_delta(self, delta: LayerDelta) -> list[tuple[int, Any, Any, Any, int]]:
        """A delta compared on the host (batch caches): its drops written, its appends."""
        for seq, start, stop in delta.host_drops:
            self.writer.drop(delta.layer, start, stop, seq=seq)
        assert delta.host is not None
        return [
            (delta.layer, k, v, positions, seq)
            for seq, (k, v, positions) in enumerate(delta.host)
            if positions.size
        ]

    def add_queries(self, queries: list[tuple[int, np.ndarray, np.ndarray, bool]]) -> None:
        """Write queries (format 1.3) for the next snapshot: ``(layer, q, positions, False)`` with
        ``q`` ``(batch, query_heads, n, dim)`` host arrays, and a sparse layer's key selections
        (1.7): ``(layer, chosen, positions, True)``, ``chosen`` ``(batch, 1, n, k)``."""
        for layer, q, positions, selected in queries:
            for seq in range(q.shape[0]):
                if selected:
                    self.writer.append_selection(layer, q[seq, 0], positions, seq=seq)
                else:
                    self.writer.append_queries(layer, q[seq], positions, seq=seq)

    def close(self, metadata: dict[str, Any] | None = None) -> None:
        self.writer.close(metadata)

    def leave_partial(self) -> None:
        """Stop without an index: the ``.partial`` file stays, for `kvsnap recover`."""
        if isinstance(self.writer, WriterProcess):
            self.writer.leave_partial()
        else:
            self.writer.__exit__(RuntimeError, None, None)


def _per_sequence(
    layer: int, keys: list[np.ndarray], values: list[np.ndarray], positions: np.ndarray
) -> list[tuple[int, Any, Any, Any, int]]:
    """One layer's host K/V ``(batch, heads, n, dim)`` as an append per sequence; a quantized
    layer's as its ``(packed, scales, biases)`` tuples."""
    if len(keys) == 1:
        return [(layer, keys[0][seq], values[0][seq], positions, seq) for seq in range(keys[0].shape[0])]
    return [
        (layer, tuple(x[seq] for x in keys), tuple(x[seq] for x in values), positions, seq)
        for seq in range(keys[0].shape[0])
    ]
