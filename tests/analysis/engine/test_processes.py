"""One file's pass over worker processes (`analysis.engine.processes`): the same tables as one worker,
in the same order, for every layout the pass reads differently; errors come back by name; a
script without a ``__main__`` guard is not run again by the workers."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import threadpoolctl

import kvformat
from kvsnap.analysis.engine import processes
from kvsnap.analysis.engine.batch import head_stats
from kvsnap.analysis.engine.plan import PassOptions, windows
from kvsnap.analysis.engine.streaming import layers
from kvsnap.analysis.engine.tables import layer_tables, stats_for_file
from kvsnap.analysis.kernels import mlx_sizing
from tests.factories import random_file

ROPE = {"rope": {"base": 10000.0, "pairing": "half"}}


@pytest.fixture(autouse=True)
def small_files_on_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests' files are small; the pass takes processes for them all the same."""
    monkeypatch.setattr(processes, "PROCESS_MIN_BYTES", 0)


def _table(path: Path | str, jobs: int, **options: object) -> pa.Table:
    return pa.concat_tables(list(stats_for_file(path, jobs=jobs, **options)))  # type: ignore[arg-type]


def _appended(path: Path, step: int, tokens: int = 96, seqs: int = 1) -> None:
    """Three layers x 3 heads, ``tokens`` tokens appended ``step`` at a time (each head's
    segments interleaved with every other head's), K with per-channel scales."""
    rng = np.random.default_rng(step)
    scales = np.linspace(0.5, 3, 32, dtype=np.float32)
    specs = [kvformat.LayerSpec(3, 32, 16, kvformat.FLOAT32)] * 3
    with kvformat.Writer(path, specs, metadata=ROPE, num_seqs=seqs) as writer:
        for _ in range(0, tokens, step):
            for seq in range(seqs):
                for layer in range(3):
                    k = (rng.standard_normal((3, step, 32)) * scales).astype(np.float32)
                    v = rng.standard_normal((3, step, 16)).astype(np.float32)
                    writer.append(layer, k, v, seq=seq)
        writer.snapshot()


