"""Where tasks run (`analysis.engine.executors`): every executor yields the items' results in their
order, raises a task's own exception, bounds what is in flight and cancels what an early stop
leaves; a batch's plan names its executor once and every engine runs through it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from kvsnap.analysis.engine import executors
from kvsnap.analysis.engine.batch import BatchOptions


def square(x: int) -> int:
    return x * x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise KeyError(f"item {x}")
    return x


def environment_and_main(_: int) -> tuple[str | None, str | None, bool]:
    main = sys.modules.get("__main__")
    return (
        os.environ.get("OMP_NUM_THREADS"),
        os.environ.get("OPENBLAS_NUM_THREADS"),
        main is None or (getattr(main, "__file__", None) is None),
    )


@pytest.mark.parametrize("name", ["inline", "threads", "processes"])
def test_every_executor_gives_the_results_in_order_and_the_tasks_own_errors(name: str) -> None:
    with executors.make(name, 2) as executor:
        assert list(executor.map(square, range(20))) == [x * x for x in range(20)]
        assert list(executor.map(square, [])) == []
        with pytest.raises(KeyError, match="item 3"):
            list(executor.map(fail_on_three, range(8)))
        with pytest.raises(KeyError, match="item 3"):
            executor.submit(fail_on_three, 3).result()


def test_make_names_the_executors_and_one_worker_runs_inline() -> None:
    assert set(executors.EXECUTORS) == {"inline", "threads", "processes", "ray"}
    with pytest.raises(
        ValueError, match="executor must be one of inline, threads, processes, ray, not 'spark'"
    ):
        executors.make("spark", 2)
    with pytest.raises(ValueError, match="workers must be a positive integer, not 0"):
        executors.Threads(0)
    assert isinstance(executors.make("processes", 1), executors.Inline)
    assert isinstance(executors.make("threads", 1), executors.Inline)
    assert isinstance(executors.for_tasks(8, 1), executors.Inline)
    with executors.for_tasks(8, 2) as two:
        assert isinstance(two, executors.Processes) and two.workers == 2


class Recording(executors.Executor):
    """Runs nothing until asked: records what was submitted, so that `map`'s window shows."""

    name = "recording"

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.futures: list[Future[Any]] = []

    def submit(self, function: Callable[..., Any], /, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.futures.append(future)
        future.set_result(function(*args))
        return future

    def close(self) -> None:
        pass


def test_map_keeps_at_most_its_window_in_flight() -> None:
    executor = Recording(3)
    results = executor.map(square, range(100))
    assert next(results) == 0
    assert len(executor.futures) == 6  # twice the workers submitted before the first result
    assert next(results) == 1 and len(executor.futures) == 7
    windowed = Recording(3)
    found = windowed.map(square, range(100), window=2)
    assert next(found) == 0 and len(windowed.futures) == 2
    results.close()
    ran: list[int] = []
    inline = executors.Inline().map(ran.append, range(100))
    next(inline)
    assert ran == [0]  # inline: nothing runs ahead of the caller


def test_stopping_early_cancels_the_tasks_not_started() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def slow(x: int) -> int:
        with lock:
            started.append(x)
        time.sleep(0.05)
        return x

    with executors.Threads(1) as executor:
        results = executor.map(slow, range(50), window=10)
        assert next(results) == 0
        results.close()  # the caller stops: the 8 or 9 waiting are cancelled
    assert len(started) <= 3


def test_spawned_workers_start_with_one_blas_thread_and_without_main(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "7")
    with executors.Processes(2) as executor:
        found = list(executor.map(environment_and_main, range(4)))
    assert found == [("1", "1", True)] * 4
    assert "OMP_NUM_THREADS" not in os.environ and os.environ["OPENBLAS_NUM_THREADS"] == "7"


def test_hiding_main_from_several_threads_at_once_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper thread that asks for workers and a pass's own submits hide ``__main__`` at
    the same time: one at a time, so the last to leave does not restore the hidden values."""
    main = types.ModuleType("__main__")
    spec, file = object(), "/somewhere/script.py"
    main.__spec__, main.__file__ = spec, file  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)

    def hide(i: int) -> None:
        for j in range(50):
            with executors.main_hidden():
                assert main.__spec__ is None and "__file__" not in main.__dict__
                time.sleep(0.0001 * ((i + j) % 3))

    threads = [threading.Thread(target=hide, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert main.__spec__ is spec and main.__file__ == file


def fresh_process(*lines: str) -> subprocess.CompletedProcess[str]:
    """The script of ``lines`` run in a new interpreter (a hang fails after 120 s); it must
    exit with status 0."""
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_kept_pool_is_dropped_at_exit_while_modules_are_whole() -> None:
    """The pool a process keeps for its passes is shut down and forgotten by an exit handler,
    before the modules' teardown would collect it (its callback then finds
    ``concurrent.futures.process`` cleared and prints an ignored AttributeError)."""
    done = fresh_process(
        "import atexit",
        "from kvsnap.analysis.engine import executors, processes",
        "atexit.register(lambda: print('kept at exit:', executors._KEPT is not None))",
        "pool = processes._pool(2, 'cpu')",
        "pool.submit(int).result()",
        "del pool",
    )
    assert "kept at exit: False" in done.stdout
    assert "Exception ignored" not in done.stderr


def keep_a_pool(item: int) -> int:
    """In a worker process: keep a pool of two workers, as a file's pass does, and use it."""
    pool = executors.kept(("test", 2), lambda: executors.Processes(2))
    pool.start()
    return int(pool.submit(os.getpid).result() > 0) * item


