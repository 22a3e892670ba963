"""`kvsnap stats FILE -o out.parquet` as a user runs it: a fresh process each time, default
settings, end to end (interpreter, imports, workers, the pass, the Parquet file), against the
machine's own sequential read of the same file in the same run.

    python -m benchmarks.cli_bench [--dir /tmp/kvsnap-cli-bench] [--runs 5] [--backends cpu,mlx]
        [--files tiny,tiny-bf16,bf16] [--variant KVSNAP_MLX_WARM=0] [--tree OLD_TREE]

Files (written once, then reused; ``--files`` picks them): two tiny ones (``tiny``, ``tiny-bf16``:
2 layers x 2 heads x 40 tokens, float32 and bfloat16: the fixed cost, the second with ml_dtypes'
import), the Qwen3-8B-shaped bfloat16 one of `benchmarks.analysis_bench` (``bf16``: 36 x 8 x 128
x 8192 tokens, 1.2 GB), its seed-shaped float32 one (``fp32``: 32 x 32 x 128 x 8192 tokens,
8.59 GB) and shorter Qwen3-8B-shaped ones (``bf16-TOKENS``, e.g. ``bf16-1024``: 151 MB, a file
of `benchmarks.analysis_bench`'s batch; ``bf16-32``: 4.7 MB); the last three not in the default
set. ``--variant NAME=VALUE`` (repeatable) adds a row per setting:
the same command with that variable set, its runs alternated with the plain ones (A B A B), so
that a slow spell of a shared machine slows both alike. ``--tree PATH`` (repeatable) adds a row
the same way for the code of another source tree (a checkout holding ``kvformat/`` and
``kvsnap/``, its ``kvsnap/analysis`` and ``kvsnap/capture`` linked to the stages' folders, as an
install maps them), run from that tree. Each row: median and range
over ``--runs`` fresh runs, the largest resident set of any process of the run and the PSS of the
whole process tree (`benchmarks.memory`), and the ratio of the read's time to the command's (1.0x:
as fast as reading the file once; higher is faster). The page cache is warm: each file is read
once before its runs, and kvsnap's modules are byte-compiled first, as ``pip install`` leaves them
(where ``PYTHONDONTWRITEBYTECODE`` is set, as on the accelerator machine, every fresh process
would otherwise compile them from source: 0.13 s and more of each run there).
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvformat
from benchmarks.analysis_bench import SHAPES, write
from benchmarks.memory import run_sampled
from benchmarks.timing import DEPENDENCIES, blas_line, byte_compile

COMMAND = 'import sys; sys.argv[0] = "kvsnap"; from kvsnap.cli.launch import console; console()'
"""What the ``kvsnap`` console script runs."""


FILES = ("tiny", "tiny-bf16", "bf16", "fp32", "bf16-TOKENS")


def files(directory: Path, names: tuple[str, ...] = FILES[:3]) -> dict[str, Path]:
    """The benchmark's files ``names`` (of `FILES`), written if missing, by label."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny, tiny_bf16 = directory / "tiny.kv", directory / "tiny-bf16.kv"
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((2, 40, 16)).astype(np.float32) for _ in range(2))
    for path, dtype in ((tiny, np.float32), (tiny_bf16, SHAPES["qwen3-8b-bf16"][3])):
        if not path.exists():
            k16, v16 = k.astype(dtype), v.astype(dtype)
            kvformat.save(path, [kvformat.Layer(k16, v16), kvformat.Layer(v16, k16)])
    chosen = {}
    for name, label, path in (
        ("tiny", "tiny (2 x 2 x 40 float32)", tiny),
        ("tiny-bf16", "tiny (2 x 2 x 40 bfloat16)", tiny_bf16),
        ("bf16", "Qwen3-8B bf16, 8192 tokens", directory / "qwen3-8b-bf16.kv"),
        ("fp32", "seed fp32, 8192 tokens", directory / "seed-fp32.kv"),
        *(
            (name, f"Qwen3-8B bf16, {name[5:]} tokens", directory / f"qwen3-8b-bf16-{name[5:]}.kv")
            for name in names
            if name.startswith("bf16-")
        ),
    ):
        if name not in names:
            continue
        if not path.exists():  # the big ones; `write` is a no-op for an existing file
            shape = "seed-fp32" if name == "fp32" else "qwen3-8b-bf16"
            layers, heads, dim, dtype = SHAPES[shape]
            tokens = int(name[5:]) if name.startswith("bf16-") else 8192
            write(path, layers, heads, dim, tokens, dtype, "raw")
        chosen[label] = path
    return chosen


