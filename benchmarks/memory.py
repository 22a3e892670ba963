"""Memory of a process tree (Linux /proc): what a benchmark's child and every process it started
hold, sampled while it runs."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(parents.get(pid, []))
    return found


def _field(path: str, name: str) -> int:
    """A ``kB`` field of a /proc status-like file, in bytes (0 when the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss(pid: int) -> int:
    """Resident set of ``pid``, bytes (pages shared with other processes counted in full)."""
    return _field(f"/proc/{pid}/status", "VmRSS:")


def anonymous(pid: int) -> int:
    """Anonymous resident memory of ``pid``, bytes: its own, beyond the files it maps (a mapped
    file's pages sit in the page cache, shared by every process that maps it)."""
    return _field(f"/proc/{pid}/status", "RssAnon:")


def pss(pid: int) -> int:
    """Proportional set of ``pid``, bytes: each shared page divided among the processes that map
    it, so the sum over a tree of forked workers counts their shared libraries once."""
    return _field(f"/proc/{pid}/smaps_rollup", "Pss:")


@dataclass
class Sampled:
    """What `run_sampled` saw: the command's stdout, the peak of the summed proportional set of
    it and its descendants, and the largest resident set of any one of them (bytes)."""

    stdout: str
    tree_pss: int
    largest_rss: int


def run_sampled(
    command: list[str], env: dict[str, str] | None = None, interval: float = 0.05, cwd: str | None = None
) -> Sampled:
    """Run ``command`` (in ``cwd``) and sample the memory of it and its descendants every
    ``interval`` s (`Sampled`). Raises CalledProcessError on failure."""
    import tempfile

    # Output to files, not pipes: a command printing more than a pipe holds (64 KiB) would wait
    # for a reader while this loop waits for it to end.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env, cwd=cwd)
        tree_pss = largest_rss = 0
        while process.poll() is None:
            pids = descendants(process.pid)
            tree_pss = max(tree_pss, sum(pss(pid) for pid in pids))
            largest_rss = max([largest_rss] + [rss(pid) for pid in pids])
            time.sleep(interval)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command, stdout, stderr)
    return Sampled(stdout, tree_pss, largest_rss)


@dataclass
class TreeSampler:
    """The largest resident set of each process below ``root`` (itself included), sampled every
    ``interval`` s on a thread while in use (``with TreeSampler(pid) as sampler: ...``), in
    ``peaks`` (pid: bytes). On the H200 machine samples like these saw mlx workers ~50 MiB above
    the ``VmHWM`` that another run of the same pass reported (the benchmarks in `benchmarks/`)."""

    root: int
    interval: float = 0.02
    peaks: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvsnap-memory-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def sample(self) -> None:
        """One look at every process of the tree."""
        for pid in descendants(self.root):
            resident = rss(pid)
            if resident > self.peaks.get(pid, 0):
                self.peaks[pid] = resident

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
