"""Remote reading against real servers on loopback: nginx (HTTP range requests) and moto's S3 API.

Checks that remote reads equal local ones, that opening fetches only the tail and header, that one
head of a multi-hundred-MB snapshot costs under 2x its stored size plus the index, and that a
vanished, truncated, replaced, silent or range-ignoring server gives a KVFormatError quickly."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat.io.remote import READ_AHEAD, RemoteSource, expand
from kvsnap.cli.conformance import describe
from tests.conftest import write_series
from tests.servers import S3, Nginx, Quirks, moto_s3, nginx, quirky_http

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"
BIG_LAYERS, BIG_HEADS, BIG_DIM, BIG_TOKENS = 10, 8, 64, 8192  # 335 MB of float32 K+V


def write_big(path: Path) -> None:
    rng = np.random.default_rng(7)
    specs = [kvformat.LayerSpec(BIG_HEADS, BIG_DIM, BIG_DIM, kvformat.FLOAT32)] * BIG_LAYERS
    positions = np.arange(BIG_TOKENS)
    with kvformat.Writer(path, specs, codec="raw", metadata={"name": "big"}) as w:
        for layer in range(BIG_LAYERS):
            k = rng.standard_normal((BIG_HEADS, BIG_TOKENS, BIG_DIM), dtype=np.float32)
            w.append(layer, k, k * 0.5 + layer, positions)
        w.snapshot()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    root = tmp_path_factory.mktemp("www")
    write_series(root / "series.kv", codec="zstd", chunk_bytes=200)
    write_big(root / "big.kv")
    shutil.copytree(VECTORS, root / "vectors", ignore=shutil.ignore_patterns("*.py"))
    with nginx(root, tmp_path_factory.mktemp("nginx")) as server:
        yield server


def source_of(snap: kvformat.Snapshot) -> RemoteSource:
    source = snap._file.source
    assert isinstance(source, RemoteSource)
    return source


def assert_same_snapshot(a: kvformat.Snapshot, b: kvformat.Snapshot) -> None:
    assert a.metadata == b.metadata and a.num_snapshots == b.num_snapshots
    for index in range(a.num_snapshots):
        x, y = a.select(index), b.select(index)
        assert x.metadata == y.metadata
        for layer, spec in enumerate(x.layers):
            for head in range(spec.num_heads if spec.present else 0):
                hx, hy = x.head(layer, head), y.head(layer, head)
                assert hx is not None and hy is not None
                np.testing.assert_array_equal(hx.k, hy.k)
                np.testing.assert_array_equal(hx.v, hy.v)
                np.testing.assert_array_equal(hx.positions, hy.positions)


def test_http_reads_equal_local_reads(served: Nginx) -> None:
    with kvformat.open(served.url("series.kv")) as remote, kvformat.open(served.root / "series.kv") as local:
        assert_same_snapshot(remote, local)
        assert remote.verify() == local.verify()


@pytest.mark.parametrize(
    "name", sorted(p.relative_to(VECTORS).as_posix() for p in VECTORS.rglob("*.kv")), ids=str
)
def test_every_conformance_vector_reads_the_same_over_http(served: Nginx, name: str) -> None:
    """Golden vectors describe identically; hostile ones fail with the same error class."""
    assert describe(served.url(f"vectors/{name}")) == describe(VECTORS / name)


def test_opening_fetches_only_the_tail_and_the_header(served: Nginx) -> None:
    before = len(served.log_lines())
    with kvformat.open(served.url("big.kv")) as snap:
        source = source_of(snap)
        assert source.size == (served.root / "big.kv").stat().st_size > 300e6
        assert source.requests == 2
        assert source.bytes_fetched <= 64 * 1024 + 64
        assert snap.num_layers == BIG_LAYERS
    lines = served.log_lines()[before:]
    assert [line.split()[1] for line in lines] == ["206", "206"]
    assert served.bytes_sent(before) == source.bytes_fetched


def test_one_head_costs_under_twice_its_size_plus_the_index(served: Nginx) -> None:
    with kvformat.open(served.url("big.kv")) as snap, kvformat.open(served.root / "big.kv") as local:
        file = snap._file
        stored = sum(
            file.chunk(c).stored_size + 64
            for s in snap.segments()
            if (s.layer, s.head) == (6, 3)
            for c in (s.k_chunk, s.v_chunk)
        )
        index = file.footer.chunk_count * 64 + file.footer.json_size + 64
        opened = len(served.log_lines())
        head = snap.head(6, 3)
        expected = local.head(6, 3)
        assert head is not None and expected is not None
        np.testing.assert_array_equal(head.k, expected.k)
        np.testing.assert_array_equal(head.v, expected.v)
        sent = served.bytes_sent(opened)
        assert 0.9 * stored <= sent < 2 * stored + index
        assert len(served.log_lines()) - opened <= 4  # K and V runs, coalesced
        tokens = snap.head(6, 3, positions=(100, 200))  # a cached head costs nothing more
        assert tokens is not None and served.bytes_sent(opened) == sent


def test_streaming_blocks_reads_ahead_in_large_requests(served: Nginx) -> None:
    with kvformat.open(served.url("big.kv")) as snap:
        source = source_of(snap)
        seen = sum(block.k.shape[0] for block in snap.blocks())
        assert seen == BIG_LAYERS * BIG_HEADS * BIG_TOKENS
        size = source.size
        assert source.bytes_fetched < 1.01 * size
        assert source.requests <= size // READ_AHEAD + 4
        assert source._cached <= source.cache_bytes


def test_vanished_file_is_a_kvformat_error(served: Nginx) -> None:
    path = served.root / "gone.kv"
    os.link(served.root / "big.kv", path)  # big: a small file is wholly in the tail fetched on open
    with kvformat.open(served.url("gone.kv")) as snap:
        path.unlink()
        with pytest.raises(kvformat.RemoteNotFoundError, match=r"gone\.kv"):
            snap.head(0, 1)
    with pytest.raises(kvformat.RemoteNotFoundError, match="not found"):
        kvformat.open(served.url("gone.kv"))


def test_truncated_or_replaced_file_is_a_kvformat_error(served: Nginx) -> None:
    path = served.root / "cut.kv"
    shutil.copy(served.root / "big.kv", path)
    with kvformat.open(served.url("cut.kv")) as snap:
        os.truncate(path, path.stat().st_size // 2)
        with pytest.raises(kvformat.KVFormatError, match=r"cut\.kv"):
            snap.head(BIG_LAYERS - 1, BIG_HEADS - 1)
    with pytest.raises(kvformat.TruncatedFileError):
        kvformat.open(served.url("cut.kv"))
    shutil.copy(served.root / "big.kv", path)
    with kvformat.open(served.url("cut.kv")) as snap:
        time.sleep(1.1)  # a new mtime, so a new ETag
        with path.open("r+b") as f:  # same size, new contents
            f.seek(100)
            f.write(b"changed")
        with pytest.raises(kvformat.RemoteError, match="changed"):
            snap.head(0, 0)


def test_a_silent_server_times_out() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(kvformat.RemoteError, match=r"no answer within 0\.5 s"):
            kvformat.open(f"http://127.0.0.1:{port}/x.kv", timeout=0.5)
        assert time.monotonic() - start < 5


def test_a_server_without_range_support_is_refused(tmp_path: Path) -> None:
    write_series(tmp_path / "s.kv")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(kvformat.RemoteError, match="ignores Range"):
            kvformat.open(f"http://127.0.0.1:{server.server_port}/s.kv")
    finally:
        server.shutdown()
        server.server_close()


def test_file_urls_are_memory_mapped(tmp_path: Path) -> None:
    write_series(tmp_path / "s.kv")
    with kvformat.open((tmp_path / "s.kv").as_uri()) as snap, kvformat.open(tmp_path / "s.kv") as local:
        assert not isinstance(snap._file.source, RemoteSource)
        assert_same_snapshot(snap, local)


@pytest.fixture(scope="module")
def s3(served: Nginx) -> Iterator[S3]:
    with moto_s3() as server:
        server.upload(served.root / "series.kv", "runs/series.kv")
        server.upload(served.root / "big.kv", "runs/big.kv")
        server.upload(VECTORS / "bfloat16-byteplane.kv", "runs/bf16.kv")
        yield server


def test_s3_reads_equal_local_reads(s3: S3, served: Nginx) -> None:
    options = s3.storage_options
    with (
        kvformat.open(f"s3://{s3.bucket}/runs/series.kv", storage_options=options) as remote,
        kvformat.open(served.root / "series.kv") as local,
    ):
        assert_same_snapshot(remote, local)
    assert describe(f"s3://{s3.bucket}/runs/bf16.kv", storage_options=options) == describe(
        VECTORS / "bfloat16-byteplane.kv"
    )


def test_s3_one_head_costs_under_twice_its_size_plus_the_index(s3: S3, served: Nginx) -> None:
    with (
        kvformat.open(f"s3://{s3.bucket}/runs/big.kv", storage_options=s3.storage_options) as snap,
        kvformat.open(served.root / "big.kv") as local,
    ):
        source = source_of(snap)
        index = snap._file.footer.chunk_count * 64 + snap._file.footer.json_size + 64
        stored = sum(
            snap._file.chunk(c).stored_size + 64
            for s in snap.segments()
            if (s.layer, s.head) == (2, 5)
            for c in (s.k_chunk, s.v_chunk)
        )
        opened = source.bytes_fetched
        head, expected = snap.head(2, 5), local.head(2, 5)
        assert head is not None and expected is not None
        np.testing.assert_array_equal(head.v, expected.v)
        assert source.bytes_fetched - opened < 2 * stored + index


def test_s3_through_a_pyarrow_filesystem(s3: S3, served: Nginx) -> None:
    from pyarrow import fs

    filesystem = fs.S3FileSystem(
        access_key="testing",
        secret_key="testing",
        endpoint_override=s3.endpoint,
        scheme="http",
        region="us-east-1",
    )
    with (
        kvformat.open(f"{s3.bucket}/runs/series.kv", filesystem=filesystem) as remote,
        kvformat.open(served.root / "series.kv") as local,
    ):
        assert_same_snapshot(remote, local)


def test_s3_missing_and_vanished_objects(s3: S3, served: Nginx) -> None:
    options = s3.storage_options
    with pytest.raises(kvformat.RemoteNotFoundError, match=r"nope\.kv"):
        kvformat.open(f"s3://{s3.bucket}/runs/nope.kv", storage_options=options)
    url = s3.upload(served.root / "big.kv", "tmp/big.kv")
    with kvformat.open(url, storage_options=options) as snap:
        s3.client().delete_object(Bucket=s3.bucket, Key="tmp/big.kv")
        with pytest.raises(kvformat.RemoteNotFoundError, match=r"tmp/big\.kv"):
            snap.head(1, 1)


def test_glob_expansion_lists_objects(s3: S3) -> None:
    found = expand(f"s3://{s3.bucket}/runs/*.kv", storage_options=s3.storage_options)
    assert found == [
        f"s3://{s3.bucket}/runs/bf16.kv",
        f"s3://{s3.bucket}/runs/big.kv",
        f"s3://{s3.bucket}/runs/series.kv",
    ]
    assert expand(f"s3://{s3.bucket}/runs/series.kv") == [f"s3://{s3.bucket}/runs/series.kv"]
    with pytest.raises(ValueError, match="cannot be listed"):
        expand("http://127.0.0.1:1/*.kv")


def test_redirects_retries_and_headers(tmp_path: Path) -> None:
    write_series(tmp_path / "s.kv")
    quirks = Quirks(redirects={"/old.kv": "/s.kv"}, failures=2, header=("Authorization", "Bearer t"))
    with quirky_http(tmp_path, quirks) as base, kvformat.open(tmp_path / "s.kv") as local:
        options = {"headers": {"Authorization": "Bearer t"}}
        with kvformat.open(f"{base}/old.kv", storage_options=options) as remote:
            assert_same_snapshot(remote, local)
        assert quirks.requests[:4] == ["/old.kv", "/s.kv", "/s.kv", "/s.kv"]  # 302, 503, 503, 206
        assert quirks.requests[4:] == ["/s.kv"] * (len(quirks.requests) - 4)  # the location is kept
        with pytest.raises(kvformat.RemoteError, match="HTTP 403"):
            kvformat.open(f"{base}/s.kv")
        quirks.failures = 10
        start = time.monotonic()
        with pytest.raises(kvformat.RemoteError, match="HTTP 503"):
            kvformat.open(f"{base}/s.kv", storage_options=options)
        assert time.monotonic() - start < 5  # three retries, 1.75 s of back-off, then an error
        quirks.failures = 0
        quirks.redirects = {"/loop.kv": "/loop.kv"}
        with pytest.raises(kvformat.RemoteError, match="too many redirects"):
            kvformat.open(f"{base}/loop.kv", storage_options=options)


def test_cli_reads_urls(served: Nginx, s3: S3, capsys: pytest.CaptureFixture[str]) -> None:
    from kvsnap.cli import main

    assert main(["info", served.url("series.kv"), "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main(["info", str(served.root / "series.kv"), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote.pop("file") == served.url("series.kv")
    local.pop("file")
    assert remote == local
    options = [f"--storage-option={k}={json.dumps(v)}" for k, v in s3.storage_options.items()]
    assert main(["verify", f"s3://{s3.bucket}/runs/series.kv", *options]) == 0
    assert main(["describe", f"s3://{s3.bucket}/runs/bf16.kv", *options]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == describe(VECTORS / "bfloat16-byteplane.kv")
    assert main(["info", served.url("missing.kv")]) == 2
    assert "RemoteNotFoundError" in capsys.readouterr().err


def test_a_head_larger_than_the_cache_is_fetched_once(served: Nginx) -> None:
    """A head in 16 runs scattered between other heads' chunks, 4x the cache: announcing it all
    would evict runs before they are read and fetch them twice; at most half the cache is."""
    from kvformat.io.http_range import HTTPRangeReader
    from kvformat.reader import Snapshot
    from kvformat.structure import FileStructure

    rng = np.random.default_rng(2)
    spec = kvformat.LayerSpec(4, 64, 64, kvformat.FLOAT32)
    with kvformat.Writer(served.root / "runs.kv", [spec, spec]) as w:
        for step in range(16):
            for layer in (0, 1):
                k = rng.standard_normal((4, 512, 64), dtype=np.float32)
                w.append(layer, k, k + 1, np.arange(step * 512, (step + 1) * 512))
        w.snapshot()
    source = RemoteSource(HTTPRangeReader(served.url("runs.kv")), cache_bytes=1 << 20)
    with Snapshot(FileStructure(source, True), -1) as snap, kvformat.open(served.root / "runs.kv") as local:
        opened = source.bytes_fetched
        head, expected = snap.head(1, 2), local.head(1, 2)  # 16 K and 16 V runs of 128 KB
        assert head is not None and expected is not None
        np.testing.assert_array_equal(head.k, expected.k)
        np.testing.assert_array_equal(head.v, expected.v)
        stored = expected.k.nbytes + expected.v.nbytes
        assert source.bytes_fetched - opened < 1.05 * stored
        assert source._cached <= source.cache_bytes


def test_fetch_plan_merges_near_ranges_and_keeps_to_the_budget() -> None:
    from kvformat.io.remote import plan_fetches

    # Sorted, merged across gaps up to 10 bytes, overlapping ranges folded into one span.
    spans = plan_fetches([(100, 10), (0, 10), (15, 5), (105, 20)], gap=10, budget=1000)
    assert spans == [(0, 20), (100, 125)]
    assert plan_fetches([(0, 10), (21, 5)], gap=10, budget=1000) == [(0, 10), (21, 26)]
    # Past the budget the rest is left to be read range by range; the first range always goes.
    assert plan_fetches([(0, 10), (50, 10), (100, 10)], gap=0, budget=25) == [(0, 10), (50, 60)]
    assert plan_fetches([(0, 100), (200, 10)], gap=0, budget=25) == [(0, 100)]
    assert plan_fetches([], gap=10, budget=100) == []
