"""What a statistics pass does before and after it reads: its options, the keys and accumulators
of each layer, the order it reads a file in (windows), the batches it hands out, and how rows are
split over threads. Shared by the in-process pass (`streaming`) and the worker processes
(`processes`), which import it and not each other."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import kvformat
from kvformat import pages
from kvformat.checksum import crc32c
from kvformat.errors import ConflictingArgumentsError, InvalidArgumentError, UnknownNameError

from ..kernels import check as check_backend
from ..kernels import profile
from ..kernels.arrays import PIECE, bytes_of
from ..stats.catalogue import ALL, stat_groups
from ..stats.rope import Rope
from . import executors
from .accumulator import HeadAccumulator, stack
from .parallel import cores, split_jobs
from .progress import bar

BATCH_BYTES = 8 << 20  # K + V bytes of one head handed to one task
SMALL_SEGMENT_BYTES = 1 << 20  # segments smaller than this on average are regrouped by head ...
WINDOW_BYTES = 64 << 20  # ... within windows of this many K + V bytes in file order
CLOSING_LAYERS = 8
"""Layers past their last chunk whose work (device folds, rows) may still run while the pass reads
on; at more, it waits for the oldest (their accumulators stay in memory meanwhile)."""


Key = tuple[int, int, int, str]  # (layer, seq, head, "k" | "v"): the order of series keys


@dataclass(frozen=True)
class FileOptions:
    """What each file's pass computes, for one pass (`PassOptions`) and for a batch
    (`BatchOptions`): ``snapshot``: index (negative from the end); ``keys``:
    ``"post_rope"`` or ``"pre_rope"``; ``stats``: the statistic groups (`GROUPS`);
    ``storage_options``: fsspec options for URLs; ``backend``: the kernel (`kernels.CHOICES`:
    ``"cpu"``, the compiled kernel, or ``"mlx"``, mlx on its default device)."""

    snapshot: int = -1
    keys: str = "post_rope"
    stats: frozenset[str] = ALL
    storage_options: dict[str, Any] | None = field(default=None, compare=False)
    backend: str = "cpu"

    def __post_init__(self) -> None:
        if self.keys not in ("post_rope", "pre_rope"):
            raise UnknownNameError("keys must be 'post_rope' or 'pre_rope'")
        check_backend(self.backend)
        object.__setattr__(self, "stats", stat_groups(self.stats))


@dataclass(frozen=True)
class PassOptions(FileOptions):
    """What one streaming pass over a file computes (`FileOptions`), and with how many workers.

    ``workers``: workers on this file's heads (processes for a local file,
    `analysis.engine.processes`; threads for a URL or a small file); on mlx a local file's pass
    runs on `kernels.mlx.processes` worker processes, each driving the device, else on one thread
    that reads the next block while the device works; ``progress``: a bar of layers on stderr;
    ``device_share``: how many processes drive the device at once with passes like this one (a
    batch's files in parallel), among which an mlx pass divides the machine's copy and row threads
    (`kernels.mlx_sizing`); ``part``: ``(index, count)``, the pass covers the ``index``-th of
    ``count`` contiguous shares of the file's present layers (`layers_of_part`), so that a batch
    can hand one file to several workers (`analysis.engine.batch`); ``(0, 1)``, the default, is
    the whole file."""

    workers: int = 1
    progress: bool = field(default=False, compare=False)  # a bar per layer on a terminal's stderr
    device_share: int = field(default=1, compare=False)
    part: tuple[int, int] = (0, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.workers, int) or self.workers < 1:
            raise InvalidArgumentError(f"workers must be a positive integer, not {self.workers!r}")
        if not isinstance(self.device_share, int) or self.device_share < 1:
            raise InvalidArgumentError(f"device_share must be a positive integer, not {self.device_share!r}")
        check_part(self.part)


def check_part(part: Any) -> None:
    """ValueError unless ``part`` is ``(index, count)``, two ints, ``0 <= index < count``."""
    pair = isinstance(part, tuple) and len(part) == 2 and all(isinstance(n, int) for n in part)
    if not (pair and 0 <= part[0] < part[1]):
        raise InvalidArgumentError(f"part must be (index, count) with 0 <= index < count, not {part!r}")


def add_segments(
    snap: kvformat.Snapshot,
    segments: list[kvformat.Segment],
    k_acc: HeadAccumulator,
    v_acc: HeadAccumulator,
    rope: Rope | None,
    pipeline: Any = None,
    release_each: bool = True,
) -> None:
    """Read (CRC, decode), add and release each segment of one head, in order; K is un-rotated
    by ``rope`` when given. Runs on a pass's worker thread: reading there spreads the page faults
    and checksums of a memory-mapped file over the cores. With an mlx ``pipeline``
    (`kernels.mlx.Pipeline`) the rows join its next device batch instead."""
    for group in _joined(segments):
        k_check = v_check = None
        if len(group) > 1:  # small segments of one head: read and added at once (one copy)
            block = pages.of(snap).read_many(group)
        else:  # CRCs checked by the copy threads (mlx) or piece by piece as the kernel adds
            block, k_check, v_check = pages.of(snap).read_unchecked(group[0])
        block_k, block_v, positions = block.k, block.v, block.positions
        if rope is None:
            k = block_k
        else:  # K's stored bytes checked before they are rotated
            if k_check is not None:
                k_check.check(crc32c(bytes_of(block_k)))
                k_check = None
            k = rope.rotate(block_k, positions, inverse=True)
        # Pages are released as soon as they are added, or with their window (`windows`: small
        # segments, whose pages hold other heads' records).
        after = functools.partial(pages.of(snap).release, group) if release_each else None
        if pipeline is not None:
            pipeline.add(k_acc, k, positions, check=k_check)
            pipeline.add(v_acc, block_v, positions, after=after, check=v_check)
            continue
        k_acc.add(k, positions, k_check)
        v_acc.add(block_v, positions, v_check)
        if after is not None:
            after()


def _joined(segments: list[kvformat.Segment]) -> Iterator[list[kvformat.Segment]]:
    """One head's segments in groups added at once: every large segment alone, consecutive
    small ones together (up to `accumulator.PIECE` rows)."""

    group: list[kvformat.Segment] = []
    rows = 0
    for segment in segments:
        if group and (rows + segment.count > PIECE or segment.count >= PIECE):
            yield group
            group, rows = [], 0
        group.append(segment)
        rows += segment.count
    if group:
        yield group


def layer_ropes(snap: kvformat.Snapshot, keys: str) -> dict[int, Rope | None]:
    """The RoPE of every present layer, from the file's metadata: None where it does not say
    (an error with ``keys="pre_rope"``, which needs it to un-rotate K)."""
    ropes: dict[int, Rope | None] = {}
    for layer, spec in enumerate(snap.layers):
        if not spec.present:
            continue
        try:
            ropes[layer] = Rope.from_metadata(snap.metadata, spec.attributes, spec.k_dim)
        except ValueError:
            if keys == "pre_rope":
                raise
            ropes[layer] = None
    return ropes


def layer_heads(snap: kvformat.Snapshot, layer: int) -> list[tuple[int, int]]:
    """The ``(seq, head)`` pairs of ``layer``, in the order of its accumulators and table rows."""
    return [(seq, head) for seq in range(snap.num_seqs) for head in range(snap.layers[layer].num_heads)]


def fresh_accumulators(
    snap: kvformat.Snapshot,
    layer: int,
    rope: Rope | None,
    options: PassOptions,
    heads: list[tuple[int, int]] | None = None,
) -> dict[Key, HeadAccumulator]:
    """Empty accumulators for every (seq, head, tensor) of ``layer`` (of ``heads`` only, when
    given: ``(seq, head)`` pairs); K's knows its ``rope``. On mlx those of one dim share one
    layout of their array sums (`accumulator.stack`: the device's results for a batch of the
    layer's pieces add in one call per sum)."""
    spec = snap.layers[layer]
    table: dict[Key, HeadAccumulator] = {}
    for seq, head in layer_heads(snap, layer) if heads is None else heads:
        table[(layer, seq, head, "k")] = HeadAccumulator(
            spec.k_dim, rope, options.stats, backend=options.backend
        )
        table[(layer, seq, head, "v")] = HeadAccumulator(
            spec.v_dim, None, options.stats, backend=options.backend
        )
    if profile(options.backend).device:  # the device's folds add into a layer's stacked sums
        for dim in {spec.k_dim, spec.v_dim}:
            stack([acc for acc in table.values() if acc.dim == dim])
    return table


def layers_of_part(layers: dict[int, Any], part: tuple[int, int]) -> dict[int, Any]:
    """The entries of ``layers`` (keyed by layer, in layer order) in share ``index`` of ``count``
    contiguous shares of them, as even as whole layers allow (`PassOptions.part`)."""
    index, count = part
    keys = list(layers)
    chosen = keys[index * len(keys) // count : (index + 1) * len(keys) // count]
    return {layer: layers[layer] for layer in chosen}


def pass_order(
    snap: kvformat.Snapshot, layers: dict[int, Any] | None = None
) -> tuple[list[Window], dict[int, int]]:
    """The pass's `windows` and, per layer, the index of its last segment in that order (the
    layer is done once the pass is past it); only the segments of ``layers`` (keyed by layer)
    where given."""
    order = windows(snap)
    if layers is not None:
        order = [Window([s for s in w.segments if s.layer in layers], w.release) for w in order]
        order = [w for w in order if w.segments]
    last = {seg.layer: i for i, seg in enumerate(s for w in order for s in w.segments)}
    return order, last


def _row_bytes(snap: kvformat.Snapshot) -> dict[int, int]:
    """Bytes of one token of K and V, per present layer."""
    return {
        layer: spec.row_bytes(0) + spec.row_bytes(1) for layer, spec in enumerate(snap.layers) if spec.present
    }


@dataclass
class Window:
    """Segments the pass reads together, in its order; ``release``: whether the window's pages
    are released as one once all its work is done (small segments)."""

    segments: list[kvformat.Segment]
    release: bool


def windows(snap: kvformat.Snapshot) -> list[Window]:
    """The snapshot's segments in the order the pass reads them: file order, except where
    segments are small on average (a series of snapshots, or a capture appended every few
    tokens, interleaves every head in the file): then the segments of each window of
    `WINDOW_BYTES` (K + V, in file order) are taken head by head, each head's in file order, so
    a head's small segments are read and added together."""
    segments = snap.segments()
    row_bytes = _row_bytes(snap)
    sizes = [segment.count * row_bytes[segment.layer] for segment in segments]
    if not segments or sum(sizes) >= SMALL_SEGMENT_BYTES * len(segments):
        return [Window(segments, False)]
    out: list[Window] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= WINDOW_BYTES or i == len(sizes) - 1:
            part = segments[start : i + 1]
            out.append(Window(sorted(part, key=lambda s: (s.layer, s.seq, s.head)), True))
            start, total = i + 1, 0
    return out


def head_batches(
    snap: kvformat.Snapshot, order: list[Window], last: dict[int, int]
) -> Iterator[tuple[list[kvformat.Segment], bool, Window | None]]:
    """The segments of ``order`` grouped into batches of consecutive segments of one head, each
    up to `BATCH_BYTES` of K and V (or one segment if larger); with each batch, whether it holds
    its layer's last segment (``last``: layer -> index of that segment in the pass order), and
    its window when it is the window's last batch."""
    row_bytes = _row_bytes(snap)
    index = 0  # of the segment in the pass order
    for window in order:
        batch: list[kvformat.Segment] = []
        size = 0
        for position, segment in enumerate(window.segments):
            if batch and (
                (segment.seq, segment.layer, segment.head) != (batch[0].seq, batch[0].layer, batch[0].head)
                or size >= BATCH_BYTES
            ):
                yield batch, False, None
                batch, size = [], 0
            batch.append(segment)
            size += segment.count * row_bytes[segment.layer]
            if last[segment.layer] == index:
                yield batch, True, window if position == len(window.segments) - 1 else None
                batch, size = [], 0
            index += 1
        if batch:
            yield batch, False, window


def row_parts(accumulators: list[HeadAccumulator], threads: int) -> list[list[HeadAccumulator]]:
    """``accumulators`` cut into ``threads`` runs (fewer if there are fewer), whose rows are
    computed together (`rows.compute`), one run per thread."""
    size = max(1, -(-len(accumulators) // max(1, threads)))
    return [accumulators[start : start + size] for start in range(0, len(accumulators), size)]


LayerResult = tuple[str, int, int, dict[Key, HeadAccumulator]]
"""``(file name, snapshot index, layer, its accumulators)``."""


def layer_bar(name: str, layers: int, show: bool) -> Any:
    """A bar over the layers of one file (`progress.bar`): on stderr, only when it is a
    terminal and ``show``."""

    return bar(layers, show, desc=os.path.basename(name) or name, unit="layer")


ENGINES = ("local", "ray")


@dataclass(frozen=True)
class BatchOptions(FileOptions):
    """How a batch job over many files runs: one object for `analysis.engine.batch.run_stats`,
    `analysis.engine.batch.merged_stats` and the Ray engine; each file's pass as `FileOptions`
    says (``snapshot``, ``keys``, ``stats``, ``storage_options``, ``backend``).

    ``engine``: ``"local"`` (processes on this machine) or ``"ray"``; ``jobs``: cores (local) or
    CPUs of a local Ray cluster, default all of this process's; ``address``: a Ray cluster to
    join; ``fail_fast``: raise on the first failing file instead of collecting it."""

    engine: str = "local"
    jobs: int | None = None
    address: str | None = None
    fail_fast: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine not in ENGINES:
            raise UnknownNameError(f"engine must be 'local' or 'ray', not {self.engine!r}")
        if self.jobs is not None and (not isinstance(self.jobs, int) or self.jobs < 1):
            raise InvalidArgumentError(f"jobs must be a positive integer, not {self.jobs!r}")

    @classmethod
    def of(cls, options: BatchOptions | None, settings: dict[str, Any]) -> BatchOptions:
        """``options`` (default: the defaults) with the keyword ``settings`` applied; TypeError
        naming a setting that is not a field."""
        shared = [f.name for f in dataclasses.fields(FileOptions)]
        known = [f.name for f in dataclasses.fields(cls) if f.name not in shared] + shared
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ConflictingArgumentsError(f"unknown batch option {unknown[0]!r}; known: {', '.join(known)}")
        return dataclasses.replace(options or cls(), **settings)

    @property
    def cores(self) -> int:
        """``jobs``, or every core this process may use."""

        return self.jobs or cores()

    def plan(self, paths: Sequence[Any]) -> Plan:
        """The batch's `Plan` over ``paths``: with ``engine="ray"`` each file whole, one task on
        one thread per file, Ray scheduling the cluster's cores; locally, files in parallel
        processes first, the cores left as each file's workers, and where each file would get
        one core, the files split in parts of their layers (`file_parts`) so that every core
        runs. With ``backend="mlx"`` the device is driven by `kernels.mlx_sizing.processes`
        processes (12 of 16 cores): with at least as many files, each drives it with whole
        files, one after another (one file's pass in each, its copy and row threads a share of
        the machine's); with fewer, one file after another, each on that many worker processes
        (a local file; else one thread)."""

        files = len(paths)
        processes, threads = split_jobs(self.cores, files)
        share = 1
        kernel = profile(self.backend)
        if kernel.device:  # each process drives the device
            share = kernel.processes(self.cores)
            if files >= share > 1:
                processes, threads = share, 1
            else:
                processes, threads, share = 1, self.cores, 1
        options = PassOptions(
            snapshot=self.snapshot,
            keys=self.keys,
            stats=self.stats,
            workers=threads,
            storage_options=self.storage_options,
            progress=files == 1,
            backend=self.backend,
            device_share=share,
        )
        if self.engine == "ray":
            one_thread = dataclasses.replace(options, workers=1, progress=False)
            return Plan(list(paths), one_thread, 1, "ray", self.cores, self.address)
        parts = file_parts(files, self.cores, options)
        if parts > 1:
            processes = min(self.cores, files * parts)
        return Plan(list(paths), options, parts, "processes", processes)


@dataclass(frozen=True)
class Plan:
    """What a batch runs and where, decided once: every file of ``paths`` in ``parts``
    contiguous shares of its layers, each share a task with ``options`` (`tasks`), run on the
    executor named ``executor`` (`executors.EXECUTORS`) with ``workers`` workers (``address``:
    the Ray cluster's)."""

    paths: list[Any]
    options: PassOptions
    parts: int
    executor: str
    workers: int
    address: str | None = None

    @property
    def tasks(self) -> list[tuple[Any, PassOptions]]:
        """Each file's parts, file by file, as ``(path, the part's options)``."""
        return [
            (path, dataclasses.replace(self.options, part=(index, self.parts)))
            for path in self.paths
            for index in range(self.parts)
        ]

    @property
    def in_process(self) -> bool:
        """Whether the tasks run in this process, one after another (one worker, not Ray)."""
        return self.executor != "ray" and self.workers <= 1

    def start(self) -> executors.Executor:
        """The executor that carries the plan out (`executors.make`; one worker: `Inline`)."""
        settings = {"address": self.address} if self.executor == "ray" else {}
        return executors.make(self.executor, self.workers, **settings)


PART_TASKS_PER_PROCESS = 8
MAX_PARTS = 8


def file_parts(files: int, cores: int, options: PassOptions) -> int:
    """Into how many parts (contiguous shares of its layers, `PassOptions.part`) a batch splits
    each file: where ``options`` gives each file one core (the CPU backend, more files than half
    the cores), about `PART_TASKS_PER_PROCESS` tasks per process, at most `MAX_PARTS` per file,
    so that the last files end together on every core (50 files on 16 cores: 3 parts; 9 files: 8
    parts on 16 processes, where whole files left 7 cores idle). Else 1."""
    if not profile(options.backend).splits_files or options.workers > 1 or cores <= 1 or files < 1:
        return 1
    return max(1, min(MAX_PARTS, -(-PART_TASKS_PER_PROCESS * cores // files)))
