"""The ``kvsnap`` entry point (`kvsnap.cli.launch`, `kvsnap.analysis.commands.early_start`): it
starts the CPU workers' fork server before anything heavy is imported, for the default
``kvsnap stats`` of one big local file only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvsnap.analysis.commands import early_start
from kvsnap.analysis.engine import fork_server
from kvsnap.cli.launch import main


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """A sparse file of `PROCESS_MIN_BYTES`, scaled to this machine's cores (the decision reads
    its size only)."""
    path = tmp_path / "big.kv"
    with open(path, "wb") as f:
        f.truncate(fork_server.process_min_bytes(early_start.cores()))
    return path


def test_the_default_stats_of_one_big_local_file_wants_the_fork_server(
    big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(early_start, "cores", lambda: 16)
    small = tmp_path / "small.kv"
    small.write_bytes(b"x")
    file = str(big)
    assert early_start.wanted(["stats", file])
    assert early_start.wanted(["stats", file, "-o", str(tmp_path / "out.parquet"), "--force"])
    assert early_start.wanted(["stats", "--factor", "2", file])
    assert early_start.wanted(["stats", file, "--backend=cpu"])  # the default, spelled out
    assert early_start.wanted(["stats", "--backend", "cpu", file])
    # The command may start no CPU workers: it decides for itself.
    for other in (
        ["stats", file, "--backend", "mlx"],
        ["stats", file, "--backend=mlx"],
        ["stats", file, "--jobs", "4"],
        ["stats", file, "--engine", "ray"],
        ["stats", file, "--merge"],
        ["stats", file, "--stats", "attention"],
        ["stats", file, file],  # two files: the batch plans its processes
        ["stats", str(small)],
        ["stats", "-o", file, str(small)],  # the big one is the output
        ["stats", "https://example.com/big.kv"],
        ["stats", str(tmp_path / "missing.kv")],
        ["info", file],
        ["stats"],
    ):
        assert not early_start.wanted(other), other
    monkeypatch.setattr(early_start, "cores", lambda: 1)
    assert not early_start.wanted(["stats", file])


def test_the_decision_reads_the_stats_commands_own_arguments(
    big: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The early start parses with the definitions `kvsnap stats` is built from: every option of
    the command's parser is known to it (so a value is never taken for the file), the values of
    the command's other options leave the decision as it is, and arguments the command refuses
    start nothing."""
    from kvsnap.cli import build_parser

    stats = build_parser()._subparsers._group_actions[0].choices["stats"]  # type: ignore[union-attr]
    early = early_start._Parser(add_help=False)
    early_start.stats_arguments(early)
    assert set(stats._option_string_actions) - {"-h", "--help"} == set(early._option_string_actions)
    monkeypatch.setattr(early_start, "cores", lambda: 16)
    small = str(tmp_path / "small.kv")
    file = str(big)
    for values in (
        ["-o", small, "--window", "64"],
        ["--needle", "0:4", "--retrieval", "all"],
        ["--storage-option", "anon=true", "--keys", "pre_rope"],
        ["--snapshot", "0", "--factor", "3"],
    ):
        assert early_start.wanted(["stats", *values, file]), values
    for refused in (["--factor", "-1"], ["--retrieval", "some"], ["--backend", "tpu"]):
        assert not early_start.wanted(["stats", file, *refused]), refused


