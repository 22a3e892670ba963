"""Where the statistics pass's tasks run: one `Executor` contract and its implementations, chosen
by name (`EXECUTORS`, `make`).

A pass is planned once (`engine.plan`: which files, in how many parts, on how many workers) and
carried out as tasks submitted to an executor, at every level:

=============  ===========================================  ====================================
name           runs a task                                  used for
=============  ===========================================  ====================================
``inline``     in the caller, at once                       one core; a file's batches on one
                                                            thread
``threads``    on threads of this process                   a file's batches (a URL, a small
                                                            file; reads and kernels release the
                                                            interpreter's lock)
``processes``  in worker processes: spawned, or forked      files and parts of files across the
               from the CPU kernels' fork server            cores (`engine.batch`); one big
                                                            file's runs of heads
                                                            (`engine.processes`, a kept pool)
``ray``        as Ray tasks on a local or remote cluster    files across a cluster
=============  ===========================================  ====================================

Every executor gives the same results in the same order: `Executor.map` yields them in the order
of its items, with at most ``window`` submitted and not yet yielded, and a task's own exception
is raised where its result is read (Ray's wrapper removed: a `KVFormatError` naming the file
stays one). `OrderedPool` keeps each key's tasks in order on top of an executor, as a file's
accumulators need.

Worker processes run kvsnap's code only: they start without the caller's ``__main__``
(`main_hidden`; ``multiprocessing`` would import the script into every worker and run its top
level again where it has no ``if __name__ == "__main__":`` guard), and with BLAS and OpenMP on
one thread each (`one_thread_environment`: N processes x a BLAS pool each would oversubscribe
the cores). This module needs the standard library only until a pool starts, so that the fork
server can be started from it before numpy loads (`engine.fork_server`).
"""

from __future__ import annotations

import abc
import atexit
import collections
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, ClassVar

from ..dependencies import futures_process, kvformat_errors, multiprocessing, multiprocessing_util, ray

__all__ = [
    "EXECUTORS",
    "Executor",
    "Inline",
    "OrderedPool",
    "Processes",
    "Ray",
    "Threads",
    "after",
    "for_tasks",
    "main_hidden",
    "make",
    "one_thread_environment",
]


