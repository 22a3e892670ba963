"""The second reader: spec/js/describe.js, JavaScript under Node, written from SPEC.md
with the Kaitai grammar compiled to JavaScript for the layout. It must pass every vector and every
gold folder with the error categories, and describe exactly as kvformat does 200 random files and
1,000 byte-flipped or truncated mutants of them (fixed seed, made here, read by both)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

import kvformat
from kvformat.checksum import crc32c
from kvformat.layout import FOOTER_SIZE, Footer
from kvformat.manifest import QuerySpec
from kvformat.quantization import Quantization
from kvsnap.cli.conformance import describe, first_difference, run

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "spec" / "js"
NODE = shutil.which("node")
READER = f"node {JS / 'describe.js'}"
DTYPES = (kvformat.FLOAT32, kvformat.FLOAT16, kvformat.BFLOAT16)


@pytest.fixture(scope="module", autouse=True)
def node_modules() -> None:
    """The reader's npm packages, as `make test` installs them (`npm ci` from the lock file)."""
    if not (JS / "node_modules" / "fzstd").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(JS)], check=True)


def js_describe(paths: list[Path]) -> list[dict[str, object]]:
    """The JavaScript reader's descriptions of ``paths``, one process for all of them."""
    assert NODE is not None
    done = subprocess.run(
        [NODE, str(JS / "describe.js"), *map(str, paths)], capture_output=True, text=True, timeout=600
    )
    lines = done.stdout.splitlines()
    assert len(lines) == len(paths), done.stderr[-2000:]
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    "folder",
    [
        "",
        "gold/1.0",
        "gold/1.1",
        "gold/1.2",
        "gold/1.3",
        "gold/1.4",
        "gold/1.5",
        "gold/1.6",
        "gold/1.7",
        "gold/1.8",
        "fuzz",
    ],
)
def test_every_vector_and_gold_file(folder: str) -> None:
    # The current vectors as the runner's contract has it (a process per file, a crash fails one
    # vector); the gold folders and the fuzz corpus in one process each (--batch).
    results = run(ROOT / "spec" / "vectors" / folder, READER, batch=folder != "")
    assert len(results) >= (3 if folder == "fuzz" else 20)
    assert all(r.passed for r in results), [(r.name, r.detail) for r in results if not r.passed]


