"""What series snapshots cost a generating thread that is busy in Python, without a GPU.

mlx-lm's decode on a GPU keeps its thread in the interpreter most of the time (building each
step's graph while the device runs the one before), so whatever a capture does on that thread,
and whatever its writer thread does while holding the interpreter lock, lengthens the run about
one for one. This benchmark reproduces that on any machine: a loop of ``--tokens`` steps, each
appending one row to every layer of a Qwen3-8B-shaped cache (36 layers x 8 KV heads x 128,
bfloat16) and then spending ``--step-ms`` of pure Python (the graph building), with a series
snapshot every ``--every`` steps through `kvsnap.capture`'s own snapshot path (device slices,
the writer, the file); against the same loop without snapshots. The series is written by the
writer thread (the default) and by a writer process (``write_in_process=True``); the three runs
of a round go in a rotating order, and each capture is compared with the plain run of its round.

    python -m benchmarks.capture_gil_bench [--runs 16] [--tokens 256] [--every 16] [--step-ms 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer

from benchmarks.capture_bench import random_model
from kvsnap.capture.fixtures import fetch_model


def busy(seconds: float) -> None:
    """Pure Python for ``seconds``: the interpreter lock held, as while building a graph."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def run(
    model: Any,
    tokenizer: Any,
    prompt_len: int,
    tokens: int,
    every: int | None,
    step_s: float,
    out: Path | None,
    in_process: bool = False,
) -> float:
    """One generation's wall time (seconds): ``tokens`` steps after a ``prompt_len`` prefill,
    a snapshot every ``every`` steps into ``out`` (None: no capture), written by the writer
    thread (the default) or by a writer process (``in_process``)."""
    generation = sys.modules["kvsnap.capture.generation"]
    caches = make_prompt_cache(model)
    heads, dim = 8, 128  # the KV shape of `qwen3-8b-kv-tiny`
    rng = np.random.default_rng(0)
    prefill = mx.array(rng.standard_normal((1, heads, prompt_len, dim)).astype(np.float32)).astype(
        mx.bfloat16
    )
    rows = [
        mx.array(rng.standard_normal((1, heads, 1, dim)).astype(np.float32)).astype(mx.bfloat16)
        for _ in range(8)
    ]
    for cache in caches:
        cache.update_and_fetch(prefill, prefill)
    mx.eval([c.state for c in caches])
    ids = [int(t) for t in rng.integers(100, 40000, prompt_len + tokens)]
    snapshots = None
    if out is not None:
        out.unlink(missing_ok=True)
        snapshots = generation._Snapshots(
            caches,
            model,
            tokenizer,
            output=out,
            separate_files=False,
            codec="raw",
            model_path=None,
            file_metadata={},
            on_snapshot=None,
            max_pending=4,
            write_in_process=in_process,
        )
    pieces: list[str] = []
    start = time.perf_counter()
    for step in range(1, tokens + 1):
        row = rows[step % len(rows)]
        for cache in caches:
            cache.update_and_fetch(row, row)
        mx.async_eval([c.keys for c in caches] + [c.values for c in caches])
        busy(step_s)
        pieces.append("x")
        if snapshots is not None and (step % (every or tokens) == 0 or step == tokens):
            snapshots.take(step, ids[: prompt_len + step], pieces, "", None)
    mx.eval([c.state for c in caches])
    if snapshots is not None:
        snapshots.close("")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=16, help="rounds")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=5.0, help="Python per step (the graph)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the SmolLM2 fixture's)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(Path(args.tokenizer or fetch_model("smollm2-135m")))
    model = random_model("qwen3-8b-kv-tiny")
    step_s = args.step_ms / 1e3
    snapshots = args.tokens // args.every + (args.tokens % args.every != 0)
    contenders = {"plain": None, "writer process": True, "writer thread": False}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "gil.kv"

        def once(name: str) -> float:
            mode = contenders[name]
            target = None if mode is None else out
            return run(model, tokenizer, args.prompt, args.tokens, args.every, step_s, target, bool(mode))

        for name in contenders:  # warm-up
            once(name)
        names = list(contenders)
        for i in range(args.runs):  # each round in another order
            order = names[i % 3 :] + names[: i % 3]
            for name in order if i % 2 == 0 else order[::-1]:
                times[name].append(once(name))
    plain = np.array(times["plain"])
    print(
        f"{args.tokens} steps of {args.step_ms:g} ms Python, a snapshot every {args.every} "
        f"({snapshots} snapshots), {args.runs} rounds: plain {np.median(plain):.3f} s"
    )
    for name in ("writer process", "writer thread"):
        captured = np.array(times[name])
        ratio = 100 * (captured / plain - 1)
        per = (captured - plain) / snapshots * 1e3
        q1, med, q3 = np.percentile(ratio, [25, 50, 75])
        print(
            f"  {name}: {np.median(captured):.3f} s, paired overhead median {med:+.2f}% "
            f"(quartiles {q1:+.2f}% .. {q3:+.2f}%), {np.median(per):.2f} ms per snapshot"
        )


if __name__ == "__main__":
    main()