def test_a_small_file_with_many_heads_goes_to_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below `PROCESS_MIN_BYTES`, a file of `PROCESS_MIN_HEADS` (layer, head) pairs goes to
    `FULL_CORES` worker processes (on that many threads each head costs the interpreter's lock),
    one with fewer does not (the workers' start would cost more); on 2 workers, where threads
    contend less and workers save at most half the time, it takes 8 times as many heads."""
    few, many, broken = tmp_path / "few.kv", tmp_path / "many.kv", tmp_path / "broken.kv"
    random_file(few, layers=2, heads=2, tokens=8, dim=16)
    random_file(many, layers=processes.PROCESS_MIN_HEADS // 4, heads=4, tokens=8, dim=16)
    broken.write_bytes(b"not a kv file")
    monkeypatch.setattr(processes, "PROCESS_MIN_BYTES", 16 << 20)  # as shipped
    assert max(os.path.getsize(few), os.path.getsize(many)) < processes.PROCESS_MIN_BYTES
    assert processes._heads(many) == processes.PROCESS_MIN_HEADS and processes._heads(few) == 4
    assert processes._heads(broken) == 0  # the pass, not this check, reports a bad file
    workers = processes.FULL_CORES + 1  # a count no other test keeps a pool of
    assert not processes._running(workers)
    assert processes.usable(many, workers, "cpu")
    assert not processes.usable(few, workers, "cpu")
    assert not processes.usable(broken, workers, "cpu")
    assert not processes._running(2)
    assert not processes.usable(many, 2, "cpu")
    more = tmp_path / "more.kv"
    random_file(more, layers=processes.PROCESS_MIN_HEADS * 2, heads=4, tokens=8, dim=16)
    assert processes.usable(more, 2, "cpu")


def test_usable_only_for_local_files_with_several_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "a.kv")
    random_file(Path(path), layers=1, heads=2, tokens=64, dim=16)
    assert processes.usable(path, 2, "cpu")
    monkeypatch.setattr(processes, "PROCESS_MIN_BYTES", os.path.getsize(path) + 1)
    assert processes.usable(path, 2, "cpu") == processes._running(2)  # small: only a running pool
    processes.start(2)
    assert processes.usable(path, 2, "cpu")
    assert not processes.usable(path, 5, "cpu")  # another size would start a pool
    monkeypatch.setattr(processes, "PROCESS_MIN_BYTES", 0)
    assert not processes.usable(path, 1, "cpu")
    assert processes.usable(path, 4, "mlx")  # each worker drives the device
    monkeypatch.setattr(mlx_sizing, "_physical_memory", lambda: 128 << 30)
    assert processes.worker_count(16, "mlx") == 12  # 3/4 of them
    assert processes.worker_count(64, "mlx") == 16  # one per 8 GiB of memory
    assert processes.worker_count(2, "mlx") == 1  # the pass stays in this process
    monkeypatch.setattr(mlx_sizing, "_physical_memory", lambda: 12 << 30)
    assert processes.worker_count(16, "mlx") == 1
    monkeypatch.setattr(mlx_sizing, "_physical_memory", lambda: 128 << 30)
    monkeypatch.setattr(sys, "platform", "darwin")  # Metal in worker processes: untested, so not used
    assert processes.worker_count(16, "mlx") == 1
    assert processes.worker_count(16, "cpu") == 16
    monkeypatch.undo()
    monkeypatch.setattr(processes, "PROCESS_MIN_BYTES", 0)
    assert processes.worker_count(64, "cpu") == 64
    assert not processes.usable(path, 1, "mlx")
    assert not processes.usable("http://example.com/a.kv", 4, "mlx")
    assert not processes.usable("http://example.com/a.kv", 4, "cpu")
    assert not processes.usable("file://" + path, 4, "cpu")


def test_workers_are_other_processes() -> None:
    processes.start(2)
    pids = {processes._pool(2).submit(os.getpid).result() for _ in range(8)}
    assert os.getpid() not in pids


LAYOUTS = {  # layout: whether the pass regroups its segments by head within windows
    "layer-major, 1 MiB segments": False,
    "layer-major, small chunks": True,
    "appended in small steps": True,
    "appended in large steps": False,
    "two sequences": True,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_processes_give_the_one_worker_tables_exactly(tmp_path: Path, layout: str) -> None:
    """Every column, every row, the row order, for each way the pass groups a file's segments:
    one head's chunks in file order (released one by one), small segments regrouped by head
    within windows (released window by window), large interleaved segments read one by one;
    pre-RoPE keys too."""
    path = tmp_path / "f.kv"
    if layout == "layer-major, 1 MiB segments":
        random_file(path, layers=3, heads=2, tokens=4096, dim=64, chunk_bytes=2048 * 64 * 4, rope=True)
    elif layout == "layer-major, small chunks":
        random_file(path, layers=3, heads=4, tokens=700, dim=32, chunk_bytes=100 * 32 * 4, rope=True)
    elif layout == "appended in small steps":
        _appended(path, step=8)
    elif layout == "appended in large steps":
        _appended(path, step=8192, tokens=16384)
    else:
        _appended(path, step=16, seqs=2)
    with kvformat.open(path) as snap:
        assert any(w.release for w in windows(snap)) == LAYOUTS[layout]
    for keys in ("post_rope", "pre_rope"):
        one = _table(path, 1, keys=keys)
        assert one.num_rows > 0
        for jobs in (2, 3):
            assert _table(path, jobs, keys=keys).equals(one), (keys, jobs)
    whole = _table(path, 1)
    for jobs in (1, 2):  # a file in parts (`PassOptions.part`, as a batch hands it out): the rows
        parts = [t for i in range(3) for t in layer_tables(path, PassOptions(workers=jobs, part=(i, 3)))]
        assert pa.concat_tables(parts).equals(whole), jobs


def test_layers_come_back_in_the_one_worker_order_with_equal_accumulators(tmp_path: Path) -> None:
    path = tmp_path / "f.kv"
    _appended(path, step=8)
    one = list(layers(path, PassOptions(workers=1)))
    many = list(layers(path, PassOptions(workers=3)))
    assert [(name, index, layer, list(acc)) for name, index, layer, acc in many] == [
        (name, index, layer, list(acc)) for name, index, layer, acc in one
    ]
    for (_, _, _, a), (_, _, _, b) in zip(one, many, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key].gram, b[key].gram)
            assert a[key].top == b[key].top


def test_finished_layers_come_back_sealed_small_and_with_the_one_worker_rows(tmp_path: Path) -> None:
    """A pass that wants the rows alone (``finish``) gets them from its workers without the sums:
    a fraction of the full accumulator's pickle, the same rows, and nothing can be added."""
    path = tmp_path / "f.kv"
    random_file(path, layers=2, heads=2, tokens=512, dim=64, rope=True)
    one = list(layers(path, PassOptions(workers=1), finish=True))
    many = list(layers(path, PassOptions(workers=2), finish=True))
    for (_, _, _, a), (_, _, _, b) in zip(one, many, strict=True):
        assert list(a) == list(b)
        for key, sealed in b.items():
            full = pickle.dumps(a[key])
            assert len(pickle.dumps(sealed)) < len(full) / 4
            assert sealed.gram is None and a[key].gram.shape == (64, 64)
            got, want = sealed.row_arrays(), a[key].row_arrays()
            assert list(got) == list(want)
            for column, value in want.items():
                np.testing.assert_array_equal(got[column], value, err_msg=column)
            with pytest.raises(RuntimeError, match="sealed"):
                sealed.add(np.ones((2, 64), np.float32), np.arange(2))
            with pytest.raises(RuntimeError, match="sealed"):
                a[key].merge(sealed)


def test_a_damaged_chunk_stops_the_pass_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "f.kv"
    random_file(path, layers=2, heads=4, tokens=300, dim=16, chunk_bytes=50 * 16 * 4)
    with kvformat.open(path) as snap:
        segment = [s for s in snap.segments() if (s.layer, s.head) == (1, 2)][1]
        offset = int(snap._file.table["offset"][segment.v_chunk])
    raw = bytearray(path.read_bytes())
    raw[offset + 64 + 5] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(kvformat.ChecksumError, match="payload CRC-32C"):
        _table(path, 3)


def test_a_pass_stopped_early_leaves_the_pool_usable(tmp_path: Path) -> None:
    path = tmp_path / "f.kv"
    random_file(path, layers=4, heads=4, tokens=200, dim=16, chunk_bytes=40 * 16 * 4)
    tables = stats_for_file(path, jobs=2)
    first = next(iter(tables))
    tables.close()  # type: ignore[attr-defined]
    whole = _table(path, 2)
    assert whole.slice(0, first.num_rows).equals(first)
    assert whole.equals(_table(path, 1))


def test_a_script_without_a_main_guard_runs_once(tmp_path: Path) -> None:
    """``multiprocessing`` imports ``__main__`` into workers it starts; the pass's workers are
    started without it, so an unguarded script is not run again by each of them."""
    path = tmp_path / "f.kv"
    random_file(path, layers=2, heads=2, tokens=64, dim=16)
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from kvsnap.analysis.engine import processes
            from kvsnap.analysis.engine.batch import head_stats
            processes.PROCESS_MIN_BYTES = 0  # a small file, on processes all the same
            processes.start(2)  # the workers asked for on a helper thread, the pass at once
            print("rows", head_stats({str(path)!r}, jobs=2).height, flush=True)
            main = sys.modules["__main__"]
            print(processes._running(2), main.__file__ == {str(script)!r}, main.__spec__ is None)
            """
        )
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["rows", "8", "True", "True", "True"]


def test_threads_still_serve_urls(tmp_path: Path) -> None:
    """A URL's pass stays on threads (`OrderedPool`); a ``file://`` URL maps the same file."""
    path = tmp_path / "f.kv"
    random_file(path, layers=3, heads=4, tokens=500, dim=32, chunk_bytes=100 * 32 * 4)
    url = "file://" + str(path)
    assert head_stats(url, jobs=3).drop("file").equals(head_stats(path, jobs=1).drop("file"))


def test_a_worker_killed_between_passes_is_replaced(tmp_path: Path) -> None:
    """A kept pool whose worker died (killed, out of memory) is replaced by the next pass."""
    import signal
    import time

    path = tmp_path / "f.kv"
    random_file(path, layers=2, heads=4, tokens=100, dim=16)
    one = _table(path, 1)
    assert _table(path, 2).equals(one)
    pool = processes._pool(2)
    os.kill(pool.submit(os.getpid).result(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the pool has seen it
        try:
            pool.submit(os.getpid).result()
        except Exception:
            break
        time.sleep(0.1)
    assert _table(path, 2).equals(one)
    assert processes._pool(2) is not pool


def _make(path: Path, layout: str) -> None:
    if layout == "layer-major, small chunks":
        random_file(path, layers=3, heads=4, tokens=2500, dim=32, chunk_bytes=600 * 32 * 4, rope=True)
    elif layout == "appended in small steps":
        _appended(path, step=8)
    else:
        _appended(path, step=16, seqs=2)


@pytest.mark.parametrize("layout", ["layer-major, small chunks", "appended in small steps", "two sequences"])
def test_mlx_on_worker_processes_gives_the_one_process_table(tmp_path: Path, layout: str) -> None:
    """On mlx each worker process drives the device with its own pipeline: the table equals the
    one-process mlx pass's (CPU mlx here: the same pieces and sums; a GPU's reductions may
    round otherwise, within `mlx_backend.TOLERANCES` of the CPU kernel), post- and pre-RoPE."""
    path = tmp_path / "f.kv"
    _make(path, layout)
    for keys in ("post_rope", "pre_rope"):
        one = _table(path, 1, keys=keys, backend="mlx")
        assert one.num_rows > 0
        assert _table(path, 3, keys=keys, backend="mlx").equals(one), keys
    assert processes.worker_count(3, "mlx") == 2 and processes._running(2, "mlx")


def test_the_parent_of_an_mlx_worker_pass_does_not_start_mlx(tmp_path: Path) -> None:
    """Only the workers drive the device: the parent finds mlx installed and never imports it
    (on CUDA that would start a context of its own and map the CUDA libraries)."""
    path = tmp_path / "f.kv"
    _make(path, "layer-major, small chunks")
    script = textwrap.dedent(
        f"""
        import sys
        from kvsnap.analysis.engine import processes
        from kvsnap.analysis.engine.tables import stats_for_file
        processes.PROCESS_MIN_BYTES = 0
        rows = sum(t.num_rows for t in stats_for_file({str(path)!r}, jobs=3, backend="mlx"))
        print(rows, processes._running(2, "mlx"), "mlx.core" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows, on_workers, imported = done.stdout.split()
    assert int(rows) > 0 and on_workers == "True" and imported == "False"


def test_mlx_workers_are_spawned_without_the_cpu_kernels(tmp_path: Path) -> None:
    """mlx workers are spawned, not forked from the fork server that holds the CPU kernels, and
    nothing in an mlx pass loads them (its rows' eigenvalues are LAPACK's): a worker maps no
    ``_native`` library. Its BLAS runs one thread. The pool is kept per backend: a CPU pass after
    it gets the fork server's workers."""
    path = tmp_path / "f.kv"
    _make(path, "layer-major, small chunks")
    _table(path, 3, backend="mlx")
    assert processes._running(2, "mlx")
    pool = processes._pool(2, "mlx")
    pids = {pool.submit(os.getpid).result() for _ in range(6)}
    blas = pool.submit(threadpoolctl.threadpool_info).result()
    assert blas and all(library["num_threads"] == 1 for library in blas if library["user_api"] == "blas")
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        assert "libmlx" in maps  # a worker that drove the device
        assert "_native" not in maps, pid
    _table(path, 3, backend="cpu")
    assert processes._running(3, "cpu") and not processes._running(2, "mlx")


def test_a_damaged_chunk_stops_an_mlx_worker_pass_and_the_next_pass_is_right(tmp_path: Path) -> None:
    """The copy threads of a worker's pipeline find the damaged chunk; the pass stops with its
    name; the worker drops what that pipeline held, so a later pass over a sound file gives the
    one-process table."""
    sound, damaged = tmp_path / "sound.kv", tmp_path / "damaged.kv"
    _make(sound, "layer-major, small chunks")
    raw = bytearray(sound.read_bytes())
    with kvformat.open(sound) as snap:
        segment = [s for s in snap.segments() if (s.layer, s.head) == (1, 2)][2]
        offset = int(snap._file.table["offset"][segment.k_chunk])
    raw[offset + 64 + 7] ^= 4
    damaged.write_bytes(bytes(raw))
    one = _table(sound, 1, backend="mlx")
    for _ in range(2):
        with pytest.raises(kvformat.ChecksumError, match=f"chunk {segment.k_chunk} .*payload CRC-32C"):
            _table(damaged, 3, backend="mlx")
        assert _table(sound, 3, backend="mlx").equals(one)


def test_a_command_that_fails_right_after_asking_for_workers_prints_one_line(tmp_path: Path) -> None:
    """`stats --keys pre_rope` on a file without RoPE metadata, large enough in heads that the
    command asks for 16 workers as it starts: it fails before they are used, and says so in one
    line, every time, and ends: no worker left starting prints a traceback as this process exits
    (a race that showed in most runs before the command waited for them)."""
    path = tmp_path / "many-heads.kv"
    random_file(path, layers=8, heads=8, tokens=8, dim=8)  # 64 heads: worth 16 workers
    for _ in range(4):
        done = subprocess.run(
            [sys.executable, "-m", "kvsnap", "stats", str(path), "--keys", "pre_rope", "--jobs", "16"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [
            "kvsnap: error: RopeError: the snapshot's metadata has no 'rope' description; cannot undo RoPE"
        ], done.stderr