def test_a_worker_process_that_keeps_a_pool_still_ends() -> None:
    """A worker's kept pool is stopped as the worker exits (exit handlers do not run there):
    the executor that started the worker can shut down instead of waiting for the pool's idle
    workers forever."""
    done = fresh_process(
        "from kvsnap.analysis.engine import executors",
        "from tests.analysis.engine.test_executors import keep_a_pool",
        "with executors.Processes(2) as executor:",
        "    print(list(executor.map(keep_a_pool, range(4))))",
        "print('ended')",
    )
    assert done.stdout.split("\n")[:2] == ["[0, 1, 2, 3]", "ended"]


def test_one_kept_pool_at_a_time_and_a_discarded_one_is_replaced() -> None:
    made: list[int] = []

    def start(workers: int) -> Callable[[], executors.Processes]:
        def started() -> executors.Processes:
            made.append(workers)
            return executors.Processes(workers)

        return started

    two = executors.kept(("test", 2), start(2))
    assert executors.kept(("test", 2), start(2)) is two and executors.is_kept(("test", 2))
    three = executors.kept(("test", 3), start(3))  # the other one is shut down
    assert not executors.is_kept(("test", 2)) and made == [2, 3]
    with pytest.raises(RuntimeError):
        two.submit(int)
    executors.discard(three)
    assert not executors.is_kept(("test", 3))
    assert executors.kept(("test", 3), start(3)) is not three and made == [2, 3, 3]
    executors._forget()


def test_a_batch_plan_names_its_executor_and_tasks(tmp_path: Path) -> None:
    plan = BatchOptions(jobs=2).plan(["a", "b", "c", "d"])  # one core each: files in 4 parts
    assert (plan.executor, plan.workers, plan.parts, len(plan.tasks)) == ("processes", 2, 4, 16)
    assert [options.part for _, options in plan.tasks[:4]] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert not plan.in_process
    one = BatchOptions(jobs=1).plan(["a", "b"])
    assert one.in_process and isinstance(one.start(), executors.Inline)
    on_ray = BatchOptions(jobs=8, engine="ray", address="ray://head:10001").plan(["a", "b"])
    assert (on_ray.executor, on_ray.parts, on_ray.options.workers, on_ray.address) == (
        "ray",
        1,
        1,
        "ray://head:10001",
    )
    assert not on_ray.in_process