def read_seconds(path: Path) -> float:
    """The fastest of three sequential reads of ``path`` by a fresh ``cat`` (the page cache warm)."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return min(times)


def _environment(setting: str | None) -> tuple[dict[str, str] | None, str | None]:
    """The environment and working folder of a run with ``setting``: None for the plain row,
    ``NAME=VALUE`` for a variant, ``tree=PATH`` for another tree's code (its folder first on the
    path: a ``-c`` command imports from its working folder first)."""
    if setting is None:
        return None, None
    name, value = setting.split("=", 1)
    if name == "tree":
        path = os.pathsep.join([value, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
        return dict(os.environ, PYTHONPATH=path), value
    return dict(os.environ, **{name: value}), None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/kvsnap-cli-bench")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="cpu,mlx")
    parser.add_argument("--files", default="tiny,tiny-bf16,bf16", help=f"of {','.join(FILES)}")
    parser.add_argument("--variant", action="append", default=[], help="NAME=VALUE: a row with it set")
    parser.add_argument("--tree", action="append", default=[], help="another source tree's row")
    args = parser.parse_args()
    names = tuple(args.files.split(","))
    shorter = {name for name in names if name.startswith("bf16-") and name[5:].isdigit() and int(name[5:])}
    if unknown := set(names) - set(FILES) - shorter:
        parser.error(f"--files: unknown {', '.join(sorted(unknown))}; choose from {', '.join(FILES)}")
    if bad := [v for v in args.variant if "=" not in v]:
        parser.error(f"--variant wants NAME=VALUE, not {bad[0]!r}")
    trees = [str(Path(tree).resolve()) for tree in args.tree]
    if missing := [tree for tree in trees if not Path(tree, "kvsnap", "analysis").is_dir()]:
        parser.error(f"--tree: {missing[0]} has no kvsnap/analysis (link it to the analysis/ folder)")
    print(blas_line())
    compiled = byte_compile()
    if compiled:
        print(f"byte-compiled {compiled} modules of {', '.join(DEPENDENCIES)} that had no bytecode")
    for tree in trees:
        compileall.compile_dir(tree, quiet=1)
    directory = Path(args.dir).resolve()
    print("| file | backend | fresh `kvsnap stats -o`: median (range) | read | read / cmd | peak RSS | PSS |")
    print("|---|---|---:|---:|---:|---:|---:|")
    settings: list[str | None] = [None, *args.variant, *(f"tree={tree}" for tree in trees)]
    for label, path in files(directory, names).items():
        read = read_seconds(path)
        for backend in args.backends.split(","):
            times: dict[str | None, list[float]] = {s: [] for s in settings}
            rss = dict.fromkeys(settings, 0)
            tree = dict.fromkeys(settings, 0)
            failed: dict[str | None, str] = {}
            for _ in range(args.runs):
                for setting in settings:
                    if setting in failed:
                        continue
                    out = directory / "out.parquet"
                    command = [sys.executable, "-c", COMMAND, "stats", str(path), "-o", str(out), "--force"]
                    command += ["--backend", backend]
                    env, cwd = _environment(setting)
                    start = time.perf_counter()
                    try:
                        sampled = run_sampled(command, env=env, cwd=cwd)
                    except subprocess.CalledProcessError as error:
                        failed[setting] = error.stderr.strip()[-200:]
                        continue
                    times[setting].append(time.perf_counter() - start)
                    rss[setting] = max(rss[setting], sampled.largest_rss)
                    tree[setting] = max(tree[setting], sampled.tree_pss)
            for setting in settings:
                shown = backend + (f", {setting}" if setting else "")
                if setting in failed:
                    print(f"| {label} | {shown} | failed: {failed[setting]} | | | | |")
                    continue
                median = statistics.median(times[setting])
                print(
                    f"| {label} | {shown} | {median:.2f} s ({min(times[setting]):.2f}-"
                    f"{max(times[setting]):.2f}) | {read:.3f} s | {read / median:.3f}x "
                    f"| {rss[setting] / 2**20:.0f} MiB | {tree[setting] / 2**20:.0f} MiB |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
