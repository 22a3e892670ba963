"""How much the mlx backend asks of a machine: worker processes (bounded by memory), copy and row
threads, and the bytes of one device batch."""

from __future__ import annotations

import os
import sys

from kvformat.errors import InvalidArgumentError

from ..machine import cores

PROCESS_SHARE = 3 / 4
"""Worker processes an mlx pass over a local file uses, per worker asked for (`analysis.engine.processes`):
each drives the device with its own pipeline, so the host's work (copies, checksums, folding,
rows) runs outside one interpreter's lock; past 3/4 of the cores, the processes' own threads
compete (the scaling measured in the benchmarks in `benchmarks/`)."""


PROCESS_MEMORY = 8 << 30
"""Bytes of the machine's memory per such process, at most: each holds its own mlx and device
context (on CUDA about 1 GiB resident at its peak, more where it compiles the kernels), so a
machine with little memory runs few."""


def processes(workers: int) -> int:
    """Worker processes for an mlx pass asked to use ``workers`` workers: 3/4 of them (12 of 16),
    at most one per `PROCESS_MEMORY` of physical memory; 1 (the pass stays in this process) on
    small machines and off Linux. macOS stays in one process: worker processes that each start
    Metal are measured and tested nowhere yet."""
    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(int(workers * PROCESS_SHARE), _physical_memory() // PROCESS_MEMORY))


def _physical_memory() -> int:
    """The machine's physical memory in bytes (Linux and macOS); a large number where unknown."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 50


def copy_threads(share: int = 1) -> int:
    """Threads that copy batches into staging buffers: 3/8 of the cores (6 of 16), divided among
    ``share`` processes that drive the device. More lose: they compete with the driving thread,
    the fold thread, the row threads (`row_threads`) and mlx's own."""

    return max(1, min(16, cores() * 3 // 8) // share)


def row_threads(share: int = 1) -> int:
    """Threads that compute the rows (eigenvalues and all) of an mlx pass's accumulators as
    their layers end: a quarter of the cores (see `copy_threads`), divided among ``share``
    processes."""

    return max(1, cores() // 4 // share)


BATCH_MIB = 32
"""Rows per device call (`Pipeline`) in a pass that drives the device from one process, in MiB
of 16-bit values: float32 rows batch as many values, twice the bytes. The device's cost goes
with the calls and pieces, not the bytes: a 8.59 GB float32 file's one-process pass took 1.34x
longer fresh (1.32x warm) in 32 MiB batches of its stored bytes than in 64 MiB ones on the
accelerator machine, while 64 MiB batches of bfloat16 gained nothing (the benchmarks in `benchmarks/`).
``KVSNAP_MLX_BATCH_MIB`` overrides it and `WORKER_BATCH_MIB`."""


WORKER_BATCH_MIB = 16
"""The same in each of a pass's worker processes (`analysis.engine.processes`), where a process's host
memory is what counts (on CUDA the staging buffers live there): smaller batches keep each
worker under 1 GiB at a small cost in speed; in one process they would only cost."""


def batch_bytes(worker: bool = False) -> int:
    """`BATCH_MIB`, or `WORKER_BATCH_MIB` for a ``worker`` process (or ``KVSNAP_MLX_BATCH_MIB``,
    a whole number of MiB from 1 to 4096), in bytes of 16-bit values."""
    text = os.environ.get("KVSNAP_MLX_BATCH_MIB", "").strip()
    if not text:
        return (WORKER_BATCH_MIB if worker else BATCH_MIB) << 20
    if not text.isdigit() or not 1 <= int(text) <= 4096:
        raise InvalidArgumentError(f"KVSNAP_MLX_BATCH_MIB={text!r}: a whole number of MiB from 1 to 4096")
    return int(text) << 20
