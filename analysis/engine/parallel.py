"""Workers for the passes: threads for one file opened by URL or too small for worker processes
(tasks keyed by accumulator, each key's tasks run in order), processes across files, and the
settings both share.

The statistics kernels (C through ctypes), BLAS and numpy's conversions
release the GIL, so threads share one memory map. Results stay identical to one thread: every accumulator is
updated by one task at a time, in the order the blocks were read (a task waits for the previous
task of its key, which a FIFO pool has already started). A local file's workers are processes
(`analysis.engine.processes`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..dependencies import futures_process, multiprocessing, threadpoolctl


def cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def split_jobs(jobs: int, files: int) -> tuple[int, int]:
    """``(processes, threads per file)`` for ``jobs`` cores over ``files`` files: files in
    parallel first (no sharing at all), the cores left over as threads within each file."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    processes = max(1, min(jobs, files))
    return processes, max(1, jobs // processes)


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS limited to one thread while a pass runs: our own threads spread the work (N threads x
    a BLAS pool each would oversubscribe the cores), and results do not depend on the thread
    count. A no-op where threadpoolctl is not installed."""
    try:
        limits = threadpoolctl.threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with the analysis extra
        yield
        return
    with limits(1, user_api="blas"):
        yield


def limit_blas_threads(threads: int) -> None:
    """BLAS limited to ``threads`` threads from now on in this process (a no-op where
    threadpoolctl is not installed)."""
    try:
        limits = threadpoolctl.threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with the analysis extra
        return
    limits(threads, user_api="blas")


def after(previous: Future[Any] | None, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` once ``previous`` (if any) is done; its exception raised instead."""
    if previous is not None:
        previous.result()
    return function(*args)


class OrderedPool:
    """``threads`` worker threads; `submit` runs ``function(*args)`` after every earlier task
    of the same key. With one thread, tasks run at once in the caller."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = (
            ThreadPoolExecutor(threads, thread_name_prefix="kvsnap-stats") if threads > 1 else None
        )
        self._last: dict[Any, Future[Any]] = {}
        self._in_flight: collections.deque[Future[Any]] = collections.deque()

    def submit(self, key: Any, function: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._executor is None:
            future: Future[Any] = Future()
            future.set_result(function(*args))
            return future
        future = self._executor.submit(after, self._last.get(key), function, *args)
        self._last[key] = future
        self._in_flight.append(future)
        return future

    def drain(self, limit: int = 0) -> None:
        """Wait, oldest first, until at most ``limit`` tasks are in flight; a task's exception is
        raised here."""
        while len(self._in_flight) > limit:
            self._in_flight.popleft().result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def one_thread_environment() -> Iterator[None]:
    """BLAS and OpenMP limited to one thread each in the environment, for the processes
    started meanwhile (as Ray does for its workers): N processes x a spinning BLAS pool each
    would oversubscribe the cores."""
    saved = {name: os.environ.get(name) for name in _THREAD_VARIABLES}
    os.environ.update(dict.fromkeys(_THREAD_VARIABLES, "1"))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_MAIN_LOCK = threading.RLock()


@contextlib.contextmanager
def main_hidden() -> Iterator[None]:
    """``multiprocessing`` starts the processes created meanwhile without importing ``__main__``
    (it looks for the module's ``__spec__`` and ``__file__``; both are hidden, then restored).
    One thread at a time (a second one would save the hidden values and restore them)."""
    with _MAIN_LOCK:
        main = sys.modules.get("__main__")
        if main is None:
            yield
            return
        spec, file = getattr(main, "__spec__", None), main.__dict__.pop("__file__", None)
        main.__spec__ = None
        try:
            yield
        finally:
            main.__spec__ = spec
            if file is not None:
                main.__file__ = file


def local_map(function: Callable[..., Any], paths: Sequence[Any], jobs: int, *args: Any) -> Iterator[Any]:
    """``function(path, *args)`` for each path, in order, in ``jobs`` spawned processes."""
    if jobs <= 1 or len(paths) <= 1:
        for path in paths:
            yield function(path, *args)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
    # Workers inherit the environment when they are spawned (on submit).
    # Workers run kvsnap's code only: started without the caller's ``__main__``, a script with
    # no ``if __name__ == "__main__":`` guard is not run again in each of them.
    with one_thread_environment(), main_hidden():
        pool = futures_process.ProcessPoolExecutor(max_workers=jobs, mp_context=context)
        futures = [pool.submit(function, path, *args) for path in paths]
    with pool:
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()