def _random_file(path: Path, rng: np.random.Generator) -> None:
    """A small file with what the format can hold, drawn from ``rng``: absent layers, every
    dtype and codec, unequal dims, quantized layers, queries, several sequences, a series with
    drops and attached arrays, metadata of every JSON type."""
    seqs = int(rng.integers(1, 3))
    specs: list[kvformat.LayerSpec] = []
    for _ in range(int(rng.integers(1, 4))):
        if rng.random() < 0.15:
            specs.append(kvformat.LayerSpec.absent({"kind": "recurrent"}))
            continue
        dtype = DTYPES[int(rng.integers(3))]
        heads = int(rng.integers(1, 4))
        if rng.random() < 0.2:
            q = Quantization(bits=int(rng.choice([2, 4, 8])), group_size=32)
            specs.append(
                kvformat.LayerSpec(
                    heads, 32, 64, dtype if dtype != kvformat.FLOAT32 else kvformat.FLOAT16, quantization=q
                )
            )
            continue
        k_dim, v_dim = int(rng.choice([4, 8, 16])), int(rng.choice([4, 8]))
        queries = None
        if rng.random() < 0.3:
            per = int(rng.integers(1, 3))
            queries = QuerySpec(
                heads * per,
                k_dim,
                DTYPES[int(rng.integers(3))],
                0.125,
                tuple(h // per for h in range(heads * per)),
                None,
                0,
                None,
                None,
            )
        specs.append(kvformat.LayerSpec(heads, k_dim, v_dim, dtype, {"kind": "full"}, queries=queries))
    codec = ["raw", "zstd", "byteplane-zstd"][int(rng.integers(3))]
    metadata = {
        "model": "random",
        "n": int(rng.integers(1 << 40)),
        "x": float(rng.standard_normal()),
        "flag": bool(rng.random() < 0.5),
        "none": None,
        "text": "K\u00fcche \u2603",
        "list": [1, 2.5, "a"],
    }
    positions = [[0] * seqs for _ in specs]
    with kvformat.Writer(path, specs, num_seqs=seqs, metadata=metadata, codec=codec) as writer:
        for step in range(int(rng.integers(1, 4))):
            for layer, spec in enumerate(specs):
                if not spec.present:
                    continue
                for seq in range(seqs):
                    n = int(rng.integers(0, 6))
                    start = positions[layer][seq]
                    if n:
                        writer.append(layer, *_tensors(spec, n, rng), np.arange(start, start + n), seq=seq)
                        if spec.queries is not None:
                            q = rng.standard_normal((spec.queries.num_heads, n, spec.queries.dim))
                            writer.append_queries(
                                layer,
                                q.astype(spec.queries.dtype.numpy),
                                np.arange(start, start + n),
                                seq=seq,
                            )
                        positions[layer][seq] = start + n
                    if step and rng.random() < 0.3 and positions[layer][seq] > 2:
                        writer.drop(layer, 0, 2, seq=seq)
            arrays = (
                {"last_logits": rng.standard_normal((seqs, 5)).astype(np.float32)}
                if rng.random() < 0.3
                else None
            )
            writer.snapshot({"step": step}, arrays=arrays)


def _tensors(spec: kvformat.LayerSpec, n: int, rng: np.random.Generator) -> tuple[object, object]:
    assert spec.dtype is not None
    if spec.quantization is None:
        k = rng.standard_normal((spec.num_heads, n, spec.k_dim)).astype(spec.dtype.numpy)
        v = rng.standard_normal((spec.num_heads, n, spec.v_dim)).astype(spec.dtype.numpy)
        return k, v
    parts = []
    for dim in (spec.k_dim, spec.v_dim):
        words, groups = spec.quantization.widths(dim)
        parts.append(
            (
                rng.integers(0, 2**32, (spec.num_heads, n, words), dtype=np.uint32),
                rng.standard_normal((spec.num_heads, n, groups)).astype(spec.dtype.numpy),
                rng.standard_normal((spec.num_heads, n, groups)).astype(spec.dtype.numpy),
            )
        )
    return parts[0], parts[1]


def _mutant(data: bytes, rng: np.random.Generator) -> bytes:
    """A truncation; or one to three flipped bytes anywhere (mostly caught by a CRC); or, half
    the time, flipped bytes in the chunk table and index JSON with the index and footer CRCs
    recomputed, so that the rules behind the CRCs (R4, R6-R14) decide."""
    if rng.random() < 0.15:
        return data[: int(rng.integers(0, len(data)))]
    out = bytearray(data)
    try:
        index_start, index_end = (
            Footer.unpack(bytes(data[-FOOTER_SIZE:])).index_offset,
            len(data) - FOOTER_SIZE,
        )
    except (kvformat.KVFormatError, struct.error):  # a mutant of a mutant: no footer to recompute
        index_start = index_end = 0
    behind_crcs = rng.random() < 0.5 and index_end > index_start
    for _ in range(int(rng.integers(1, 4))):
        at = int(rng.integers(index_start, index_end)) if behind_crcs else int(rng.integers(0, len(data)))
        out[at] ^= 1 << int(rng.integers(8))
    if behind_crcs:
        crc = crc32c(bytes(out[index_start:index_end]), crc32c(bytes(out[:64])))
        out[-FOOTER_SIZE + 32 : -FOOTER_SIZE + 36] = struct.pack("<I", crc)
        out[-4:] = struct.pack("<I", crc32c(bytes(out[-FOOTER_SIZE:-4])))
    return bytes(out)


def test_random_files_and_mutants_agree_with_kvformat(tmp_path: Path) -> None:
    rng = np.random.default_rng(48)
    originals = []
    for i in range(200):
        path = tmp_path / f"random-{i:03d}.kv"
        _random_file(path, rng)
        originals.append(path)
    mutants = []
    for i in range(1000):
        path = tmp_path / f"mutant-{i:04d}.kv"
        path.write_bytes(_mutant(originals[int(rng.integers(200))].read_bytes(), rng))
        mutants.append(path)
    paths = originals + mutants
    expected = [describe(p) for p in paths]
    actual = js_describe(paths)
    assert all("error" not in e for e in expected[:200])  # the random files are valid
    categories = Counter(str(e.get("error", "read")) for e in expected[200:])
    # the mutants reach the rules behind the CRCs, not only the CRCs
    assert categories["ChecksumError"] < 700 and categories["CorruptFileError"] > 150, categories
    # equal as the conformance runner compares (numbers as doubles: 1.0 and 1 are one value)
    disagree = [
        (p.name, e.get("error"), a.get("error"))
        for p, e, a in zip(paths, expected, actual, strict=True)
        if first_difference(e, a)
    ]
    assert not disagree, disagree[:10]


def test_the_compiled_grammar_is_current(tmp_path: Path) -> None:
    """spec/js/Kv.js is what the Kaitai compiler makes of spec/kv.ksy today."""
    compiler = JS / "node_modules" / "kaitai-struct-compiler"
    assert compiler.exists()
    grammar = json.dumps(yaml.safe_load((ROOT / "spec" / "kv.ksy").read_text("utf-8")))
    subprocess.run(
        [NODE, str(ROOT / "tests" / "kaitai" / "compile.js"), str(tmp_path), "javascript"],
        input=grammar,
        text=True,
        check=True,
        capture_output=True,
        env={"NODE_PATH": str(JS / "node_modules")},
    )
    assert (tmp_path / "Kv.js").read_text() == (JS / "Kv.js").read_text()
