"""One `analysis_bench` measurement under two source trees, alternated: ``A B A B ...`` per file,
so a slow machine or a noisy neighbour slows both alike. Each run is a fresh process started in
its tree (a tree: a checkout holding ``kvformat/`` and ``kvsnap/``).

    python -m benchmarks.ab --mode stats:all:1:mlx:warm --a OLD_TREE --b NEW_TREE FILE...
    python -m benchmarks.ab --mode stats:all:16:mlx:warm4 --a . --b . --b-env KVSNAP_MLX_STAGING=host FILE

``--a-env`` / ``--b-env NAME=VALUE`` (repeatable) set environment variables for one side only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.analysis_bench import CHILD


def run(mode: str, path: Path, tree: Path, env: list[str] | None = None) -> tuple[float, int]:
    """Seconds and peak resident bytes (that process) of one ``mode`` run on ``path`` with the
    code of ``tree`` (``env``: ``NAME=VALUE`` settings added to the environment)."""
    tree = tree.resolve()
    extra = dict(setting.split("=", 1) for setting in env or [])
    python_path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(path.resolve())],
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
        env={**os.environ, **extra, "PYTHONPATH": python_path},
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return float(measured["seconds"]), int(measured["max_rss"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="stats:all:1:mlx:warm")
    parser.add_argument("--a", type=Path, required=True, help="the reference tree")
    parser.add_argument("--b", type=Path, required=True, help="the tree compared with it")
    parser.add_argument("--a-env", action="append", default=[], help="NAME=VALUE for A's runs")
    parser.add_argument("--b-env", action="append", default=[], help="NAME=VALUE for B's runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    print(f"A: {args.a} {' '.join(args.a_env)}; B: {args.b} {' '.join(args.b_env)}")
    print(
        "| file | mode | A: median (min) | B: median (min) | A / B | peak RSS A / B (median, MiB) |\n"
        "|---|---|---:|---:|---:|---:|"
    )
    for path in args.files:
        times: dict[str, list[float]] = {"a": [], "b": []}
        rss: dict[str, list[int]] = {"a": [], "b": []}
        for _ in range(args.rounds):
            for name in ("a", "b"):
                seconds, peak = run(args.mode, path, getattr(args, name), getattr(args, f"{name}_env"))
                times[name].append(seconds)
                rss[name].append(peak)
        a, b = statistics.median(times["a"]), statistics.median(times["b"])
        print(
            f"| {path.name} | {args.mode} | {a:.2f} s ({min(times['a']):.2f}) "
            f"| {b:.2f} s ({min(times['b']):.2f}) | {a / b:.2f}x "
            f"| {statistics.median(rss['a']) / 2**20:.0f} / {statistics.median(rss['b']) / 2**20:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
