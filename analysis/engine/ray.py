"""Ray Data over `.kv` files: one read task per file, each running the statistics pass and
yielding one Arrow table per layer, so Ray's streaming executor bounds memory and schedules the
files. For pipelines that go on in Ray Data; ``run_stats(..., engine="ray")`` runs a batch on Ray
tasks instead (`engine.executors.Ray`).

    import ray, analysis.engine.ray
    ray.init()                                   # or ray.init(address="ray://head:10001")
    ds = analysis.engine.ray.read_kv(["s3://bucket/runs/a.kv", ...])
    ds.to_pandas()                               # one row per (file, seq, layer, head, tensor)

Needs ``pip install 'kvsnap[ray]'``. We build no scheduler: Ray places and retries the tasks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from kvformat.errors import KVSnapError, UnknownNameError

from ..dependencies import pa
from ..stats import stat_groups
from .files import Options, describe_error, expand_paths
from .tables import PassOptions, layer_tables


def _read_file(path: str, options: PassOptions, errors: str) -> Iterator[pa.Table]:

    try:
        yield from layer_tables(path, options)
    except (KVSnapError, OSError) as exc:  # anything else is a bug: raised as it is
        if errors == "raise":
            raise
        yield pa.table({"file": [path], "error": [describe_error(exc)]})


class KVDatasource(Datasource):
    """Per-head statistic rows of `.kv` files (paths or URLs): one read task per file.

    ``errors="collect"`` turns a failing file into one ``(file, error)`` row instead of failing
    the dataset."""

    def __init__(self, paths: list[str], options: PassOptions, errors: str = "raise") -> None:
        if errors not in ("raise", "collect"):
            raise UnknownNameError("errors must be 'raise' or 'collect'")
        self.paths = list(paths)
        self.options = dataclasses.replace(options, workers=1, progress=False)  # Ray schedules the cores
        self.errors = errors

    def get_name(self) -> str:
        return "KV"

    def estimate_inmemory_data_size(self) -> int | None:
        return None  # the output is a few KB per head, whatever the file size

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        tasks = []
        for path in self.paths:
            tasks.append(
                ReadTask(
                    functools.partial(_read_file, path, self.options, self.errors),
                    BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=(path,)),
                )
            )
        return tasks


def read_kv(
    paths: str | list[str],
    *,
    snapshot: int = -1,
    keys: str = "post_rope",
    stats: str | list[str] | None = None,
    storage_options: Options | None = None,
    errors: str = "raise",
) -> ray.data.Dataset:
    """A `ray.data.Dataset` of per-head statistic rows of the files (paths, URLs or glob patterns),
    the same rows as `analysis.head_stats`, one read task per file (one thread each: Ray
    schedules the cores)."""
    files = expand_paths([paths] if isinstance(paths, str) else paths, storage_options)
    options = PassOptions(
        snapshot=snapshot, keys=keys, stats=stat_groups(stats), storage_options=storage_options
    )
    return _dataset(files, options, errors)


def _dataset(files: list[str], options: PassOptions, errors: str) -> ray.data.Dataset:
    return ray.data.read_datasource(KVDatasource(files, options, errors), override_num_blocks=len(files))
