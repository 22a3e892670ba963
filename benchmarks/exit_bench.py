"""How long a fresh ``kvsnap stats FILE -o out.parquet`` takes to end once the command has
returned: the interpreter's exit (its handlers, threads, mlx's CUDA teardown when the command
drove the device), per backend, with the console script's own ending (`kvsnap.cli.launch.console`)
and with the command returning to an ordinary interpreter exit.

    python -m benchmarks.exit_bench FILE [--runs 3] [--backends cpu,mlx]

Each run is a new process; it writes the time at which the command returned to a file, and the
probe takes the time the process ended; medians over ``--runs``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, time
sys.argv = ["kvsnap", *sys.argv[2:]]
mark = {mark!r}
from kvsnap.cli.launch import console, main
if {console}:
    import kvsnap.cli.launch as launch
    real = launch.main
    def timed(argv=None):
        code = real(argv)
        open(mark, "w").write(repr(time.time()))
        return code
    launch.main = timed
    console()
code = main()
open(mark, "w").write(repr(time.time()))
raise SystemExit(code)
"""


def one_run(path: str, backend: str, console: bool) -> float:
    """Seconds from the command's return to the process's end, one fresh process."""
    with tempfile.TemporaryDirectory() as folder:
        mark = os.path.join(folder, "returned")
        out = os.path.join(folder, "out.parquet")
        child = CHILD.format(mark=mark, console=console)
        command = [sys.executable, "-c", child, "-", "stats", path, "--backend", backend, "-o", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        ended = time.time()
        with open(mark) as f:
            return ended - float(f.read())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("file")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backends", default="cpu,mlx")
    args = parser.parse_args()
    print("| backend | ending | from the command's return to the process's end: median (range) |")
    print("|---|---|---:|")
    for backend in args.backends.split(","):
        for console in (True, False):
            times = [one_run(args.file, backend, console) for _ in range(args.runs)]
            label = "console script" if console else "ordinary interpreter exit"
            print(
                f"| {backend} | {label} | {statistics.median(times):.3f} s "
                f"({min(times):.3f}-{max(times):.3f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