class Executor(abc.ABC):
    """Runs tasks (module-level functions and their arguments, picklable for processes and Ray)
    on ``workers`` workers. Use it as a context manager, or `close` it."""

    name: ClassVar[str]

    def __init__(self, workers: int) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise kvformat_errors.InvalidArgumentError(f"workers must be a positive integer, not {workers!r}")
        self.workers = workers

    @abc.abstractmethod
    def submit(self, function: Callable[..., Any], /, *args: Any) -> Future[Any]:
        """``function(*args)`` on a worker; its result or its own exception through the future."""

    def map(
        self, function: Callable[..., Any], items: Iterable[Any], *args: Any, window: int | None = None
    ) -> Iterator[Any]:
        """``function(item, *args)`` for each item, yielded in the items' order, with at most
        ``window`` (default: twice the workers) submitted and not yet yielded, so that results
        finished out of order wait in bounded numbers. A task's exception is raised when its
        turn comes; the tasks not started then, or when the caller stops early, are cancelled."""
        limit = max(1, window or 2 * self.workers)
        pending: collections.deque[Future[Any]] = collections.deque()
        try:
            for item in items:
                pending.append(self.submit(function, item, *args))
                if len(pending) >= limit:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the workers once their tasks are done (the tasks not started are cancelled)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Inline(Executor):
    """Every task run by `submit` itself, in the caller: the order the tasks were submitted in,
    one core, no start-up. A task's exception is raised by `submit`, before the next is
    submitted."""

    name = "inline"

    def __init__(self, workers: int = 1) -> None:
        super().__init__(1)

    def submit(self, function: Callable[..., Any], /, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(function(*args))
        return future

    def map(
        self, function: Callable[..., Any], items: Iterable[Any], *args: Any, window: int | None = None
    ) -> Iterator[Any]:
        """Each result as soon as its task has run, before the next runs: nothing runs ahead of
        the caller (a batch's progress line comes as its file ends)."""
        for item in items:
            yield function(item, *args)

    def close(self) -> None:
        """Nothing to stop."""


class Threads(Executor):
    """``workers`` threads of this process, first submitted first started."""

    name = "threads"

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvsnap-stats")

    def submit(self, function: Callable[..., Any], /, *args: Any) -> Future[Any]:
        return self._pool.submit(function, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


STARTING_TIMEOUT = 30.0  # seconds a closing pool waits for workers still starting


class Processes(Executor):
    """``workers`` worker processes, each started when a task first needs it: ``"spawn"`` (fresh
    interpreters: no fork of a threaded parent) or ``"forkserver"`` (forked from the fork
    server, which must be running: `engine.fork_server.ensure_running`; its workers inherit its
    one-thread environment and the modules it has loaded). ``initializer`` runs first in each
    worker; a spawned worker without one starts in `one_thread_environment` (set around each
    submit, the only place a worker starts), one with an initializer in the environment as it
    is (the initializer then limits its threads: changing the environment on every submit
    would race with the parent's other threads). A worker that dies breaks the executor: every
    task then fails with ``BrokenProcessPool``, and a kept one is replaced (`discard`)."""

    name = "processes"

    def __init__(
        self, workers: int, start_method: str = "spawn", initializer: Callable[[], None] | None = None
    ) -> None:
        super().__init__(workers)
        self.start_method = start_method
        self._initialized = initializer is not None
        self._pool = futures_process.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context(start_method), initializer=initializer
        )

    def submit(self, function: Callable[..., Any], /, *args: Any) -> Future[Any]:
        # A submit may start a worker, which takes the environment as it is then.
        one_thread = self.start_method == "spawn" and not self._initialized
        with main_hidden(), one_thread_environment() if one_thread else contextlib.nullcontext():
            return self._pool.submit(function, *args)

    def start(self) -> None:
        """Ask for every worker now (each starts with a task that does nothing), without waiting
        for them to start; ``BrokenProcessPool`` if the executor is broken."""
        for _ in range(self.workers):
            self.submit(_nothing)

    def close(self, wait: bool = True) -> None:
        self.wait_started()
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def wait_started(self, timeout: float = STARTING_TIMEOUT) -> None:
        """Wait (``timeout`` seconds at most) until every worker process spawned so far has
        started. A worker still reading its start-up state (the pool's queues, whose semaphores
        it opens by name) when this process drops the pool or exits finds them gone and prints a
        traceback; a command that fails right after asking for its workers would show it. Each
        round asks the workers not yet seen for their process id; a broken pool ends the wait."""
        processes: dict[int, Any] = getattr(self._pool, "_processes", None) or {}
        seen: set[int] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            waiting = set(processes) - seen
            if not waiting:
                return
            try:
                probes = [self._pool.submit(os.getpid) for _ in waiting]
            except (futures_process.BrokenProcessPool, RuntimeError):  # broken, or shut down already
                return
            done, _ = futures_wait(probes, timeout=max(0.0, deadline - time.monotonic()))
            if any(probe.exception() is not None for probe in done):
                return
            seen |= {probe.result() for probe in done}


class Ray(Executor):
    """Ray tasks on the cluster at ``address``, or on a local Ray started with ``workers`` CPUs
    (one already initialized in this process is used as it is); ``workers`` then counts the
    cluster's CPUs. Ray's and Ray Data's INFO lines are kept off the terminal. Needs
    ``pip install 'kvsnap[ray]'``."""

    name = "ray"

    def __init__(self, workers: int, address: str | None = None) -> None:
        _connect(address, workers)
        super().__init__(max(1, int(ray.cluster_resources().get("CPU", workers))))
        self._remote: dict[Callable[..., Any], Any] = {}

    def submit(self, function: Callable[..., Any], /, *args: Any) -> Future[Any]:
        remote = self._remote.get(function)
        if remote is None:
            remote = self._remote[function] = ray.remote(function)
        return _own_error(remote.remote(*args).future())

    def close(self) -> None:
        """Nothing to stop here: the cluster (or the local Ray this process started) stays up
        for the batches that follow, as Ray's own ``ray.init`` does."""


EXECUTORS: dict[str, type[Executor]] = {
    executor.name: executor for executor in (Inline, Threads, Processes, Ray)
}


def make(name: str, workers: int, **settings: Any) -> Executor:
    """The executor called ``name`` (`EXECUTORS`) on ``workers`` workers; ``settings`` are its own
    (``start_method`` for processes, ``address`` for Ray). One worker on threads or processes is
    `Inline`: the same results without the start-up."""
    kind = EXECUTORS.get(name)
    if kind is None:
        raise kvformat_errors.UnknownNameError(
            f"executor must be one of {', '.join(EXECUTORS)}, not {name!r}"
        )
    if workers <= 1 and kind in (Threads, Processes):
        return Inline()
    return kind(workers, **settings)


def for_tasks(workers: int, tasks: int) -> Executor:
    """Spawned processes for ``tasks`` independent tasks on up to ``workers`` cores, or `Inline`
    where there is one core or one task."""
    return make("processes", min(workers, tasks))


def _nothing() -> None:
    """A task that starts a worker."""


def _connect(address: str | None, cpus: int) -> None:
    """Join the cluster at ``address`` or start local Ray, unless this process has Ray running."""
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if ray.is_initialized():
        return
    quiet = logging.WARNING
    if address:
        ray.init(address=address, log_to_driver=False, logging_level=quiet)
    else:
        ray.init(num_cpus=max(1, cpus), include_dashboard=False, log_to_driver=False, logging_level=quiet)


def _own_error(future: Future[Any]) -> Future[Any]:
    """``future`` with a failed task's own exception (a `KVFormatError` naming the file, say)
    instead of Ray's wrapper, whose message carries the remote traceback."""
    own: Future[Any] = Future()

    def settle(done: Future[Any]) -> None:
        if not own.set_running_or_notify_cancel():
            return  # cancelled by the caller meanwhile
        error = done.exception()
        if error is None:
            own.set_result(done.result())
            return
        cause = getattr(error, "cause", None)
        own.set_exception(cause if isinstance(error, ray.exceptions.RayTaskError) and cause else error)

    future.add_done_callback(settle)
    return own


# --- the kept process pool ----------------------------------------------------------------------

_KEPT: tuple[Hashable, Processes] | None = None
_KEPT_LOCK = threading.Lock()


def kept(key: Hashable, start: Callable[[], Processes]) -> Processes:
    """The process executor kept for ``key`` (what its workers were started for: their count
    and backend), made with ``start`` the first time; one is kept at a time (another is shut
    down first), for the passes that follow in this process."""
    global _KEPT
    with _KEPT_LOCK:
        if _KEPT is not None and _KEPT[0] == key:
            return _KEPT[1]
        if _KEPT is not None:
            _KEPT[1].close(wait=False)
            _KEPT = None
        executor = start()
        _KEPT = (key, executor)
        _forget_at_exit()
        return executor


def settle_kept(timeout: float = STARTING_TIMEOUT) -> None:
    """Wait until the kept pool's workers spawned so far have started (`Processes.close`)."""
    held = _KEPT
    if held is not None:
        held[1].wait_started(timeout)


def is_kept(key: Hashable) -> bool:
    """Whether a process executor is kept for ``key``."""
    return _KEPT is not None and _KEPT[0] == key


def discard(executor: Processes) -> None:
    """Forget ``executor`` (broken: a worker died), so that the next pass starts a fresh one."""
    global _KEPT
    with _KEPT_LOCK:
        if _KEPT is not None and _KEPT[1] is executor:
            _KEPT = None
    executor.close(wait=False)


_FINALIZER: Any = None


def _forget_at_exit() -> None:
    """`_forget` at this process's exit: an exit handler in the main process, run after the
    handlers registered before it; and, for a worker process (a batch's file whose own pass
    keeps a pool), a ``multiprocessing`` finalizer that waits for the pool to stop, which runs
    before the worker joins its children (exit handlers never run there): without it the kept
    pool's idle workers are never told to stop, and the worker, and the batch waiting for it,
    would wait for them forever."""
    global _FINALIZER
    atexit.unregister(_forget)
    atexit.register(_forget)
    if _FINALIZER is None or not _FINALIZER.still_active():
        # Before the finalizers of the pool's own queues (priority 10), which would stop the
        # queue's feeder before the workers' stop signals were sent.
        _FINALIZER = multiprocessing_util.Finalize(None, _forget, args=(True,), exitpriority=100)


def _forget(wait: bool = False) -> None:
    """Shut down and drop the kept pool (``wait``: until its workers have ended). At interpreter
    exit (after ``concurrent.futures`` has joined its workers) this runs while every module is
    still whole: collected later, in the modules' teardown, the pool's callback finds
    ``concurrent.futures.process``'s globals cleared and prints an ignored ``AttributeError``."""
    global _KEPT
    with _KEPT_LOCK:
        held, _KEPT = _KEPT, None
    if held is not None:
        held[1].close(wait=wait)


# --- keeping each key's tasks in order ----------------------------------------------------------


def after(previous: Future[Any] | None, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` once ``previous`` (if any) is done; its exception raised instead."""
    if previous is not None:
        previous.result()
    return function(*args)


class OrderedPool:
    """``threads`` threads (`Threads`; one: `Inline`, the tasks run in the caller); `submit` runs
    ``function(*args)`` after every earlier task of the same key. Each key's tasks waiting for
    the one before on a first-in first-out pool, whose earlier tasks have started already, no
    wait can deadlock; results equal one thread's, since each accumulator (a key) is updated by
    one task at a time in the order its blocks were read."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = make("threads", threads)
        self._last: dict[Any, Future[Any]] = {}
        self._in_flight: collections.deque[Future[Any]] = collections.deque()

    def submit(self, key: Any, function: Callable[..., Any], *args: Any) -> Future[Any]:
        if isinstance(self._executor, Inline):
            return self._executor.submit(function, *args)
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
        self._executor.close()

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- how worker processes start -----------------------------------------------------------------

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def one_thread_environment() -> Iterator[None]:
    """BLAS and OpenMP limited to one thread each in the environment, for the processes
    started meanwhile (as Ray does for its workers)."""
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
