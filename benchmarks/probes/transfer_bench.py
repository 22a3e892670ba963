"""Device -> host transfer of KV-cache slices through mlx, on whatever backend mlx runs.

What a snapshot pays before any byte reaches the file, on a Qwen3-8B-shaped cache (36 layers,
8 KV heads of 128, bfloat16): the old path (``np.asarray`` of each layer's whole ``[:offset]``
view), a contiguous device copy of every layer, the new tokens of a series snapshot only, and
whether ``np.asarray`` of an mlx array is a view of mlx's memory or a copy.

    python -m benchmarks.probes.transfer_bench [--context 8192] [--layers 36]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import ml_dtypes
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, save_prompt_cache

from benchmarks.timing import best_of


def host(array: mx.array) -> np.ndarray:
    if array.dtype == mx.bfloat16:
        return np.asarray(array.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.asarray(array)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    caches = []
    for i in range(args.layers):
        cache = KVCache()
        k = mx.random.normal((1, args.context, args.heads, args.dim), key=mx.random.key(i)).astype(
            mx.bfloat16
        )
        cache.update_and_fetch(k.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3) * 2)
        caches.append(cache)
    # Decode 16 more tokens one at a time, as generation does.
    for _ in range(16):
        for cache in caches:
            t = mx.random.normal((1, args.heads, 1, args.dim)).astype(mx.bfloat16)
            cache.update_and_fetch(t, t)
    mx.eval([c.state for c in caches])
    offset = caches[0].offset
    nbytes = sum(2 * c.keys[..., :offset, :].nbytes for c in caches)
    print(f"cache: {offset} tokens, {nbytes / 1e9:.3f} GB of K/V")

    a = host(caches[0].keys[..., :offset, :])
    b = host(caches[0].keys[..., :offset, :])
    print(
        f"np.asarray twice -> same address: {a.ctypes.data == b.ctypes.data}; "
        f"c_contiguous {a.flags.c_contiguous}, owndata {a.flags.owndata}, base {type(a.base)}"
    )
    del a, b

    def old_path() -> None:
        total = 0
        for c in caches:
            for side in (c.keys, c.values):
                view = host(side[..., :offset, :])
                total += int(np.ascontiguousarray(view).view(np.uint8)[::4096].sum())

    def device_copy() -> list[mx.array]:
        flat = [
            mx.concatenate([c.keys[..., :offset, :].reshape(-1), c.values[..., :offset, :].reshape(-1)])
            for c in caches
        ]
        mx.eval(flat)
        return flat

    def new_path() -> None:
        flat = device_copy()
        for f in flat:
            h = host(f)
            int(h.view(np.uint8)[::4096].sum())

    def new_path_copy() -> None:
        flat = device_copy()
        for f in flat:
            np.array(host(f), copy=True)

    print(f"old path (asarray of each [:offset] view, gathered): {best_of(3, old_path) * 1e3:.1f} ms")
    print(f"device contiguous copy + eval: {best_of(3, device_copy) * 1e3:.1f} ms")
    print(f"device copy + asarray + touch every page: {best_of(3, new_path) * 1e3:.1f} ms")
    print(f"device copy + asarray + full host copy: {best_of(3, new_path_copy) * 1e3:.1f} ms")

    def small(n: int) -> None:
        parts = []
        for c in caches:
            parts += [
                c.keys[..., offset - n : offset, :].reshape(-1),
                c.values[..., offset - n : offset, :].reshape(-1),
            ]
        flat = mx.concatenate(parts)
        mx.eval(flat)
        np.array(host(flat), copy=True)

    for n in (16, 64):
        print(
            f"series slice of {n} new tokens, one flat buffer, to host: "
            f"{best_of(20, lambda n=n: small(n)) * 1e3:.2f} ms"
        )

    # np.asarray of an async-evaluated array from another thread.
    parts = [c.keys[..., offset - 16 : offset, :].reshape(-1) for c in caches]
    flat = mx.concatenate(parts)
    mx.async_eval(flat)
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(np.array(host(flat), copy=True)))
    thread.start()
    thread.join()
    expect = np.concatenate([host(p) for p in parts])
    print(f"asarray on another thread after async_eval: equal {np.array_equal(out[0], expect)}")

    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        flat = device_copy()
        hosts = [np.array(host(f), copy=True) for f in flat]

        def bare(sync: bool) -> None:
            path = os.path.join(tmp, "bare")
            with open(path, "wb") as f:
                for h in hosts:
                    f.write(h.view(np.uint8).data)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            os.unlink(path)

        def direct(sync: bool) -> None:
            path = os.path.join(tmp, "direct")
            flat = device_copy()
            with open(path, "wb") as f:
                for fl in flat:
                    f.write(host(fl).view(np.uint8).data)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            os.unlink(path)

        def mlx_save() -> None:
            path = os.path.join(tmp, "c.safetensors")
            save_prompt_cache(path, caches)
            os.unlink(path)

        for sync in (False, True):
            print(
                f"bare write of host bytes, fsync={sync}: {best_of(3, lambda s=sync: bare(s)) * 1e3:.0f} ms"
            )
            print(
                f"device copy + write straight from asarray, fsync={sync}: "
                f"{best_of(3, lambda s=sync: direct(s)) * 1e3:.0f} ms"
            )
        print(f"save_prompt_cache (no fsync): {best_of(3, mlx_save) * 1e3:.0f} ms")
    start = time.perf_counter()
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
