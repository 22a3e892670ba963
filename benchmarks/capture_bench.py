"""Capture benchmark, all in one run on SmolLM2-135M (fixture model):

1. snapshot save time vs a bare ``f.write(memoryview)`` of the same K/V bytes, and vs mlx-lm's
   ``save_prompt_cache`` on the same cache (time and size on disk);
2. the overhead that snapshots every 16 tokens (one series file) add to a 256-token generation;
3. with ``--shapes`` / ``--accelerator-shapes``: the same overhead on random-weight models in real
   shapes (SmolLM2-135M, Qwen3-8B, and Qwen3-8B's KV shape on a tiny hidden size), on whatever
   device mlx runs (CUDA on the accelerator machine), and a one-shot save of an 8192-token
   Qwen3-8B-shaped cache against ``save_prompt_cache`` and a bare write, with and without fsync.

    python -m benchmarks.capture_bench [--tokens 256] [--every 16] [--context 2048]
    python -m benchmarks.capture_bench --accelerator-shapes [--tokenizer DIR]
    python -m benchmarks.capture_bench --shapes qwen3-8b-kv-tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

from benchmarks.timing import best_of
from kvformat.checksum import crc32c
from kvsnap.capture import generate, snapshot_kv
from kvsnap.capture.caches import to_numpy
from kvsnap.capture.fixtures import fetch_model


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


SHAPES: dict[str, dict[str, Any]] = {
    # Random weights in real shapes, built with mlx-lm's own classes (timing does not depend on
    # the weights). (config, dtype, prompt tokens, generated tokens)
    "smollm2-135m": {
        "config": {
            "model_type": "llama",
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "rms_norm_eps": 1e-5,
            "vocab_size": 49152,
            "rope_theta": 100000.0,
            "tie_word_embeddings": True,
        },
        "dtype": "float16",
        "prompt": 128,
        "tokens": 512,
    },
    "qwen3-8b": {
        "config": {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "num_hidden_layers": 36,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rms_norm_eps": 1e-6,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 40960,
        },
        "dtype": "bfloat16",
        "prompt": 1024,
        "tokens": 256,
    },
    # The Qwen3-8B KV shape (36 layers x 8 KV heads x 128, bf16) with a tiny hidden size, so a
    # 2-core CPU decodes fast enough for the snapshot cost to show.
    "qwen3-8b-kv-tiny": {
        "config": {
            "model_type": "qwen3",
            "hidden_size": 128,
            "num_hidden_layers": 36,
            "intermediate_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rms_norm_eps": 1e-6,
            "vocab_size": 49152,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "max_position_embeddings": 40960,
        },
        "dtype": "bfloat16",
        "prompt": 1024,
        "tokens": 256,
    },
}


def random_model(name: str) -> Any:
    import importlib

    shape = SHAPES[name]
    module = importlib.import_module(f"mlx_lm.models.{shape['config']['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(shape["config"]))
    model.set_dtype(getattr(mx, shape["dtype"]))
    mx.eval(model.parameters())
    return model


class GilProbe:
    """A thread that asks for the GIL every millisecond (``time.sleep(0.001)``) and records how
    late each wake-up is: a wake-up waits for the GIL as long as another thread holds it, so the
    lateness, summed and at its largest, is how long other threads kept the interpreter from the
    generating thread too. ``KVSNAP_BENCH_GIL=1`` prints it for plain and captured runs."""

    def __init__(self) -> None:
        import threading

        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - start - 0.001)

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def line(self) -> str:
        late = np.array(self.late) * 1e3
        return (
            f"GIL waits: {late.size} wake-ups, total {late.sum():.1f} ms, "
            f"p99 {np.percentile(late, 99):.2f} ms, max {late.max():.2f} ms, > 2 ms: {int((late > 2).sum())}"
        )


@dataclass
class Phases:
    """One run's wall clock, split where a capture can add to it (seconds): ``prefill`` until the
    first token arrives, ``decode`` from the first token to the last, ``tail`` from the last
    token until the generator returns (a capture's final snapshot, its index and fsync)."""

    prefill: float
    decode: float
    tail: float

    @property
    def total(self) -> float:
        return self.prefill + self.decode + self.tail


def timed_run(responses: Any) -> Phases:
    """Drain a token generator, timing its phases (`Phases`)."""
    start = time.perf_counter()
    first = last = None
    for _ in responses:
        last = time.perf_counter()
        first = first or last
    first = first or start
    last = last or start
    end = time.perf_counter()
    return Phases(first - start, last - first, end - last)


@dataclass
class Overhead:
    """Paired runs of plain generation and of a capture (alternated ABBA, so drift cancels)."""

    plain: list[Phases]
    captured: list[Phases]

    def ratios(self) -> np.ndarray:
        return np.array([c.total / p.total for p, c in zip(self.plain, self.captured, strict=True)])

    def line(self) -> str:
        """The paired overhead (median and quartiles) and where it lands, in ms per run."""
        r = 100 * (self.ratios() - 1)
        q1, med, q3 = np.percentile(r, [25, 50, 75])
        parts = []
        for phase in ("prefill", "decode", "tail"):
            diff = [
                getattr(c, phase) - getattr(p, phase) for p, c in zip(self.plain, self.captured, strict=True)
            ]
            parts.append(f"{phase} {1e3 * float(np.median(diff)):+.1f} ms")
        return (
            f"paired overhead median {med:+.2f}% (quartiles {q1:+.2f}% .. {q3:+.2f}%, "
            f"{r.size} pairs); median differences: " + ", ".join(parts)
        )


def generation_overhead(
    model: Any,
    tokenizer: Any,
    prompt_len: int,
    tokens: int,
    every: int | None,
    runs: int,
    tmp: Path,
    variant: str = "",
) -> Overhead:
    """Plain `stream_generate` against `capture.generate` writing a series snapshot every
    ``every`` tokens (None: the final one only), ``runs`` pairs in ABBA order; the overhead
    reported is the median of each pair's ratio (a pair ran back to back, under the same load)."""
    vocab = len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else 49152
    banned = mx.array(sorted(tokenizer.eos_token_ids))

    def restrict(history: mx.array, logits: mx.array) -> mx.array:
        """No end of sequence (every run generates ``tokens``), no ids the tokenizer lacks."""
        logits[:, banned] = -float("inf")
        if logits.shape[-1] > vocab:
            logits[:, vocab:] = -float("inf")
        return logits

    prompt = [int(t) for t in np.random.default_rng(3).integers(100, min(vocab, 40000), prompt_len)]
    sizes: dict[str, int] = {}

    def plain() -> Phases:
        return timed_run(
            stream_generate(
                model, tokenizer, mx.array(prompt), max_tokens=tokens, logits_processors=[restrict]
            )
        )

    def disk_load() -> Phases:
        """Plain generation beside a thread writing and syncing as much as a capture does."""
        import threading

        def write() -> None:
            block = np.ones(1 << 20, np.uint8)
            with open(tmp / "load.bin", "wb") as f:
                for i in range(200):
                    f.write(block.data)
                    if i % 10 == 9:
                        os.fsync(f.fileno())

        thread = threading.Thread(target=write)
        thread.start()
        phases = plain()
        thread.join()
        return phases

    def captured() -> Phases:
        import kvsnap.capture.series

        if variant == "disk-load":
            return disk_load()
        if variant.startswith("switch-"):  # the interpreter's switch interval for this run only
            interval = sys.getswitchinterval()
            sys.setswitchinterval(float(variant[7:]))
            try:
                return capture_run(durable=True, queries="none")
            finally:
                sys.setswitchinterval(interval)
        if variant.startswith("sync-"):
            kvsnap.capture.series.SYNC_EACH = variant[5:]
        if variant == "copy-stream":  # the snapshot's device copies queued on a stream of their own
            return copy_stream_run()
        if variant == "hold-buffers":  # the snapshot's device buffers kept until the run ends
            return hold_buffers_run()
        if variant == "process-writer":  # the series written by a child process, not the thread
            return capture_run(durable=True, queries="none", in_process=True)
        if variant.startswith("process-queries-"):  # the same, with queries
            return capture_run(
                durable=True, queries=variant.removeprefix("process-queries-"), in_process=True
            )
        return capture_run(
            durable=variant != "no-fsync",
            queries=variant.removeprefix("queries-") if variant.startswith("queries-") else "none",
        )

    def copy_stream_run() -> Phases:
        from kvsnap.capture import background

        original = background.Transfer.__init__
        stream = mx.new_stream(mx.default_device())

        def on_stream(self: Any, arrays: Any) -> None:
            with mx.stream(stream):
                original(self, arrays)

        background.Transfer.__init__ = on_stream  # type: ignore[method-assign]
        try:
            return capture_run(durable=True, queries="none")
        finally:
            background.Transfer.__init__ = original  # type: ignore[method-assign]

    def hold_buffers_run() -> Phases:
        """A capture whose snapshot buffers are not handed back to mlx's buffer cache once copied
        to the host: on CUDA (managed memory) a buffer the writer read has its pages on the host,
        and a kernel that later reuses it would fault them back to the GPU."""
        from kvsnap.capture import background

        original = background.Transfer.to_host
        held: list[Any] = []

        def holding(self: Any) -> Any:
            held.extend(self._flats)
            return original(self)

        background.Transfer.to_host = holding  # type: ignore[method-assign]
        try:
            return capture_run(durable=True, queries="none")
        finally:
            background.Transfer.to_host = original  # type: ignore[method-assign]
            held.clear()

    def capture_run(durable: bool, queries: str, in_process: bool = False) -> Phases:
        out = tmp / "overhead.kv"
        out.unlink(missing_ok=True)
        phases = timed_run(
            generate(
                model,
                tokenizer,
                prompt,
                max_tokens=tokens,
                output=out,
                every=every,
                logits_processors=[restrict],
                durable=durable,
                queries=queries,
                write_in_process=in_process,
            )
        )
        sizes[variant] = out.stat().st_size
        return phases

    for _ in range(2):  # warm up both (the first runs of a process are slow and erratic on CUDA)
        plain()
        captured()
    if os.environ.get("KVSNAP_BENCH_GIL"):
        for label, run in (("plain", plain), ("captured", captured)):
            with GilProbe() as probe:
                run()
            print(f"    {variant or 'default'} every={every} {label}: {probe.line()}", flush=True)
    result = Overhead([], [])
    for i in range(runs):
        if i % 2:  # ABBA: captured first in odd pairs
            result.captured.append(captured())
            result.plain.append(plain())
        else:
            result.plain.append(plain())
            result.captured.append(captured())
    if os.environ.get("KVSNAP_BENCH_PROFILE"):
        snapshots = tokens // every if every else 1
        plain_s = float(np.median([p.total for p in result.plain]))
        print(f"    one captured run: {profile_snapshots(captured)}", flush=True)
        for _ in range(2):
            line = profile_snapshots(captured, snapshots, plain_s / tokens * (every or tokens))
            print(f"    per snapshot: {line}", flush=True)
    print(
        f"    {variant or 'default'} every={every}: pair overheads "
        + " ".join(f"{100 * (r - 1):+.1f}%" for r in result.ratios()),
        flush=True,
    )
    print(f"    {variant or 'default'} every={every}: {result.line()}", flush=True)
    if variant in sizes:
        held = prompt_len + tokens
        size = sizes[variant]
        print(f"    {variant or 'default'}: file {size / 1e6:.1f} MB, {size / held:.0f} B/token")
    return result


def profile_snapshots(run: Any, snapshots: int = 0, decode_between: float = 0.0) -> str:
    """Where one captured run's snapshot time goes: in the generating thread (taking snapshots,
    and within that reading the cache's deltas, taking the queries and starting the transfer;
    the query hook at every attention call; waiting for a full queue; closing) and on the writer
    thread (jobs). Returns one line; the generating thread's total is ``take + query hook +
    queue wait + close`` (``take`` includes its parts and the queue wait). With ``snapshots``
    and ``decode_between`` (plain decode seconds between two snapshots): the generating thread's
    time per snapshot while generating (``take + query hook``, not the close) and its share of
    ``decode_between``."""

    import kvsnap.capture.background as background
    import kvsnap.capture.deltas as deltas
    import kvsnap.capture.queries as queries

    generate_module = sys.modules["kvsnap.capture.generation"]  # the package exports a function of that name

    spent: dict[str, float] = dict.fromkeys(
        ("take", "deltas", "queries", "transfer", "query hook", "queue wait", "close", "writer jobs"), 0.0
    )
    patched = [
        (generate_module._Snapshots, "take", "take"),
        (generate_module._Snapshots, "close", "close"),
        (deltas.CacheTracker, "read", "deltas"),
        (queries.QueryRecorder, "take", "queries"),
        (queries.QueryRecorder, "_keep", "query hook"),
        (background.Transfer, "__init__", "transfer"),
    ]
    originals = [getattr(owner, attribute) for owner, attribute, _ in patched]
    submit_original = background.BackgroundWriter.submit

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    def submit(self: Any, job: Any) -> None:
        submit_original(self, timed("writer jobs", job))

    for (owner, attribute, name), original in zip(patched, originals, strict=True):
        setattr(owner, attribute, timed(name, original))
    background.BackgroundWriter.submit = timed("queue wait", submit)  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        run()
    finally:
        for (owner, attribute, _), original in zip(patched, originals, strict=True):
            setattr(owner, attribute, original)
        background.BackgroundWriter.submit = submit_original  # type: ignore[method-assign]
    total = time.perf_counter() - start
    if snapshots:
        each = (spent["take"] + spent["query hook"]) / snapshots
        writer = spent["writer jobs"] / snapshots
        return (
            f"generating thread {each * 1e3:.2f} ms = {100 * each / decode_between:.2f}% of the "
            f"{decode_between * 1e3:.1f} ms decode between snapshots (take "
            f"{spent['take'] / snapshots * 1e3:.2f}, "
            f"query hook {spent['query hook'] / snapshots * 1e3:.2f}); "
            f"writer thread {writer * 1e3:.2f} ms; close {spent['close'] * 1e3:.1f} ms once"
        )
    thread = spent["take"] + spent["query hook"] + spent["close"]
    return (
        f"run {total:.3f} s; generating thread {thread * 1e3:.0f} ms ({100 * thread / total:.1f}%): "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in spent.items())
    )