def test_the_decision_imports_nothing_heavy() -> None:
    """Deciding (the console script's first step) loads no numpy, kvformat or pyarrow."""
    code = (
        "import sys; from kvsnap.analysis.commands import early_start\n"
        "early_start.wanted(['stats', 'missing.kv', '-o', 'x.parquet'])\n"
        "print(sorted(m for m in ('numpy', 'kvformat', 'pyarrow', 'polars') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_start_early_starts_the_server_the_pool_then_uses(big: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh process: `start_early` leaves the fork server running with the kernels preloaded
    and BLAS at one thread in its environment; the pool's own start finds it (same pid)."""
    script = (
        "import sys; from multiprocessing import forkserver\n"
        "from kvsnap.analysis.commands import early_start\n"
        f"early_start.start_early(['stats', {str(big)!r}])\n"
        "first = forkserver._forkserver._forkserver_pid\n"
        "from kvsnap.analysis.engine import processes\n"
        "processes._pool(2, 'cpu')\n"
        "print(first is not None and first == forkserver._forkserver._forkserver_pid)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip().splitlines()[-1] == ("True" if early_start.cores() > 1 else "False")


def test_start_early_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(argv: object) -> bool:
        raise OSError("no")

    monkeypatch.setattr(early_start, "wanted", broken)
    early_start.start_early(["stats", "x.kv"])


def test_the_entry_point_runs_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    k = np.ones((2, 8, 4), np.float32)
    kvformat.save(tmp_path / "a.kv", [kvformat.Layer(k, k)])
    assert main(["stats", str(tmp_path / "a.kv")]) == 0
    assert "mean ||K|| per layer and KV head" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "a.kv")]) == 0
    assert main(["info", str(tmp_path / "missing.kv")]) == 2


def test_python_dash_m_kvsnap_is_the_command(tmp_path: Path) -> None:
    k = np.ones((2, 8, 4), np.float32)
    kvformat.save(tmp_path / "a.kv", [kvformat.Layer(k, k)])
    done = subprocess.run(
        [sys.executable, "-m", "kvsnap", "stats", str(tmp_path / "a.kv")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "mean ||K|| per layer and KV head" in done.stdout


@pytest.mark.parametrize("backend", ["cpu", "mlx"])
def test_the_console_script_ends_at_once_after_driving_mlx(tmp_path: Path, backend: str) -> None:
    """`console` ends the process with `os._exit` after a command that imported mlx (its CUDA
    teardown is slow), once the output is written and flushed: the table is whole, the
    printout complete, the status kept, and the interpreter's exit handlers skipped; on the CPU
    backend the process ends normally."""
    pytest.importorskip("mlx.core")
    import pyarrow.parquet as pq

    k = np.random.default_rng(0).standard_normal((2, 300, 16)).astype(np.float32)
    kvformat.save(tmp_path / "a.kv", [kvformat.Layer(k, k), kvformat.Layer(k, k)])
    out = tmp_path / "out.parquet"
    script = (
        "import atexit, sys; atexit.register(lambda: print('exit handlers ran'))\n"
        "sys.argv = ['kvsnap', *sys.argv[1:]]\n"
        "from kvsnap.cli.launch import console; console()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "stats", str(tmp_path / "a.kv"), "--backend", backend, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "mean ||K|| per layer and KV head" in done.stdout
    assert ("exit handlers ran" in done.stdout) == (backend == "cpu")
    assert pq.read_table(out).num_rows == 2 * 2 * 2
    failed = subprocess.run(
        [sys.executable, "-c", script, "stats", str(tmp_path / "missing.kv"), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode != 0 and "missing.kv" in failed.stderr


def test_the_console_script_lets_running_threads_finish(tmp_path: Path) -> None:
    """After mlx, a thread the interpreter would wait for (not a daemon) still finishes its
    work: the console script then ends the process the ordinary way."""
    pytest.importorskip("mlx.core")
    k = np.ones((2, 8, 4), np.float32)
    kvformat.save(tmp_path / "a.kv", [kvformat.Layer(k, k)])
    script = (
        "import sys, threading, time; import mlx.core\n"
        "threading.Thread(target=lambda: (time.sleep(1.5), print('thread finished'))).start()\n"
        "sys.argv = ['kvsnap', *sys.argv[1:]]\n"
        "from kvsnap.cli.launch import console; console()"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "info", str(tmp_path / "a.kv")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "thread finished" in done.stdout
