"""An independent parser: spec/kv.ksy compiled by the Kaitai Struct compiler (npm) into Python
must parse every golden vector and agree with the manifest on structure and raw payload bytes."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "spec" / "vectors"
pytestmark = pytest.mark.npm

COMPILER_DIR = Path(os.environ.get("KVSNAP_KAITAI_DIR", ROOT / ".cache" / "kaitai"))


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    modules = COMPILER_DIR / "node_modules"
    if not (modules / "kaitai-struct-compiler").exists():  # `make test` installs it beforehand
        npm = shutil.which("npm")
        assert npm, "npm is needed to install kaitai-struct-compiler"
        subprocess.run(
            [
                npm,
                "install",
                "--silent",
                "--no-audit",
                "--no-fund",
                "--prefix",
                str(COMPILER_DIR),
                "kaitai-struct-compiler@0.11.0",
            ],
            check=True,
            timeout=300,
        )
    out = tmp_path_factory.mktemp("kaitai")
    grammar = json.dumps(yaml.safe_load((ROOT / "spec" / "kv.ksy").read_text("utf-8")))
    node = shutil.which("node")
    assert node, "node is needed to run the Kaitai Struct compiler"
    subprocess.run(
        [node, str(ROOT / "tests" / "kaitai" / "compile.js"), str(out)],
        input=grammar,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "NODE_PATH": str(modules)},
    )
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("kv")
    finally:
        sys.path.remove(str(out))


QUERY_DEFAULTS = {"window": None, "keep": 0, "softcap": None, "sinks": None}


def _described(layer: dict) -> dict:
    """A manifest layer as SPEC section 17 describes it: an absent layer as ``present`` and
    ``attributes`` only; a present one with its keys, a ``queries`` object with all nine."""
    if not layer.get("present", True):
        return {"present": False, "attributes": layer.get("attributes", {})}
    out = {"present": True, **{k: layer[k] for k in ("num_heads", "k_dim", "v_dim", "dtype")}}
    out["attributes"] = layer.get("attributes", {})
    if "quantization" in layer:
        out["quantization"] = layer["quantization"]
    if "queries" in layer:
        out["queries"] = {
            **layer["queries"],
            **{k: layer["queries"].get(k, v) for k, v in QUERY_DEFAULTS.items()},
        }
    return out


def manifest_entries() -> list[dict]:
    manifest = json.loads((VECTORS / "manifest.json").read_text("utf-8"))
    return [e for e in manifest["vectors"] if "error" not in e["expect"]]


@pytest.mark.parametrize("entry", manifest_entries(), ids=lambda e: e["file"])
def test_kaitai_parser_agrees_with_the_manifest(kv: ModuleType, entry: dict) -> None:
    parsed = kv.Kv.from_file(str(VECTORS / entry["file"]))
    expect = entry["expect"]
    assert [parsed.header.major, parsed.header.minor] == expect["version"]
    assert [parsed.footer.major, parsed.footer.minor] == expect["version"]
    index = json.loads(parsed.index_json)
    assert [_described(layer) for layer in index["manifest"]["layers"]] == expect["layers"]
    assert index["manifest"]["metadata"] == expect["metadata"]
    assert len(index["snapshots"]) == expect["num_snapshots"]
    table = parsed.chunk_table
    assert len(table) == parsed.footer.chunk_count
    offsets = [d.offset for d in table]
    assert offsets == sorted(offsets) and all(o % 64 == 0 for o in offsets)
    for d in table:
        assert d.record_descriptor[:4] == b"KVCK"
        assert int.from_bytes(d.record_descriptor[32:40], "little") == d.offset  # self-located
        assert len(d.payload) == d.stored_size
    # Raw single-snapshot files: each head's payloads in position order are the decoded rows.
    layers = expect["layers"]
    if expect["num_snapshots"] != 1 or any(d.codec.value != 0 for d in table):
        return
    if any("quantization" in layer for layer in layers):
        return
    pieces: dict[tuple[int, int, int, int], list[tuple[int, bytes]]] = defaultdict(list)
    for d in table:
        if d.kind.value in (0, 1):
            pieces[(d.layer, d.seq, d.head, d.kind.value)].append((d.position, d.payload))
    heads = expect["snapshots"][0]["heads"]
    assert heads, entry["file"]
    queries: dict[tuple[int, int, int], list[tuple[int, bytes]]] = defaultdict(list)
    for d in table:
        if d.kind.value == 3:
            queries[(d.layer, d.seq, d.head)].append((d.position, d.payload))
    for query in expect["snapshots"][0].get("queries", []):
        data = b"".join(p for _, p in sorted(queries[(query["layer"], query["seq"], query["head"])]))
        assert hashlib.sha256(data).hexdigest() == query["q"], (entry["file"], query)
    for head in heads:
        for kind, name in ((0, "k"), (1, "v")):
            data = b"".join(p for _, p in sorted(pieces[(head["layer"], head["seq"], head["head"], kind)]))
            assert hashlib.sha256(data).hexdigest() == head[name], (entry["file"], head, name)
