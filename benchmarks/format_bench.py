"""Format benchmark: write, open, one-head read, verify and codecs, against the machine's own
limits measured in the same run (bare `f.write(memoryview)`, plain sequential read).

    python -m benchmarks.format_bench [--gib 2] [--dir /tmp] [--real FILE.kv]

``--real`` measures codec ratios and speeds on the K/V of a real captured snapshot as well.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import kvformat
from benchmarks.timing import best_of
from kvformat import codecs


def synthetic_layers(num_layers: int, heads: int, tokens: int, dim: int) -> list[np.ndarray]:
    """K-like data: per-channel scales with a few outlier channels, float16."""
    rng = np.random.default_rng(0)
    scale = np.exp(rng.normal(0, 0.7, dim)).astype(np.float32)
    out = []
    for _ in range(num_layers):
        x = rng.standard_normal((2, heads, tokens, dim), dtype=np.float32) * scale
        out.append(x.astype(np.float16))
    return out


def bare_write(path: Path, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        for array in arrays:
            for t in range(2):
                for h in range(array.shape[1]):
                    f.write(memoryview(np.ascontiguousarray(array[t, h]).view(np.uint8).reshape(-1)))
        f.flush()
        os.fsync(f.fileno())


def kv_write(path: Path, arrays: list[np.ndarray], codec: str) -> None:
    heads, _tokens, dim = arrays[0].shape[1:]
    spec = kvformat.LayerSpec(heads, dim, dim, kvformat.FLOAT16)
    with kvformat.Writer(path, [spec] * len(arrays), codec=codec, chunk_bytes=64 << 20) as w:
        for layer, array in enumerate(arrays):
            w.append(layer, array[0], array[1])


def plain_read(path: Path) -> None:
    buffer = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


def codec_table(samples: list[tuple[np.ndarray, int]], label: str) -> list[str]:
    rows = [
        f"\n### Codecs on {label}\n",
        "| codec | ratio | encode MB/s | decode MB/s |",
        "|---|---:|---:|---:|",
    ]
    total = sum(a.nbytes for a, _ in samples)
    for name in ("raw", "zstd:1", "zstd:3", "byteplane-zstd:1", "byteplane-zstd:3"):
        codec = codecs.parse(name)
        encoded = []
        start = time.perf_counter()
        for array, itemsize in samples:
            encoded.append(codec.encode(memoryview(array.reshape(-1).view(np.uint8)), itemsize))
        encode_s = time.perf_counter() - start
        stored = [b"".join(bytes(p) for p in pieces) for pieces in encoded]
        start = time.perf_counter()
        for data, (array, itemsize) in zip(stored, samples, strict=True):
            codec.decode(memoryview(data), array.nbytes, itemsize)
        decode_s = time.perf_counter() - start
        size = sum(len(s) for s in stored)
        rows.append(
            f"| {name} | {total / size:.3f} | {total / encode_s / 1e6:,.0f} | {total / decode_s / 1e6:,.0f} |"
        )
    return rows


def real_samples(path: str) -> list[tuple[np.ndarray, int]]:
    samples = []
    with kvformat.open(path) as snap:
        for head in snap.heads():
            for array in (head.k, head.v):
                samples.append((np.ascontiguousarray(array), array.dtype.itemsize))
    return samples


def series_rows(snapshots: int, every: int, dim: int, tmp: Path) -> list[str]:
    """A series of ``snapshots`` snapshots of a Qwen3-8B layout (36 layers x 8 KV heads), each
    adding ``every`` tokens (head_dim ``dim``): the writer's cost per snapshot, then open,
    select + head, verify and recover against a sequential read of the file."""
    layers, heads = 36, 8
    path = tmp / f"series-{snapshots}.kv"
    specs = [kvformat.LayerSpec(heads, dim, dim, kvformat.FLOAT16)] * layers
    block = np.random.default_rng(0).standard_normal((layers, heads, every, dim)).astype(np.float16)
    # The machine's own limit for the writer row: after each snapshot, one plain write() of as
    # many bytes as the snapshot added, to a second fresh file. Interleaved, so both see the same
    # page cache (this machine's first writes into fresh memory cost up to 15x the later ones).
    per_snapshot, per_write = [], []
    noise = np.random.default_rng(1).integers(0, 255, 8 << 20, dtype=np.uint8)
    # This VM hands freed memory back to its host after a few seconds, and the first write into
    # such pages costs up to 15x a later one: one scratch file of twice the series' size, written
    # and deleted first, leaves warm free pages for both the writer and the bare writes.
    with open(tmp / "warm.bin", "wb", buffering=0) as warm:
        for _ in range(2 * snapshots * layers * heads * 2 * (64 + every * dim * 2) // noise.nbytes + 1):
            warm.write(noise.data)
    (tmp / "warm.bin").unlink()
    with kvformat.Writer(path, specs, durable=False) as w, open(tmp / "bare.bin", "wb", buffering=0) as bare:
        for step in range(snapshots):
            before = os.fstat(w.fileno()).st_size
            start = time.perf_counter()
            w.append_many([(layer, block[layer], block[layer], None, 0) for layer in range(layers)])
            w.snapshot({"generated": step * every})
            per_snapshot.append(time.perf_counter() - start)
            added = noise[: os.fstat(w.fileno()).st_size - before]
            start = time.perf_counter()
            bare.write(added.data)
            per_write.append(time.perf_counter() - start)
    (tmp / "bare.bin").unlink()
    size = path.stat().st_size
    read_s = best_of(3, lambda: plain_read(path))

    def open_close() -> None:
        kvformat.open(path).close()

    def select_head() -> None:
        with kvformat.open(path) as snap:
            head = snap.select(min(100, snapshots - 1)).head(20, 3)
            assert head is not None

    opened = kvformat.open(path)

    def select_head_only() -> None:
        head = opened.select(min(100, snapshots - 1)).head(20, 3)
        assert head is not None

    def verify() -> None:
        with kvformat.open(path) as snap:
            snap.verify()

    def verify_only() -> float:
        with kvformat.open(path) as snap:
            start = time.perf_counter()
            snap.verify()
            return time.perf_counter() - start

    partial = tmp / "copy.kv.partial"

    def recover() -> float:
        with open(path, "rb") as src, open(partial, "wb") as dst:
            dst.write(src.read()[: size - 64])  # no footer: an unfinished write (not timed)
        start = time.perf_counter()
        kvformat.recover(partial, tmp / "recovered.kv", overwrite=True)
        return time.perf_counter() - start

    def paired(operation: Callable[[], float | None], rounds: int = 9) -> tuple[float, float]:
        """The fastest of ``rounds`` runs of ``operation`` and of as many sequential reads of the
        file, alternated (this machine's speed drifts within a minute: the ratio compares runs
        made under the same conditions). ``operation`` may return its own time."""
        took, reads = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            own = operation()
            took.append(own if own is not None else time.perf_counter() - start)
            start = time.perf_counter()
            plain_read(path)
            reads.append(time.perf_counter() - start)
        return min(took), min(reads)

    chunks = layers * heads * 2 * snapshots
    what = f"{snapshots} snapshots x {layers * heads * 2} chunks ({chunks} chunks, {size / 1e6:.0f} MB)"
    bare_ms = float(np.median(per_write)) * 1e3
    writer_ms = float(np.median(per_snapshot)) * 1e3
    rows = [
        f"| writer, one snapshot of {layers * heads * 2} new chunks, {what} (median; 90th "
        f"percentile {np.percentile(per_snapshot, 90) * 1e3:.2f} ms) "
        f"| {writer_ms:.2f} ms | one write() of the same bytes {bare_ms:.2f} ms "
        f"| {bare_ms / writer_ms:.2f}x |",
        f"| sequential read of the file (best of 3) | {read_s * 1e3:.0f} ms | | |",
    ]
    timings = [
        ("kvformat.open", paired(open_close)),
        ("select(100).head(20, 3) on an open file", paired(select_head_only)),
        ("select(100).head(20, 3), open included", paired(select_head)),
        ("verify, open included", paired(verify, 5)),
        ("verify on an open file (a fresh one each time)", paired(verify_only)),
        ("recover of the file without its footer (durable: two fsyncs)", paired(recover, 2)),
    ]
    opened.close()
    for name, (took, read) in timings:
        limit = f"sequential read {read * 1e3:.0f} ms"
        rows.append(f"| {name} | {took * 1e3:.1f} ms | {limit} | {read / took:.2f}x |")
    return rows


def append_rows(snapshots: int, tmp: Path) -> list[str]:
    """The README's writing path against the bulk call, alternated in one run: per snapshot, 36
    layers (Qwen3-8B: 8 KV heads, head_dim 128, bfloat16) of 16 new tokens each, written as
    ``w.append(layer, k, v)`` per layer then ``w.snapshot()``, or as one ``w.append_many`` then
    ``w.snapshot()``. Default writer settings; the time in the calls (the writer thread's).

    The machine's own limit, in the same run: after each snapshot, one plain ``write()`` of as
    many bytes as that snapshot added, to a third file. This VM's first writes into memory it
    has not touched for a while cost up to 15x the later ones, so a scratch file of the run's
    size is written and deleted first (warm free pages for all three), and the writer's own
    work is each call's time less the bare write's."""
    layers, heads, every, dim = 36, 8, 16, 128
    specs = [kvformat.LayerSpec(heads, dim, dim, kvformat.BFLOAT16)] * layers
    rng = np.random.default_rng(0)
    block = rng.standard_normal((layers, heads, every, dim)).astype(kvformat.BFLOAT16.numpy)
    noise = np.random.default_rng(1).integers(0, 255, 8 << 20, dtype=np.uint8)
    per_snapshot = 2 * block.nbytes + (64 << 10)  # K and V, plus room for records
    with open(tmp / "warm.bin", "wb", buffering=0) as warm:
        for _ in range(3 * snapshots * per_snapshot // noise.nbytes + 1):
            warm.write(noise.data)
    (tmp / "warm.bin").unlink()
    times: dict[str, list[float]] = {"append per layer": [], "append_many": [], "bare write": []}
    with (
        kvformat.Writer(tmp / "per-layer.kv", specs) as one,
        kvformat.Writer(tmp / "many.kv", specs) as many,
        open(tmp / "bare.bin", "wb", buffering=0) as bare,
    ):
        for step in range(snapshots):
            before = os.fstat(one.fileno()).st_size
            start = time.perf_counter()
            for layer in range(layers):
                one.append(layer, block[layer], block[layer])
            one.snapshot({"generated": step * every})
            times["append per layer"].append(time.perf_counter() - start)
            added = noise[: os.fstat(one.fileno()).st_size - before]
            start = time.perf_counter()
            many.append_many([(layer, block[layer], block[layer], None, 0) for layer in range(layers)])
            many.snapshot({"generated": step * every})
            times["append_many"].append(time.perf_counter() - start)
            start = time.perf_counter()
            bare.write(added.data)
            times["bare write"].append(time.perf_counter() - start)
    medians = {}
    rows = []
    for name, values in times.items():
        ms = np.array(values[1:]) * 1e3  # the first snapshot opens pages of a fresh file
        low, medians[name], high = np.percentile(ms, [10, 50, 90])
        rows.append(f"| {name} | {medians[name]:.2f} ms | {low:.2f}-{high:.2f} ms | |")
    own = {
        name: np.array(times[name][1:]) - np.array(times["bare write"][1:])
        for name in ("append per layer", "append_many")
    }
    for name, values in own.items():
        low, median, high = np.percentile(values * 1e3, [10, 50, 90])
        rows.append(f"| {name}, less the bare write | {median:.2f} ms | {low:.2f}-{high:.2f} ms | |")
    ratio = medians["append per layer"] / medians["append_many"]
    rows.append(f"| per layer / append_many | | | {ratio:.2f}x |")
    rows.append(
        f"| per layer / bare write | | | {medians['append per layer'] / medians['bare write']:.2f}x |"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0, help="size of the big file")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--real", action="append", default=[], help="a captured .kv for codec ratios")
    parser.add_argument(
        "--series",
        action="store_true",
        help="only the series case: 512 and 64 snapshots of 16 tokens, Qwen3-8B layout, head_dim 16",
    )
    parser.add_argument("--snapshots", type=int, nargs="*", default=[64, 512])
    parser.add_argument(
        "--append",
        action="store_true",
        help="only Writer.append per layer vs append_many: 36 layers x 16 tokens per snapshot, 200 snapshots",
    )
    args = parser.parse_args()
    if args.append:
        lines = ["| 36 layers x 16 tokens per snapshot | median | p10-p90 | ratio |", "|---|---:|---:|---:|"]
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            lines += append_rows(200, Path(tmp))
        print("\n".join(lines))
        return
    if args.series:
        lines = ["| measurement | kvformat | machine limit | ratio |", "|---|---:|---:|---:|"]
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            for count in args.snapshots:
                lines += series_rows(count, 16, 16, Path(tmp))
                print("\n".join(lines), flush=True)
        return
    heads, dim, layers = 8, 128, 32
    tokens = int(args.gib * (1 << 30) / (layers * 2 * heads * dim * 2))
    arrays = synthetic_layers(layers, heads, tokens, dim)
    nbytes = sum(a.nbytes for a in arrays)
    gb = nbytes / 1e9
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, numpy {np.__version__}",
        f"data: {layers} layers x {heads} KV heads x {tokens} tokens x head_dim {dim}, float16, "
        f"K+V = {nbytes / (1 << 30):.2f} GiB",
        "",
        "| measurement | kvformat | peer / machine limit | ratio |",
        "|---|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        bare, kv = Path(tmp) / "bare.bin", Path(tmp) / "big.kv"
        bare_s = best_of(3, lambda: bare_write(bare, arrays))
        kv_s = best_of(3, lambda: kv_write(kv, arrays, "raw"))
        lines.append(
            f"| write raw + fsync | {gb / kv_s:.2f} GB/s | bare f.write {gb / bare_s:.2f} GB/s "
            f"| {bare_s / kv_s:.2f}x |"
        )
        bare.unlink()
        size = kv.stat().st_size
        plain_read(kv)
        open_s = best_of(5, lambda: kvformat.open(kv).close())
        lines.append(f"| open {size / 1e9:.2f} GB file | {open_s * 1e3:.2f} ms | | |")

        head_bytes = tokens * dim * 2 * 2
        with kvformat.open(kv) as snap:
            segments = [s for s in snap.segments() if (s.layer, s.head) == (layers // 2, heads // 2)]
            table = snap._file.table
            ranges = [
                (int(table["offset"][c]) + 64, int(table["stored_size"][c]))
                for s in segments
                for c in (s.k_chunk, s.v_chunk)
            ]

        def pread_same_bytes() -> None:
            fd = os.open(kv, os.O_RDONLY)
            try:
                for offset, length in ranges:
                    os.pread(fd, length, offset)
            finally:
                os.close(fd)

        pread_s = best_of(7, pread_same_bytes)
        for check in (True, False):
            with kvformat.open(kv, check_checksums=check) as snap:

                def read_head(snap: kvformat.Snapshot = snap) -> None:
                    head = snap.head(layers // 2, heads // 2)
                    assert head is not None
                    np.array(head.k), np.array(head.v)  # materialize: touch every byte

                t = best_of(7, read_head)
            lines.append(
                f"| one head into RAM ({head_bytes / 1e6:.1f} MB K+V), CRC {'on' if check else 'off'} "
                f"| {t * 1e3:.2f} ms | os.pread of its bytes {pread_s * 1e3:.2f} ms | {pread_s / t:.2f}x |"
            )
        read_s = best_of(3, lambda: plain_read(kv))

        def verify() -> None:
            with kvformat.open(kv) as snap:
                snap.verify()

        verify_s = best_of(3, verify)
        lines.append(
            f"| verify (page cache) | {size / verify_s / 1e9:.2f} GB/s | sequential read "
            f"{size / read_s / 1e9:.2f} GB/s | {read_s / verify_s:.2f}x |"
        )

        def stream_all() -> None:
            with kvformat.open(kv) as snap:
                for block in snap.blocks():
                    float(block.k[0, 0])

        stream_s = best_of(3, stream_all)
        lines.append(
            f"| stream every block, CRC on | {size / stream_s / 1e9:.2f} GB/s | sequential read "
            f"{size / read_s / 1e9:.2f} GB/s | {read_s / stream_s:.2f}x |"
        )
        kv.unlink()
        subset = arrays[:4]
        sub_gb = sum(a.nbytes for a in subset) / 1e9
        path = Path(tmp) / "codec.kv"
        for codec in ("zstd:1", "byteplane-zstd:1"):
            t = best_of(1, lambda codec=codec: kv_write(path, subset, codec))
            ratio = sub_gb * 1e9 / path.stat().st_size
            lines.append(f"| write {codec} | {sub_gb / t:.2f} GB/s (ratio {ratio:.2f}) | | |")
            path.unlink()
    samples = [
        (np.ascontiguousarray(a[t, h, :2048]), 2) for a in arrays[:2] for t in range(2) for h in range(heads)
    ]
    lines += codec_table(samples, "synthetic float16 K/V (Gaussian with per-channel scales)")
    for real in args.real:
        lines += codec_table(real_samples(real), f"real captured KV: {Path(real).name}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
