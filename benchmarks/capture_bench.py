"""Capture benchmark, all in one run on SmolLM2-135M (fixture model):

1. snapshot save time vs a bare ``f.write(memoryview)`` of the same K/V bytes, and vs mlx-lm's
   ``save_prompt_cache`` on the same cache (time and size on disk);
2. the overhead that snapshots every 16 tokens (one series file) add to a 256-token generation.

    python -m benchmarks.capture_bench [--tokens 256] [--every 16] [--context 2048]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

from benchmarks.timing import best_of
from capture import generate, snapshot_kv
from capture.fixtures import fetch_model
from capture.generate import SeriesWriter
from kvformat.checksum import crc32c


def bare_write(path: Path, buffers: list[memoryview], durable: bool) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        for buffer in buffers:
            f.write(buffer)
        f.flush()
        if durable:
            os.fsync(f.fileno())


def save_rows(model: Any, path: str, context: int, tmp: Path, lines: list[str]) -> tuple[list[Any], float]:
    """Rows comparing one snapshot save of a ``context``-token cache with a bare write of the
    same bytes and with the gather + CRC + write floor; returns the cache and the save time."""
    cache = make_prompt_cache(model)
    prompt = mx.array(np.random.default_rng(0).integers(100, 40000, context))
    model(prompt[None], cache=cache)
    mx.eval([c.state for c in cache])
    snap = snapshot_kv(cache, model, model_path=path)
    views = [
        side[0][h] for layer in snap.layers for side in (layer.k, layer.v) for h in range(side[0].shape[0])
    ]
    strided = sum(not view.flags.c_contiguous for view in views)
    buffers = [memoryview(np.ascontiguousarray(view).view(np.uint8).reshape(-1)) for view in views]
    nbytes = sum(b.nbytes for b in buffers)
    kv_path, bare_path = tmp / "s.kv", tmp / "bare.bin"
    what = f"{context} tokens ({nbytes / 1e6:.1f} MB K/V, {strided} of {len(views)} heads strided)"

    def save_kv(durable: bool) -> None:
        kv_path.unlink(missing_ok=True)  # both sides write a new file, not over an old one
        snapshot_kv(cache, model, model_path=path).save(kv_path, durable=durable)

    kv_s = 0.0
    for durable in (True, False):
        kv_s = best_of(15, lambda durable=durable: save_kv(durable))
        bare_s = best_of(15, lambda durable=durable: bare_write(bare_path, buffers, durable))
        label = "with fsync" if durable else "no fsync"
        lines.append(
            f"| snapshot + save, {what}, {label} "
            f"| {kv_s * 1e3:.1f} ms | bare f.write {bare_s * 1e3:.1f} ms | {bare_s / kv_s:.2f}x |"
        )

    def required_work() -> None:
        """The least any checksummed per-head layout must do: gather each head into contiguous
        rows, CRC it, write it (one thread)."""
        bare_path.unlink(missing_ok=True)
        with open(bare_path, "wb") as f:
            for view in views:
                rows = np.ascontiguousarray(view).reshape(-1).view(np.uint8)
                crc32c(rows.data)
                f.write(rows.data)

    floor_s = best_of(15, required_work)
    lines.append(
        f"| same, no fsync, vs gather + CRC + write of each head on one thread "
        f"| {kv_s * 1e3:.1f} ms | {floor_s * 1e3:.1f} ms | {floor_s / kv_s:.2f}x |"
    )
    return cache, kv_s


def series_cost(
    model: Any, tokenizer: Any, path: str, every: int, snapshots: int, tmp: Path
) -> tuple[float, float]:
    """Median seconds one series snapshot costs (`snapshot_kv` + `SeriesWriter.add`, as
    `capture.generate` does every ``every`` tokens) and median seconds of those ``every``
    decode steps, measured alternately in one loop."""
    cache = make_prompt_cache(model)
    ids = [int(t) for t in np.random.default_rng(1).integers(100, 40000, 12)]
    logits = model(mx.array(ids)[None], cache=cache)
    series: SeriesWriter | None = None
    snapshot_s, decode_s = [], []
    rng = np.random.default_rng(2)
    for _ in range(snapshots):
        start = time.perf_counter()
        for _ in range(every):
            token = int(rng.integers(100, 40000))
            ids.append(token)
            logits = model(mx.array([[token]]), cache=cache)
            mx.eval(logits, [c.state for c in cache])
        middle = time.perf_counter()
        snap = snapshot_kv(
            cache, model, model_path=path, tokenizer=tokenizer, tokens=ids, last_logits=logits[:, -1, :]
        )
        if series is None:
            series = SeriesWriter(tmp / "cost.kv", "raw", snap.metadata)
        series.add(snap)
        snapshot_s.append(time.perf_counter() - middle)
        decode_s.append(middle - start)
    assert series is not None
    series.close()
    return float(np.median(snapshot_s)), float(np.median(decode_s))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens for the save test")
    args = parser.parse_args()
    path = str(fetch_model("smollm2-135m"))
    model, tokenizer = load(path)
    lines = ["| measurement | kvsnap | peer / machine limit | ratio |", "|---|---:|---:|---:|"]

    # 1. Save one snapshot of a filled cache: at --context tokens (a whole number of mlx-lm's
    # 256-slot steps, so the prefill leaves V as a strided view that every save must gather) and
    # at --context - 48 (V contiguous in the cache, nothing to gather).
    with tempfile.TemporaryDirectory() as tmp:
        for context in (args.context - 48, args.context):
            cache, kv_s = save_rows(model, path, context, Path(tmp), lines)
        prompt = mx.array(np.random.default_rng(0).integers(100, 40000, args.context))
        kv_path, mlx_path = Path(tmp) / "s.kv", Path(tmp) / "c.safetensors"

        def save_mlx() -> None:
            mlx_path.unlink(missing_ok=True)
            save_prompt_cache(str(mlx_path), cache)

        mlx_s = best_of(15, save_mlx)
        lines.append(
            f"| same, no fsync, vs mlx-lm save_prompt_cache (no fsync) | {kv_s * 1e3:.1f} ms "
            f"| {mlx_s * 1e3:.1f} ms | {mlx_s / kv_s:.2f}x |"
        )
        kv_size, mlx_size = kv_path.stat().st_size, mlx_path.stat().st_size
        lines.append(
            f"| size on disk, {args.context} tokens | {kv_size / 1e6:.2f} MB | save_prompt_cache "
            f"{mlx_size / 1e6:.2f} MB | {mlx_size / kv_size:.2f}x |"
        )
        small = make_prompt_cache(model)
        model(prompt[None, :18], cache=small)
        mx.eval([c.state for c in small])
        snapshot_kv(small, model).save(Path(tmp) / "small.kv")
        save_prompt_cache(str(Path(tmp) / "small.safetensors"), small)
        a, b = (Path(tmp) / "small.kv").stat().st_size, (Path(tmp) / "small.safetensors").stat().st_size
        lines.append(
            f"| size, 18-token cache | {a / 1e3:.0f} kB | save_prompt_cache {b / 1e3:.0f} kB "
            f"| {b / a:.1f}x smaller |"
        )

        # 2. Generation overhead of snapshots every N tokens.
        text = "Write a long story about a lighthouse keeper."
        ids = tokenizer.encode(text)

        eos = sorted(tokenizer.eos_token_ids)

        def no_eos(tokens: mx.array, logits: mx.array) -> mx.array:
            """Ban end-of-sequence so every run generates exactly ``--tokens`` tokens."""
            logits[:, eos] = -float("inf")
            return logits

        def plain() -> None:
            count = 0
            for _ in stream_generate(
                model, tokenizer, mx.array(ids), max_tokens=args.tokens, logits_processors=[no_eos]
            ):
                count += 1
            assert count == args.tokens

        def probed() -> None:
            out = Path(tmp) / "series.kv"
            out.unlink(missing_ok=True)
            for _ in generate(
                model,
                tokenizer,
                ids,
                max_tokens=args.tokens,
                output=out,
                every=args.every,
                logits_processors=[no_eos],
            ):
                pass

        plain()  # warm up
        plain_s, probed_s = [], []
        for _ in range(2):
            plain_s.append(best_of(1, plain))
            probed_s.append(best_of(1, probed))
        p, q = min(plain_s), min(probed_s)
        series = Path(tmp) / "series.kv"
        lines.append(
            f"| {args.tokens}-token generation, snapshot every {args.every} | {q:.2f} s "
            f"| plain stream_generate {p:.2f} s | overhead {100 * (q - p) / p:+.1f}% |"
        )
        lines.append(
            f"| series file ({args.tokens // args.every} snapshots) "
            f"| {series.stat().st_size / 1e6:.2f} MB | | |"
        )
        # 3. The same overhead measured directly: one series snapshot against the decode steps
        # between two snapshots, and the generation speed up to which it stays under 5%.
        snapshot_s, decode_s = series_cost(model, tokenizer, path, args.every, 8, Path(tmp))
        lines.append(
            f"| one series snapshot (every {args.every} tokens, median of 8) | {snapshot_s * 1e3:.1f} ms "
            f"| {args.every} decode steps {decode_s * 1e3:.0f} ms | {100 * snapshot_s / decode_s:.1f}% |"
        )
        lines.append(
            f"| generation speed up to which that stays under 5% "
            f"| {0.05 * args.every / snapshot_s:.0f} tokens/s "
            f"| this machine {args.every / decode_s:.1f} tokens/s | |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