def one_shot_rows(context: int, lines: list[str], tmp: Path) -> None:
    """Snapshot + save of a ``context``-token Qwen3-8B-shaped cache against mlx-lm's
    ``save_prompt_cache`` and a bare write of the same bytes, with and without fsync."""
    from mlx_lm.models.cache import KVCache

    caches = []
    for i in range(36):
        cache = KVCache()
        k = mx.random.normal((1, context, 8, 128), key=mx.random.key(i)).astype(mx.bfloat16)
        cache.update_and_fetch(k.transpose(0, 2, 1, 3), (k * 2).transpose(0, 2, 1, 3))
        caches.append(cache)
    mx.eval([c.state for c in caches])

    def on_device() -> None:
        """Touch every cache buffer on the device, as a decode step would: on CUDA, mlx's managed
        pages a previous run moved to the host go back, so every run pays the same transfer."""
        mx.eval([mx.sum(c.keys) + mx.sum(c.values) for c in caches])

    host = [
        np.array(x)
        for c in caches
        for x in (to_numpy(c.keys[..., :context, :]), to_numpy(c.values[..., :context, :]))
    ]
    nbytes = sum(h.nbytes for h in host)
    kv_path, mlx_path, bare_path = tmp / "one.kv", tmp / "one.safetensors", tmp / "bare.bin"

    def timed(fn: Any) -> float:
        times = []
        for _ in range(3):
            on_device()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def save_kv(durable: bool) -> None:
        kv_path.unlink(missing_ok=True)
        snapshot_kv(caches).save(kv_path, durable=durable)

    def save_mlx(durable: bool) -> None:
        mlx_path.unlink(missing_ok=True)
        save_prompt_cache(str(mlx_path), caches)
        if durable:
            fd = os.open(mlx_path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    what = f"{context}-token Qwen3-8B-shaped cache ({nbytes / 1e9:.2f} GB K/V)"
    for durable in (False, True):
        label = "with fsync" if durable else "no fsync"
        kv_s = timed(lambda d=durable: save_kv(d))
        mlx_s = timed(lambda d=durable: save_mlx(d))
        lines.append(
            f"| snapshot + save, {what}, {label} | {kv_s * 1e3:.0f} ms "
            f"| save_prompt_cache{' + fsync' if durable else ''} {mlx_s * 1e3:.0f} ms | {mlx_s / kv_s:.2f}x |"
        )
    bare_s = timed(
        lambda: bare_write(bare_path, [memoryview(h.view(np.uint8).reshape(-1)) for h in host], True)
    )
    kv_s = timed(lambda: save_kv(True))
    lines.append(
        f"| snapshot + save, {what}, with fsync | {kv_s * 1e3:.0f} ms "
        f"| bare write + fsync of pre-gathered bytes {bare_s * 1e3:.0f} ms | {bare_s / kv_s:.2f}x |"
    )


def shapes_main(
    names: list[str],
    runs: int,
    every: int,
    context: int,
    tokenizer_path: str,
    queries: list[str] | None = None,
    prompt: int | None = None,
    new_tokens: int | None = None,
) -> None:

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    if os.environ.get("KVSNAP_BENCH_SWITCH"):  # the interpreter's thread switch interval, seconds
        sys.setswitchinterval(float(os.environ["KVSNAP_BENCH_SWITCH"]))
    print(
        f"mlx {mx.__version__} on {mx.default_device()}; switch interval {sys.getswitchinterval()} s",
        flush=True,
    )
    tokenizer = load_tokenizer(Path(tokenizer_path))
    lines = ["| measurement | kvsnap | peer / machine limit | ratio |", "|---|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for shape in names:
            spec = SHAPES[shape]
            prompt_len, tokens = prompt or spec["prompt"], new_tokens or spec["tokens"]
            model = random_model(shape)
            variants = [(every, ""), (None, "")]
            variants += [(every, f"queries-{selection}") for selection in queries or []]
            if os.environ.get("KVSNAP_BENCH_VARIANTS"):  # e.g. "default,no-fsync,switch-0.0005"
                variants = [
                    (every, "" if name == "default" else name)
                    for name in os.environ["KVSNAP_BENCH_VARIANTS"].split(",")
                ]
            for cadence, variant in variants:
                overhead = generation_overhead(
                    model, tokenizer, prompt_len, tokens, cadence, runs, tmp, variant
                )
                plain_s = float(np.median([p.total for p in overhead.plain]))
                label = f"every {cadence}" if cadence else "final snapshot only"
                if variant == "no-fsync":
                    label += " (durable=False)"
                elif variant.startswith("sync-"):
                    label += f" (each snapshot: {variant[5:]})"
                elif variant.startswith("queries-"):
                    label += f", --queries {variant.removeprefix('queries-')}"
                elif variant.startswith("switch-"):
                    label += f" (switch interval {variant[7:]} s)"
                elif variant == "hold-buffers":
                    label += " (snapshot buffers held to the end)"
                elif variant == "process-writer":
                    label += " (written by a child process, write_in_process=True)"
                elif variant.startswith("process-queries-"):
                    label += (
                        f", --queries {variant.removeprefix('process-queries-')}"
                        " (written by a child process, write_in_process=True)"
                    )
                elif variant == "disk-load":
                    label = "plain, beside a thread writing 200 MB with fsyncs (no capture)"
                ratios = 100 * (overhead.ratios() - 1)
                q1, med, q3 = np.percentile(ratios, [25, 50, 75])
                lines.append(
                    f"| {shape} {spec['dtype']}, {prompt_len} + {tokens} tokens, series {label} "
                    f"| {plain_s * (1 + med / 100):.3f} s | plain stream_generate {plain_s:.3f} s "
                    f"({tokens / plain_s:.0f} tok/s) "
                    f"| paired median {med:+.2f}% (quartiles {q1:+.2f}% .. {q3:+.2f}%, {ratios.size} pairs) |"
                )
                print(lines[-1], flush=True)
            del model
        if context:
            one_shot_rows(context, lines, tmp)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--tokens", type=int, help="new tokens (default: 256; with --shapes, the shape's own)"
    )
    parser.add_argument("--prompt", type=int, help="with --shapes: prompt tokens (default: the shape's)")
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens for the save test")
    parser.add_argument(
        "--shapes",
        nargs="*",
        choices=sorted(SHAPES),
        help="random-weight models in real shapes: generation overhead of series snapshots "
        "(plain and captured runs alternate, median of --runs), then a one-shot save of a "
        "--save-context-token Qwen3-8B-shaped cache",
    )
    parser.add_argument(
        "--accelerator-shapes",
        action="store_true",
        help="the accelerator targets: --shapes smollm2-135m qwen3-8b --save-context 8192",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--save-context", type=int, default=0)
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the SmolLM2 fixture's)")
    parser.add_argument(
        "--queries",
        nargs="*",
        metavar="SELECTION",
        help="with --shapes: also series runs capturing queries (e.g. window:64 all)",
    )
    args = parser.parse_args()
    if args.accelerator_shapes or args.shapes:
        names = args.shapes or ["smollm2-135m", "qwen3-8b"]
        context = args.save_context or (8192 if args.accelerator_shapes else 0)
        tokenizer = args.tokenizer or str(fetch_model("smollm2-135m"))
        shapes_main(names, args.runs, args.every, context, tokenizer, args.queries, args.prompt, args.tokens)
        return
    args.tokens = args.tokens or 256
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
    print("\n".join(lines))


if __name__ == "__main__":
    main()
