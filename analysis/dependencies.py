"""The third-party and standard-library modules that `kvsnap.analysis` imports on first use, named
once here and imported from here at the top of the modules that use them.

Each name is a module that loads when one of its attributes is first read: ``pa.table(...)``
imports pyarrow then, not when the module naming ``pa`` is imported. A fresh ``kvsnap`` command
so pays only for the imports it uses (polars and matplotlib are large next to a small file's
whole ``kvsnap stats``: ``python -m benchmarks.cli_bench --files tiny``), and the fork server of
the CPU workers starts without pyarrow (`engine.fork_server`).

A module that is not installed raises `ModuleNotFoundError` at that first use, as an
``import`` statement there would (the commands turn it into one line naming the extra to
install). Setting ``sys.modules[name] = None`` makes it missing for later uses, as for an
``import`` statement.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any


class OnFirstUse(ModuleType):
    """Module ``name``, imported when an attribute is first read; every read goes to the module
    in `sys.modules` (so that a test's ``monkeypatch.setattr`` on the real module is seen)."""

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)  # copy, pickle and inspect probe dunders: not an import
        return getattr(importlib.import_module(self.__name__), attribute)

    def __repr__(self) -> str:
        return f"<module {self.__name__!r}, imported on first use>"


if TYPE_CHECKING:
    import multiprocessing
    import multiprocessing.util as multiprocessing_util
    from concurrent.futures import process as futures_process

    import matplotlib
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt
    import mlx.core as mx
    import polars as pl
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq
    import ray
    import threadpoolctl
    import tqdm

    import kvformat.errors as kvformat_errors
else:
    multiprocessing = OnFirstUse("multiprocessing")
    multiprocessing_util = OnFirstUse("multiprocessing.util")
    futures_process = OnFirstUse("concurrent.futures.process")
    matplotlib = OnFirstUse("matplotlib")
    mcolors = OnFirstUse("matplotlib.colors")
    plt = OnFirstUse("matplotlib.pyplot")
    mx = OnFirstUse("mlx.core")
    pl = OnFirstUse("polars")
    pa = OnFirstUse("pyarrow")
    pa_csv = OnFirstUse("pyarrow.csv")
    pq = OnFirstUse("pyarrow.parquet")
    ray = OnFirstUse("ray")
    threadpoolctl = OnFirstUse("threadpoolctl")
    tqdm = OnFirstUse("tqdm")
    kvformat_errors = OnFirstUse("kvformat.errors")  # for modules that load before numpy

__all__ = [
    "OnFirstUse",
    "futures_process",
    "kvformat_errors",
    "matplotlib",
    "mcolors",
    "multiprocessing",
    "mx",
    "pa",
    "pa_csv",
    "pl",
    "plt",
    "pq",
    "threadpoolctl",
    "tqdm",
]
